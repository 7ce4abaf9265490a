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
from tidal.checkpoint.store import NAME_RE, newest_good
from tidal.config import JobSpec
from tidal.coordinator.accounting import Accounting
from tidal.coordinator.actions import (
    AbandonGeneration,
    KillEveryWorker,
    OpenGeneration,
    RecordEvent,
    RecordGeneration,
    RecordJob,
    RecordWorkers,
)
from tidal.coordinator.db import Database
from tidal.coordinator.effects import Effects, RequestError
from tidal.coordinator.executor import Executor
from tidal.coordinator.handlers import Handlers
from tidal.coordinator.home import db_path, job_dir
from tidal.coordinator.job import Job
from tidal.coordinator.journal import Journal
from tidal.coordinator.lifecycle import NOT_STARTED, STOP_GRACE_S, Lifecycle
from tidal.coordinator.records import (
    GenerationRecord,
    Resume,
    WorkerRecord,
    changed_rows,
)
from tidal.coordinator.rules import (
    effective_target,
    every_member_lost,
    final_checkpoint,
    reform_due,
    repeated_failure,
    schedule_settled,
    start_timed_out,
    wind_down,
)
from tidal.coordinator.scaling import Scaling
from tidal.coordinator.snapshot import JobRow
from tidal.coordinator.supervisor import Hosting, listen, url_of
from tidal.coordinator.views import Views
from tidal.coordinator.wake import Wake
from tidal.policy.inputs import PolicyParams
from tidal.policy.reconcile import Pool, reconcile
from tidal.policy.registry import get_policy
from tidal.policy.schedule import future_peak
from tidal.protocol import (
    EventView,
    JobState,
    WorkerState,
)
from tidal.sim.trace import load_trace

FLUSH_EVERY_S = 0.5
# Silence is judged against timeouts of seconds: four checks a second are enough, and a
# check walks every worker (at 1,024 workers, most of a tick's CPU when done every 20 ms).
HEALTH_EVERY_S = 0.25
REFORM_GRACE_S = 0.1  # let a dead peer's exit be seen before re-forming on a failure report


