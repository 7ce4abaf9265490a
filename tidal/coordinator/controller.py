"""The coordinator: the source of truth for a job's membership, and its one control loop.

Threads: the HTTP API (uvicorn's) calls the ``on_*`` methods; the controller thread calls
``tick`` when an API call sets ``wake`` or a worker exits (``Backend.wake_fds``), and
otherwise at the interval ``pacing.loop_wait`` gives. Both hold ``self.lock``, so each sees a
consistent job.
Decisions come from pure functions (``rules``, ``policy.reconcile``, ``policy.schedule``);
``tick`` turns them into changes of the job in memory (``job.Job``) and actions
(``actions``: open generations, start, signal and adopt processes, write records), which
``self.executor`` (``executor.Executor``) carries out at once, in order: it is the only
code that touches the backend, the rendezvous store and SQLite.

The class is composed of one mixin per concept, each in its module: the loop's pass
(``loop``), the API's handlers (``handlers``) and their effects (``effects``), what readers
see (``views``), scaling (``scaling``) and the workers' processes (``lifecycle``). This
module holds the job's construction, its records' writes (``flush``) and its end.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections import deque
from pathlib import Path

import torch.distributed as dist

from tidal.backends import get_backend
from tidal.checkpoint import fence
from tidal.config import JobSpec
from tidal.coordinator import phase
from tidal.coordinator.accounting import Accounting
from tidal.coordinator.actions import (
    FenceCheckpoints,
    RecordEvent,
    RecordJob,
    RecordWorkers,
)
from tidal.coordinator.db import Database
from tidal.coordinator.effects import Effects, RequestError
from tidal.coordinator.executor import Executor
from tidal.coordinator.fencing import settled_rows
from tidal.coordinator.handlers import Handlers
from tidal.coordinator.home import db_path, job_dir
from tidal.coordinator.job import Job
from tidal.coordinator.journal import Journal
from tidal.coordinator.lifecycle import Lifecycle
from tidal.coordinator.loop import ControlLoop
from tidal.coordinator.records import Resume, WorkerRecord, changed_rows
from tidal.coordinator.scale_rules import effective_target
from tidal.coordinator.scaling import Scaling
from tidal.coordinator.snapshot import JobRow
from tidal.coordinator.supervisor import Hosting, listen, url_of
from tidal.coordinator.views import Views
from tidal.coordinator.wake import Wake
from tidal.policy.inputs import PolicyParams
from tidal.policy.registry import get_policy
from tidal.protocol import EventView, JobState, WorkerState
from tidal.sim.trace import load_trace
from tidal.store_auth import AuthStore, derive_key


class Coordinator(ControlLoop, Handlers, Effects, Views, Scaling, Lifecycle):
    def __init__(
        self,
        spec: JobSpec,
        home: Path,
        *,
        host: str | None = None,
        resume: Resume | None = None,
        hosting: Hosting | None = None,
        recover: bool = False,
    ) -> None:
        """``host``: the address to bind and to give workers; default: the backend's (loopback
        for local workers, this node's cluster address for Ray). ``hosting``: the token and
        listening sockets its supervisor holds for it (``supervisor``); ``recover``: a
        previous coordinator of the job died, rebuild from its records (``recovery``)."""
        get_policy(spec.policy)  # fail early on an unknown name
        self.spec = spec
        self.resume = resume
        self.hosting = hosting
        self.token = hosting.token if hosting else secrets.token_urlsafe(24)
        self.jobdir = job_dir(home, spec.name)
        self.jobdir.logs.mkdir(parents=True, exist_ok=True)
        # Before the job's record: a backend that cannot start (no cluster) leaves none.
        backend = get_backend(spec.backend)(spec=spec, log_dir=self.jobdir.logs, cwd=Path.cwd())
        if hosting is not None:
            backend.reaped_fd = hosting.reaped_r  # orphans' exit statuses
        self.host = host or backend.host
        db = Database(db_path(home))
        self._gen_base, self._worker_base = 0, 0
        if recover:
            pass  # the job's records are there: ``_recover`` reads them
        elif resume is None:
            db.create_job(name=spec.name, spec=spec.to_dict(), target=spec.workers)
        else:
            db.reopen_job(name=spec.name, spec=spec.to_dict(), target=spec.workers)
            gen, wid = db.max_ids(spec.name)
            self._gen_base, self._worker_base = gen, wid + 1
        self.jobdir.write_spec(spec.to_dict())
        journal = Journal(db, spec.name)  # the only writer of the job's records
        journal.load(
            unwritten=JobRow(
                state=JobState.PENDING.value,
                spec=spec.to_dict(),
                created=time.time(),
                target_workers=spec.workers,
            )
        )
        # Every store key of this coordinator lives under it (``store_keys.generation_prefix``):
        # it keeps jobs and coordinators apart; it is no secret (a client can list keys).
        self.store_namespace = secrets.token_hex(16)
        # What authenticates every value in the store (``store_auth``): workers get it
        # through the authenticated API; the same for a restarted coordinator (same token).
        self.store_key = derive_key(self.token)
        #: The only door to the world: worker processes, the store, the records.
        self.executor = Executor(
            backend=backend,
            store=AuthStore(
                _bound_store(self.host, hosting.store_sock if hosting else None), self.store_key
            ),
            namespace=self.store_namespace,
            journal=journal,
        )
        self.lock = threading.RLock()
        self.published = threading.Condition()  # ``Handlers._publish``
        # Set by API calls that need a decision (a registration, a failure report, a
        # scale, a stop, members holding at a scheduled step): the loop ticks at once
        # instead of at its next interval.
        self.wake = Wake()
        self.url = url_of(hosting.api_sock) if hosting else ""
        step = resume.step if resume else 0
        passed = [at for at, _ in spec.schedule if at <= step]  # a resumed job passed these
        self.job = Job(
            target=spec.workers,
            requested=spec.workers,
            created=time.time(),
            step=step,
            schedule_done=len(passed),
            settled_step=passed[-1] if passed else -1,
        )
        self.accounting = Accounting(
            price=spec.price_per_worker_hour,
            trace=load_trace(spec.capacity_trace) if spec.capacity_trace else None,
            # joiners warm up before joining: pauses are short
            params=PolicyParams.from_spec(spec, assumed_pause_s=1.0),
        )
        self.inbox = deque()  # quick heartbeats, applied by the loop (``Handlers``)
        self._last_check: float | None = None  # the last heartbeat check (lifecycle)
        self._last_health = 0.0  # when the loop last checked heartbeats
        self._last_flush = 0.0
        self._policy = get_policy(spec.policy)
        self._fence_failed: str | None = None
        self.fence_epoch = self._fence_checkpoints(recover=recover)
        if recover:
            self._recover()
            self._publish()
            self._publish_view()
            return
        if resume is None:
            self.event(
                "job", f"job {spec.name} created: {spec.workers} workers, script {spec.script}"
            )
        else:
            for line in resume.warnings:
                self.event("checkpoint", line)
            for line in resume.ended:
                self.event("worker", line)
            # No worker of the previous run stays live in the records (``fencing``).
            old = settled_rows(self.executor.records.workers.values())
            if old:
                self.executor.do(RecordWorkers(rows=tuple(old)))
            self.event(
                "job",
                f"job {spec.name} resumed from {resume.path} (step {resume.step}) "
                f"with {spec.workers} workers",
            )
        if self._fence_failed:  # its checkpoints fail too, and say so; the job goes on
            self.event("coordinator", self._fence_failed)

        self._set_target(spec.workers, "the capacity at the start")
        self._publish()
        self._publish_view()

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.jobdir.path / "checkpoints" if self.spec.checkpoints else None

    def _fence_checkpoints(self, *, recover: bool) -> str | None:
        """This run's epoch (``checkpoint.fence``), which its workers' checkpoint writes are
        checked against: the one on disk for a coordinator that takes over the run (a restart,
        ``tidal attach``: the same workers); a new one, written before any worker starts,
        for a new run (``tidal run``, ``tidal resume``): the old run's writes are refused."""
        if self.checkpoint_dir is None:
            return None
        on_disk = fence.read(self.checkpoint_dir) if recover else None
        if on_disk is not None:
            return on_disk.epoch
        epoch = secrets.token_hex(8)
        failed = self.executor.do(FenceCheckpoints(directory=str(self.checkpoint_dir), epoch=epoch))
        if failed:
            self._fence_failed = f"the checkpoint folder's fence could not be written ({failed})"
        return epoch

    # -- helpers -------------------------------------------------------------------------
    def event(self, kind: str, message: str) -> None:
        self.executor.do(RecordEvent(event=EventView(time=time.time(), kind=kind, message=message)))

    def _worker(self, wid: int) -> WorkerRecord:
        w = self.job.workers.get(wid)
        if w is None:
            raise RequestError(f"unknown worker {wid}")
        return w

    # -- targets and outcomes ----------------------------------------------------------
    def _set_target(self, n: int, why: str) -> None:
        """The requested count; the target is that, within the capacity available now."""
        self.job.requested = n
        effective = effective_target(n, self.accounting.capacity())
        if effective != self.job.target:
            self.event("scale", f"target {self.job.target} -> {effective} ({why})")
            self.job.target = effective
            self.job.target_changed_at = time.monotonic()
            self.executor.do(RecordJob(values={"target_workers": effective}))
        self._save_control()

    def decide(self, outcome: JobState, why: str | None, *, overturn: bool = False) -> None:
        """Decide the job's outcome: the one door (``phase.decide``), its records written
        at once."""
        for action in phase.decide(self.job, outcome, why, now=time.time(), overturn=overturn):
            self.executor.do(action)

    def flush(self) -> None:
        """Write the fast-moving values to SQLite (under the lock), the heartbeats queued
        since the last pass applied first; then publishes what readers see (``views``)."""
        self._drain()
        self._last_flush = time.monotonic()
        self.job.metrics.update(
            self.accounting.summary(
                step=self.job.step,
                global_batch=self._int_metric("global_batch_size"),
                max_steps=self._int_metric("max_steps"),
            )
        )
        self.executor.do(
            RecordJob(
                values={
                    "state": self.job.state.value,
                    "step": self.job.step,
                    "world_size": self.job.world_size(),
                    "target_workers": self.job.target,
                    "metrics": self.job.metrics,
                    # A job that ended is served by nobody: no address to call (the
                    # records of one whose coordinator died keep its last one).
                    "url": (self.url or None) if not self.job.state.terminal else None,
                }
            )
        )
        self._save_workers()
        self._save_control()
        self._publish_view()

    def _save_worker(self, w: WorkerRecord) -> None:
        """Write one worker's row now (a change the status must show at once)."""
        self.executor.do(RecordWorkers(rows=(w.row(),)))

    def _save_workers(self) -> None:
        """Write the worker rows that changed since they were written (``changed_rows``
        against the journal's copy of what SQLite holds)."""
        rows = changed_rows(
            [w.row() for w in self.job.workers.values()], self.executor.records.workers
        )
        if rows:
            self.executor.do(RecordWorkers(rows=tuple(rows)))

    def close(self, *, kill_workers: bool = True) -> None:
        """``kill_workers`` False: the coordinator crashed; its workers train on and its
        successor adopts them (``Executor.close``). Its ``coordinator.json`` stays then: the
        successor rewrites it, and if none comes (the supervisor died too) ``tidal attach``
        takes the workers over at the address and with the token it names."""
        if kill_workers:  # the job ended: what is left is recorded as ended, and killed
            for w in self.job.workers.values():  # by ``Executor.close`` below
                if w.live:
                    w.state, w.rank = WorkerState.EXITED, None
                    w.exit_code = -9 if w.exit_code is None else w.exit_code
            self._save_workers()
        self.executor.close(kill_workers=kill_workers)
        self.wake.close()
        if not kill_workers:
            return
        if self.fence_epoch is not None and self.job.state.terminal:
            # Its workers are killed: the job's checkpoints are final (``checkpoint.fence``).
            why = f"job {self.spec.name} {self.job.state.value} at step {self.job.step}"
            self.executor.do(
                FenceCheckpoints(
                    directory=str(self.checkpoint_dir), epoch=self.fence_epoch, sealed=why
                )
            )
        try:
            os.remove(self.jobdir.coordinator_file)
        except OSError:
            pass


def _bound_store(host: str, sock: socket.socket | None = None) -> dist.TCPStore:
    """The rendezvous store, listening on ``host`` only (loopback for local workers).

    ``TCPStore`` itself would listen on every interface; it serves a socket bound here
    instead (``master_listen_fd``), on a port the OS picks, or ``sock``, the supervisor's
    (this process's copy of it: a restarted coordinator serves the same port). The store
    owns the descriptor from then on (``detach``): closing it under the store's event loop
    made that loop spin and the process hang at exit."""
    if sock is None:
        sock = listen(host)
    store = dist.TCPStore(
        host,
        sock.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    sock.detach()
    return store
