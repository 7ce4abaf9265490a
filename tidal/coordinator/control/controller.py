"""The coordinator: the source of truth for a job's membership, and its one control loop.

Threads: the HTTP API (uvicorn's) calls the ``on_*`` methods; the controller thread calls
``tick`` when an API call sets ``wake`` or a worker exits (``Backend.wake_fds``), and
otherwise at the interval ``pacing.loop_wait`` gives. Both hold ``self.lock``, so each sees a
consistent job.
Decisions come from pure functions (the ``*_rules`` modules, ``phase``, ``policy.reconcile``,
``policy.schedule``); the parts below turn them into changes of the job in memory
(``job.Job``) and actions (``actions``: open generations, start, signal and adopt
processes, write records), which ``self.executor`` (``executor.Executor``) carries out at
once, in order: it is the only code that touches the backend, the rendezvous store and
SQLite.

``Coordinator`` is composed, not inherited: each concept is a part in its module, built
here with exactly what it needs, and the parts call each other's public methods only:

- ``ledger`` (``ledger.Ledger``): events, the outcome (``phase.decide``), the target, rows;
- ``publisher`` (``publish.Publisher``): what workers are told, lock-free;
- ``generations`` (``generations.Generations``): generations opened;
- ``lifecycle`` (``lifecycle.Lifecycle``): the workers' processes;
- ``worlds`` (``worlds.Worlds``): restart-based membership under ``--torchrun``;
- ``scaling`` (``scaling.Scaling``): schedule, policy, capacity, leavers;
- ``effects`` (``effects.Effects``) and ``handlers`` (``handlers.Handlers``): the API's
  facts and what each does;
- ``views`` (``views.Views``): the records' flush and what readers see;
- ``loop`` (``loop.ControlLoop``): one pass.

This module holds the job's construction, the public face the host and the server call
(delegated to the parts) and the job's end (``close``).
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
from tidal.backends.host_registry import HostRegistry
from tidal.checkpoint import fence
from tidal.checkpoint.location import Location
from tidal.config import JobSpec
from tidal.coordinator.actions import FenceCheckpoints, RecordWorkers
from tidal.coordinator.control.lifecycle import recovered_job
from tidal.coordinator.control.parts import compose
from tidal.coordinator.control.wake import Wake
from tidal.coordinator.executor import Executor
from tidal.coordinator.job import Job
from tidal.coordinator.process.fencing import settled_rows
from tidal.coordinator.process.supervisor import Hosting, listen, url_of
from tidal.coordinator.records.accounting import Accounting
from tidal.coordinator.records.db import Database
from tidal.coordinator.records.home import checkpoint_folder, db_path, job_dir
from tidal.coordinator.records.journal import Journal
from tidal.coordinator.records.records import Resume
from tidal.coordinator.records.snapshot import JobRow
from tidal.policy.inputs import PolicyParams
from tidal.policy.registry import Policy, get_policy
from tidal.protocol import (
    DoneReport,
    FailureReport,
    HeartbeatRequest,
    JobState,
    JobStatus,
    RegisterRequest,
    RegisterResponse,
    StopAnswer,
    StopReport,
    WorkerConfig,
    WorkerState,
)
from tidal.sim.trace import load_trace
from tidal.store_auth import AuthStore, derive_key


class Coordinator:
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
        policy = get_policy(spec.policy)  # fail early on an unknown name
        self.spec = spec
        self.resume = resume
        self.hosting = hosting
        self.token = hosting.token if hosting else secrets.token_urlsafe(24)
        self.home = home
        self.jobdir = job_dir(home, spec.name)
        self.jobdir.logs.mkdir(parents=True, exist_ok=True)
        # Before the job's record: a backend that cannot start (no cluster) leaves none.
        backend = get_backend(spec.backend)(spec=spec, log_dir=self.jobdir.logs, cwd=Path.cwd())
        if hosting is not None:
            backend.reaped_fd = hosting.reaped_r  # orphans' exit statuses
        self.host = host or backend.host
        db = Database(db_path(home))
        gen_base, worker_base = 0, 0
        if recover:
            pass  # the job's records are there: ``recovered_job`` reads them
        elif resume is None:
            db.create_job(name=spec.name, spec=spec.to_dict(), target=spec.workers)
        else:
            db.reopen_job(name=spec.name, spec=spec.to_dict(), target=spec.workers)
            gen, wid = db.max_ids(spec.name)
            gen_base, worker_base = gen, wid + 1
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
        # Set by API calls that need a decision (a registration, a failure report, a
        # scale, a stop, members holding at a scheduled step): the loop ticks at once
        # instead of at its next interval.
        self.wake = Wake()
        self._url = url_of(hosting.api_sock) if hosting else ""
        rebuilt = None
        if recover:
            self.job, rebuilt = recovered_job(
                self.executor.status(),
                self.executor.saved_control(),
                namespace=self.store_namespace,
            )
        else:
            step = resume.step if resume else 0
            passed = [at for at, _ in spec.schedule if at <= step]  # a resumed job passed these
            self.job = Job(
                target=spec.workers,
                requested=spec.workers,
                created=time.time(),
                step=step,
                schedule_done=len(passed),
                settled_step=passed[-1] if passed else None,
                # The checkpoint resumed from is on disk, verified (``launch.cmd_resume``): a
                # job resumed at its last step has its final checkpoint already (its member
                # writes none again, and ``end_rules.final_checkpoint`` found it missing).
                checkpointed={resume.step} if resume else set(),
            )
        self.accounting = Accounting(
            price=spec.price_per_worker_hour,
            trace=load_trace(spec.capacity_trace) if spec.capacity_trace else None,
            # joiners warm up before joining: pauses are short
            params=PolicyParams.from_spec(spec, assumed_pause_s=1.0),
        )
        self.inbox = deque()  # facts not applied yet (``Handlers``)
        self._fence_failed: str | None = None
        self.fence_epoch = self._fence_checkpoints(recover=recover)
        self._compose(policy, gen_base=gen_base, worker_base=worker_base)
        if rebuilt is not None:
            self.lifecycle.adopt(rebuilt, incarnation=self.hosting.incarnation if hosting else 0)
            self.publisher.publish()
            self.views.publish_view()
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

        self.ledger.set_target(spec.workers, "the capacity at the start")
        self.publisher.publish()
        self.views.publish_view()

    def _compose(self, policy: Policy, *, gen_base: int, worker_base: int) -> None:
        """Build the parts, each with what it needs (``parts.compose``)."""
        parts = compose(
            job=self.job,
            spec=self.spec,
            executor=self.executor,
            accounting=self.accounting,
            policy=policy,
            lock=self.lock,
            wake=self.wake,
            inbox=self.inbox,
            namespace=self.store_namespace,
            first_generation=gen_base + 1,
            first_worker=worker_base,
            checkpoint_dir=self.checkpoint_dir,
            token=self.token,
            url=self.url,
            config=WorkerConfig.from_spec(
                self.spec,
                store_host=self.host,
                store_port=self.executor.store_port,
                store_namespace=self.store_namespace,
                store_key=self.store_key,
                checkpoint_dir=str(self.checkpoint_dir) if self.checkpoint_dir else None,
                checkpoint_fence=self.fence_epoch,
                resume_from=self.resume.path if self.resume else None,
            ),
            resumed_step=self.resume.step if self.resume else None,
        )
        self.ledger, self.publisher, self.generations = (
            parts.ledger,
            parts.publisher,
            parts.generations,
        )
        self.lifecycle, self.scaling, self.effects = parts.lifecycle, parts.scaling, parts.effects
        self.handlers, self.views, self.loop = parts.handlers, parts.views, parts.loop

    @property
    def url(self) -> str:
        """The API's URL: given to workers, recorded while the job is served."""
        return self._url

    @url.setter
    def url(self, value: str) -> None:
        """Set by the host once its server listens (the supervisor's socket's, if any):
        the parts that give it out take it too."""
        self._url = value
        self.lifecycle.url = self.views.url = value

    @property
    def hosts(self) -> HostRegistry | None:
        """What the agents of joined hosts call (``--listen``: the hosts backend), under its
        own lock, never the coordinator's; None for a job that takes no hosts."""
        return self.executor.hosts

    @property
    def checkpoint_dir(self) -> Location | None:
        """The job's checkpoint folder or URL (``home.checkpoint_folder``); None: none."""
        if not self.spec.checkpoints:
            return None
        return checkpoint_folder(self.home, self.spec.name, self.spec.checkpoint_storage)

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
        # Outside the home, the folder keeps the job's spec too (the home has its own copy).
        spec = self.spec.to_dict() if self.spec.checkpoint_storage is not None else None
        failed = self.executor.do(
            FenceCheckpoints(directory=str(self.checkpoint_dir), epoch=epoch, spec=spec)
        )
        if failed:
            self._fence_failed = f"the checkpoint folder's fence could not be written ({failed})"
        return epoch

    # -- the public face: the loop, readers, the API ----------------------------------------
    def event(self, kind: str, message: str) -> None:
        self.ledger.event(kind, message)

    def tick(self) -> bool:
        """One pass of the control loop (``ControlLoop.tick``); False once the job ended."""
        return self.loop.tick()

    def settled(self) -> bool:
        return self.loop.settled()

    def flush(self) -> None:
        """Write the fast-moving values to SQLite and publish what readers see (under the
        lock; ``Views.flush``)."""
        self.views.flush()

    def status(self, *, fresh: bool = False) -> JobStatus:
        return self.views.status(fresh=fresh)

    def worker_steps(self) -> tuple[int, list[tuple[int, int, bool]]]:
        return self.views.worker_steps()

    def sample(self) -> tuple[int, int, int, dict[str, float], list, dict]:
        return self.views.sample()

    def on_register(self, wid: int, req: RegisterRequest) -> RegisterResponse:
        return self.handlers.on_register(wid, req)

    def heartbeat_is_quick(self, req: HeartbeatRequest) -> bool:
        return self.handlers.heartbeat_is_quick(req)

    def on_heartbeat(self, wid: int, req: HeartbeatRequest) -> bytes:
        return self.handlers.on_heartbeat(wid, req)

    def on_role(self, wid: int) -> bytes:
        return self.handlers.on_role(wid)

    def on_failure(self, wid: int, r: FailureReport) -> None:
        self.handlers.on_failure(wid, r)

    def on_done(self, wid: int, r: DoneReport) -> None:
        self.handlers.on_done(wid, r)

    def on_script_stop(self, wid: int, r: StopReport) -> StopAnswer:
        return self.handlers.on_script_stop(wid, r)

    def on_refused(self, wid: int, message: str) -> None:
        self.handlers.on_refused(wid, message)

    def on_scale(self, n: int) -> None:
        self.handlers.on_scale(n)

    def on_stop(self) -> None:
        self.handlers.on_stop()

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
            self.ledger.save_workers()
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