class Coordinator(Handlers, Effects, Views, Scaling, Lifecycle):
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
        journal = Journal(db, spec.name)  # the only writer of the job's records
        journal.load(
            unwritten=JobRow(
                state=JobState.PENDING.value,
                spec=spec.to_dict(),
                created=time.time(),
                target_workers=spec.workers,
            )
        )
        # Every store key of the job lives under this secret (``protocol.generation_prefix``):
        # only workers, which get it through the authenticated API, can name a key.
        self.store_namespace = secrets.token_hex(16)
        #: The only door to the world: worker processes, the store, the records.
        self.executor = Executor(
            backend=backend,
            store=_bound_store(self.host, hosting.store_sock if hosting else None),
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
            self.event(
                "job",
                f"job {spec.name} resumed from {resume.path} (step {resume.step}) "
                f"with {spec.workers} workers",
            )

        self._set_target(spec.workers, "the capacity at the start")
        self._publish()
        self._publish_view()

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.jobdir.path / "checkpoints" if self.spec.checkpoints else None

    # -- helpers -------------------------------------------------------------------------
    def event(self, kind: str, message: str) -> None:
        self.executor.do(RecordEvent(event=EventView(time=time.time(), kind=kind, message=message)))

    def _worker(self, wid: int) -> WorkerRecord:
        w = self.job.workers.get(wid)
        if w is None:
            raise RequestError(f"unknown worker {wid}")
        return w

    # -- the control loop ----------------------------------------------------------------
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

    def _decide(self, outcome: JobState, why: str) -> None:
        self.job.outcome = outcome
        self._save_control()
        self.event("job", f"job {outcome.value}: {why}")

    def tick(self) -> bool:
        """One pass of the loop; returns False once the job has ended. Whatever it changed
        is published to the workers' answers at its end (``Handlers._publish``)."""
        with self.lock:
            try:
                return self._pass()
            finally:
                self._publish()

    def _pass(self) -> bool:
        now = time.monotonic()
        self._drain()
        for ex in self.executor.poll():
            self._on_exit(ex)
        self._track_placement()
        if now - self._last_health >= HEALTH_EVERY_S:
            self._last_health = now
            self._check_heartbeats()
        self._answer_state_lost()
        self._finish()
        if self.job.outcome is None:
            self._observe(now)
            self._release_leavers()
            self._maybe_reform(now)
            self._apply_schedule()
            self._apply_policy()
            self._enforce_capacity()
            if self.job.stop_requested_at is not None:
                self.job.outcome = (
                    JobState.STOPPED if self.job.outcome is None else self.job.outcome
                )
            else:
                self._reconcile()
            self._check_start_timeout()
        if self.job.outcome is not None:
            return self._wind_down(now)
        if self._flush_due():
            self.flush()
        return True

    def _flush_due(self) -> bool:
        """Whether this pass flushes: every ``FLUSH_EVERY_S``, and at once when readers
        would see another world size than the job's (a generation formed, or the job
        ended): a short job's history and status must not miss its size."""
        stale = self.view.world_size != self.job.world_size()
        return stale or time.monotonic() - self._last_flush > FLUSH_EVERY_S

    def _finish(self) -> None:
        """Decide a completed job's outcome by its final checkpoint (``rules``)."""
        if self.job.completing is None or self.job.outcome is not None:
            return
        wid, step = self.job.completing
        formed = [g for g in self.job.generations if g.formed]
        writer = formed[-1].members[0] if formed else None
        action, why = final_checkpoint(
            step=step,
            written=step in self.job.checkpointed,
            error=self.job.checkpoint_failed.get(step),
            writer=writer,
            writer_live=writer is not None and self.job.workers[writer].live,
        )
        if action == "succeed":
            self._decide(JobState.SUCCEEDED, f"worker {wid} completed step {step}")
        elif action == "fail":
            self._decide(JobState.FAILED, why)

    def _maybe_reform(self, now: float) -> None:
        """Re-form the latest generation with the same members once a reported failed
        collective is due (``rules.reform_due``), unless it failed too many times in a row
        at the same step (``rules.repeated_failure``): then the job fails saying so."""
        req = self.job.reform_requested
        if req is None:
            return
        latest = self.job.latest
        due = reform_due(
            requested_at=req.at,
            now=now,
            grace_s=REFORM_GRACE_S,
            reported_gen=req.generation,
            latest_gen=latest.id if latest else 0,
            unreported=len(set(latest.members) - req.reporters) if latest else 0,
        )
        if due is not False:
            self.job.reform_requested = None
        if not due:
            return
        self.job.failed_collectives, fail = repeated_failure(
            self.job.failed_collectives,
            step=max(self.job.step, req.step),  # the report may be ahead of the heartbeats
            worker_id=req.worker_id,
            error=req.error,
        )
        if fail:
            self._decide(JobState.FAILED, fail)
            return
        self._open(self.job.members, req.why)

    def _reconcile(self) -> None:
        members = [m for m in self.job.members if self.job.workers[m].live]
        inside = set(members)  # not the list: O(N) a pass, not O(N^2)
        outside = [
            w for w in self.job.workers.values() if w.live and not w.retired and w.id not in inside
        ]
        # an empty generation (every member lost) never forms: its successor is open
        settling = bool(self.job.members) and not self.job.latest.formed
        plan = reconcile(
            Pool(
                members=members,
                standby=[w.id for w in outside if w.state == WorkerState.STANDBY],
                starting=[w.id for w in outside if w.state in NOT_STARTED],
                target=self.job.target,
                # --spares warm ones always; more if a scheduled scale-up will need them
                spares=max(
                    self.spec.spares,
                    future_peak(self.spec.schedule, self.job.step) - self.job.target,
                ),
                forming=not self.job.generations,
                settling=settling,
                settling_s=time.time() - self.job.latest.opened_at if settling else 0.0,
                ending=any(self.job.workers[m].state == WorkerState.STOPPING for m in members),
            )
        )
        for wid in plan.retire:
            self._retire(self.job.workers[wid])
        if plan.members is not None:
            self._open(plan.members, plan.reason, to_standby=plan.to_standby)
        # No more workers starting (launched, not registered) at once than the backend can
        # bring up; the rest start on later passes, as these register.
        starting = sum(1 for w in self.job.workers.values() if w.state in NOT_STARTED)
        for _ in range(max(0, min(plan.start, self.executor.max_starting - starting))):
            self._start_worker()
        self._settle_schedule()

    def _settle_schedule(self) -> None:
        """Release members held at the last applied --schedule step once the generation has
        the target count (or it cannot get there within the start timeout)."""
        at = self.spec.schedule[self.job.schedule_done - 1][0] if self.job.schedule_done else None
        if schedule_settled(
            held_at=at,
            settled=self.job.settled_step,
            members=len(self.job.members),
            target=self.job.target,
            waited_s=time.monotonic() - self.job.schedule_applied_at,
            timeout_s=self.spec.start_timeout_s,
        ):
            self.job.settled_step = at

    def _open(
        self,
        members: list[int],
        reason: str,
        *,
        to_standby: list[int] = (),
        resume: tuple[str, int] | None = None,
    ) -> None:
        """Open the next generation with ``members``; ``resume`` (a checkpoint's path and
        step): no live worker holds the job's state, every member loads it first."""
        prev = self.job.latest
        gen = GenerationRecord(
            id=(self.job.latest.id if self.job.latest else self._gen_base) + 1,
            members=members,
            reason=reason,
            opened_at=time.time(),
            namespace=self.store_namespace,
            committed_step=self.job.step,
            resume_from=resume[0] if resume else None,
            resume_step=resume[1] if resume else None,
        )
        self.executor.do(
            OpenGeneration(
                prefix=gen.store_prefix, previous=prev.store_prefix if prev is not None else None
            )
        )
        self.job.generations.append(gen)
        ranks = {m: i for i, m in enumerate(members)}
        for w in self.job.workers.values():
            if w.id in ranks:
                w.state, w.rank = WorkerState.RUNNING, ranks[w.id]
            elif w.state == WorkerState.RUNNING:
                w.rank = None
                if w.id in to_standby:
                    w.state = WorkerState.STANDBY
                else:
                    self._stopping(w)
        # Members held at a scheduled step go on with it: released by this publish, before
        # the records below (the held members' pause waits on it).
        self._settle_schedule()
        self._publish()  # the members learn of it at their next heartbeat, not after the pass
        self._save_workers()
        self.executor.do(RecordGeneration(generation=gen.view()))
        self._save_control()
        self.event(
            "generation", f"generation {gen.id}: {len(members)} workers {members} ({reason})"
        )
        if not members and self.job.outcome is None:
            self._every_member_lost()

    def _every_member_lost(self) -> None:
        """The generation just opened is empty: go on from the newest verified checkpoint
        (``rules.every_member_lost``) or fail."""
        step = None
        if self.checkpoint_dir is not None:
            path, warnings = newest_good(self.checkpoint_dir)
            for line in warnings:
                self.event("checkpoint", line)
            step = int(NAME_RE.match(path.name).group(1)) if path is not None else None
        action, why = every_member_lost(
            keeps_checkpoints=self.checkpoint_dir is not None,
            checkpoint_step=step,
            step=self.job.step,
        )
        if action == "fail":
            self._decide(JobState.FAILED, why)
        else:
            self.event("failure", why)

    def _check_start_timeout(self) -> None:
        why = start_timed_out(
            pending=self.job.state == JobState.PENDING,
            waited_s=time.time() - self.job.created,
            start_timeout_s=self.spec.start_timeout_s,
            failed=self.job.failed_collectives,
        )
        if why:
            self._decide(JobState.FAILED, why)

    def _wind_down(self, now: float) -> bool:
        """Once the outcome is decided: let members finish, tell the rest to exit, kill
        what outlives the grace period, then record the end."""
        alive = len(self.executor.alive())
        plan = wind_down(
            failed=self.job.outcome == JobState.FAILED,
            waited_s=None if self.job.wind_down_since is None else now - self.job.wind_down_since,
            alive=alive,
            grace_s=STOP_GRACE_S,
        )
        if plan.begin:
            self.job.wind_down_since = now
            if self.job.latest is not None:
                self.executor.do(AbandonGeneration(prefix=self.job.latest.store_prefix))
            for w in self.job.workers.values():
                if w.live and w.id not in self.job.members:
                    self._retire(w)
        if plan.kill:
            self.executor.do(KillEveryWorker(why=f"{STOP_GRACE_S:.0f} s after the job's end"))
        if not plan.end:
            return True
        for ex in self.executor.poll():
            self._on_exit(ex)
        self.job.state = self.job.outcome
        self.flush()
        self.event("job", f"job ended: {self.job.state.value} at step {self.job.step}")
        return False

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
                    "url": self.url or None,
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

    def settled(self) -> bool:
        """True when nothing is in motion that a pass must notice within tenths of a
        second (``pacing.loop_wait``): the latest generation formed, no re-form, leaver,
        stop or outcome pending, no worker still starting."""
        latest = self.job.latest
        if latest is None or not latest.formed or self.job.leaving:
            return False
        pending = (
            self.job.outcome,
            self.job.stop_requested_at,
            self.job.reform_requested,
            self.job.state_lost,
        )
        if any(p is not None for p in pending):
            return False
        return not any(w.state in NOT_STARTED for w in self.job.workers.values())

    def close(self, *, kill_workers: bool = True) -> None:
        """``kill_workers`` False: the coordinator crashed; its workers train on and its
        successor adopts them (``Executor.close``)."""
        self.executor.close(kill_workers=kill_workers)
        self.wake.close()
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
