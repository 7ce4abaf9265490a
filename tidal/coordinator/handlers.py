"""What the coordinator answers: the API calls of workers and users.

A mixin of ``Coordinator`` (which holds the state and the control loop). Handlers only record
facts and requests; the control loop (``Coordinator.tick``) decides and acts on them. Every
handler takes ``self.lock``, so it sees and leaves a consistent job, except the hot path:
a heartbeat that carries only what may be applied later (its step, metrics and per-step
values) and a role query are answered from the published ``Answers`` without the lock, and
the heartbeat is queued in ``inbox`` for the next control-loop pass (``_drain``), so a
thousand workers' heartbeats never wait behind a pass. A heartbeat that carries a
checkpoint, a checkpoint failure, a step report or a preemption notice is applied before it
is answered (after everything queued before it, so each worker's facts apply in order): an
answered fact must not be lost with a coordinator crash.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.coordinator.answers import Answers
from tidal.coordinator.records import ReformRequest
from tidal.coordinator.rules import completion_refused, merge_recovery, neighbour_copy_event
from tidal.protocol import (
    CheckpointFailure,
    CheckpointView,
    DoneReport,
    FailureKind,
    FailureReport,
    HeartbeatRequest,
    JobState,
    JobStatus,
    RegisterRequest,
    RegisterResponse,
    StepReport,
    WorkerConfig,
    WorkerState,
    notice_key,
)

if TYPE_CHECKING:
    from tidal.coordinator.job import Job
    from tidal.coordinator.records import WorkerRecord


STATUS_MAX_AGE_S = 0.5  # see ``Handlers.status``


class RequestError(ValueError):
    """A client asked for something the job cannot do; the message says why."""


class ReRegister(RuntimeError):
    """A worker that a previous coordinator of the job started called before registering
    with this one (HTTP 409): it must register again, saying where it stands."""


def final_checkpoint_failed(step: int, error: str) -> str:
    return f"the checkpoint of its last step ({step}) could not be written: {error}"


class Handlers:
    job: Job  # the job's state (``job.Job``), set by Coordinator

    answers: Answers | None = None  # published by ``_publish``; None before the first
    _published_key: tuple | None = None
    inbox: deque[tuple[int, HeartbeatRequest]]  # quick heartbeats not yet applied

    def _publish(self) -> None:
        """Publish what workers are told now (``answers``), if it changed since the last
        time; under the lock."""
        latest = self.job.latest
        key = (
            latest.id if latest is not None else None,
            self.job.stop_requested_at is not None,
            self.job.outcome is not None,
            self.job.settled_step,
            len(self.job.workers),
        )
        if key == self._published_key:
            return
        notice = self._published_key is None or key[:3] != self._published_key[:3]
        self._published_key = key
        self.answers = Answers(
            generation=latest.info() if latest is not None else None,
            members=latest.member_set() if latest is not None else frozenset(),
            stop=key[1],
            ended=key[2],
            settled_step=self.job.settled_step,
            workers=len(self.job.workers),
            base_s=self.spec.beat_interval_s,
            timeout_s=self.spec.heartbeat_timeout_s,
        )
        if notice:  # after the answer: rank 0 fetches it when it sees the count move
            self.store.add(notice_key(self.store_namespace), 1)

    def _answer(self, w: WorkerRecord) -> bytes:
        answers = self.answers
        assert answers is not None  # published at construction
        return answers.encoded(answers.role(w.id, retired=w.retired))

    def _drain(self) -> None:
        """Apply the quick heartbeats queued since the last pass, in arrival order."""
        while self.inbox:
            wid, req = self.inbox.popleft()
            w = self.job.workers.get(wid)
            if w is not None:
                self._apply_heartbeat(w, req)

    # -- API: workers --------------------------------------------------------------------
    def _caller(self, wid: int) -> WorkerRecord:
        """The worker making a call; ``ReRegister`` if it has not registered with this
        coordinator yet (a previous one started it)."""
        w = self._worker(wid)
        if not w.adopted:
            raise ReRegister(f"worker {wid}: the coordinator restarted; register again")
        return w

    def on_register(self, wid: int, req: RegisterRequest) -> RegisterResponse:
        with self.lock:
            w = self._worker(wid)
            if not w.live:
                raise RequestError(
                    f"worker {wid} was counted as lost ({w.kill_reason or 'its process ended'}); "
                    "it must exit"
                )
            if not w.adopted:  # it trained on while the previous coordinator was away
                w.adopted = True
                if wid not in self.backend.alive():  # its pid was not known: it is now
                    self.backend.adopt(wid, req.pid, self._worker_env(wid))
                self.job.step = max(self.job.step, req.step)
                self.event(
                    "worker",
                    f"worker {wid} re-registered (generation {req.generation}, step {req.step})",
                )
            w.pid, w.host, w.last_heartbeat = req.pid, req.host, time.time()
            if req.max_steps is not None and self.job.job_length is None:
                self.job.job_length = req.max_steps
            elif req.max_steps is not None and req.max_steps != self.job.job_length:
                self.event(
                    "worker",
                    f"worker {wid} runs {req.max_steps} steps, the job {self.job.job_length}: "
                    f"the job's length stays {self.job.job_length}",
                )
            if w.state in (WorkerState.PENDING, WorkerState.STARTING):
                w.state = WorkerState.STANDBY
                w.node = w.node or self.backend.node(wid)
            self._save_worker(w)
            self.event("worker", f"worker {wid} ready (pid {req.pid})")
            self.wake.set()  # a ready worker may complete the generation being formed
            return RegisterResponse(
                job=self.spec.name,
                config=WorkerConfig.from_spec(
                    self.spec,
                    store_host=self.host,
                    store_port=self.store.port,
                    store_namespace=self.store_namespace,
                    checkpoint_dir=str(self.checkpoint_dir) if self.checkpoint_dir else None,
                    resume_from=self.resume.path if self.resume else None,
                ),
            )

    @staticmethod
    def heartbeat_is_quick(req: HeartbeatRequest) -> bool:
        """True if ``req`` may be answered at once and applied by the next pass (see the
        module's docstring)."""
        return not (req.leaving or req.checkpoints or req.checkpoint_failures or req.reports)

    def on_heartbeat(self, wid: int, req: HeartbeatRequest) -> bytes:
        """The heartbeat's answer, JSON-encoded (a ``HeartbeatResponse``). Lock-free when
        ``heartbeat_is_quick(req)``: a caller on an event loop runs only those inline."""
        if self.heartbeat_is_quick(req):
            w = self._caller(wid)
            w.last_heartbeat = time.time()
            self.inbox.append((wid, req))
            if any(at == req.step for at, _ in self.spec.schedule):
                self.wake.set()  # members holding at a scheduled step
            return self._answer(w)
        with self.lock:
            w = self._caller(wid)
            self._drain()
            w.last_heartbeat = time.time()
            self._apply_heartbeat(w, req)
            self._publish()
            return self._answer(w)

    def _apply_heartbeat(self, w: WorkerRecord, req: HeartbeatRequest) -> None:
        w.step = req.step
        self.job.step = max(self.job.step, req.step)
        self.job.metrics.update(req.metrics)
        for record in req.step_metrics:  # values of tidal.log, one per (step, name)
            self.job.metrics.update(self.job.step_log.add(w.id, record))
        for c in req.checkpoints:
            self._on_checkpoint(c)
        for f in req.checkpoint_failures:
            self._on_checkpoint_failure(f)
        if req.leaving and w.id not in self.job.leaving and not w.retired:
            self.job.leaving.append(w.id)
        for report in req.reports:
            self._on_step_report(report)
        if req.leaving or any(at == req.step for at, _ in self.spec.schedule):
            self.wake.set()  # a preemption notice, or members holding at a scheduled step

    def _on_checkpoint(self, c: CheckpointView) -> None:
        self.journal.add_checkpoint(c)
        self.job.checkpointed = {*self.job.checkpointed, c.step}
        for old in self.journal.checkpoints():  # pruned by the writer
            if not Path(old.path).exists():
                self.journal.drop_checkpoint(old.step)
        size = "size unknown" if c.bytes is None else f"{c.bytes} bytes"  # both optional
        took = "" if c.seconds_to_write is None else f", {c.seconds_to_write:.2f} s to write"
        self.event("checkpoint", f"checkpoint of step {c.step}: {c.path} ({size}{took})")

    def _on_checkpoint_failure(self, f: CheckpointFailure) -> None:
        """An event and the status fields; the job fails if it is its last step's checkpoint
        (the done report may come first: the job's end is recorded only once every worker,
        the writer included, has exited, so either order ends the same)."""
        self.job.checkpoint_failed = {**self.job.checkpoint_failed, f.step: f.error}
        self.journal.add_checkpoint_failure(f.error)
        self.event("checkpoint", f"checkpoint of step {f.step} failed: {f.error}")
        if self.job.outcome == JobState.SUCCEEDED and f.step >= self.job.step:
            self.job.outcome = None
            self._decide(JobState.FAILED, final_checkpoint_failed(f.step, f.error))

    def on_role(self, wid: int) -> bytes:
        """The worker's role and the newest generation (a ``HeartbeatResponse``, encoded),
        lock-free."""
        return self._answer(self._caller(wid))

    def _on_step_report(self, r: StepReport) -> None:
        index = next((i for i, g in enumerate(self.job.generations) if g.id == r.generation), None)
        if index is None:
            return
        gen = self.job.generations[index]
        if gen.start_step is None:
            gen.start_step = r.start_step
        prev_formed = [g.id for g in self.job.generations[:index] if g.formed]
        if (
            r.prev_last_step_time is not None
            and prev_formed
            and r.prev_generation == prev_formed[-1]
        ):
            pause = r.first_step_time - r.prev_last_step_time
            if gen.pause_s is None or pause > gen.pause_s:
                gen.pause_s, gen.pause_phases = pause, r.phases or None
        recorded = (gen.recovery, gen.redone_steps)
        gen.recovery, gen.redone_steps = merge_recovery(recorded, r.recovery, r.redone_steps)
        self.journal.save_generation(gen.view())
        said = neighbour_copy_event(gen.id, recorded, r.recovery, r.redone_steps)
        if said:
            self.event("recovery", said)
        if self.job.state == JobState.PENDING:
            self.job.state = JobState.RUNNING
            self.journal.update_job(state=self.job.state.value)

    def on_failure(self, wid: int, r: FailureReport) -> None:
        with self.lock:
            self._caller(wid)
            self._drain()  # this worker's earlier heartbeats first: its facts apply in order
            latest = self.job.latest
            if latest is None or r.generation != latest.id or self.job.outcome is not None:
                return  # a newer generation already answers it
            if r.kind == FailureKind.STATE_LOST:  # the control loop rolls back or fails
                if self.job.state_lost is None:
                    self.job.state_lost = (latest.id, f"worker {wid}: {r.error}")
                    self.wake.set()
                return
            self.event(
                "failure", f"worker {wid} reported a failed collective at step {r.step}: {r.error}"
            )
            if self.job.reform_requested is None:
                self.job.reform_requested = ReformRequest(
                    at=time.monotonic(),
                    generation=latest.id,
                    why=f"worker {wid} reported a failed collective",
                    worker_id=wid,
                    step=r.step,
                    error=r.error,
                )
                self.wake.set()  # a dead peer's exit may be waiting to be polled

    def on_done(self, wid: int, r: DoneReport) -> None:
        with self.lock:
            w = self._caller(wid)
            self._drain()  # this worker's earlier heartbeats first: its facts apply in order
            self._stopping(w)
            self.job.step = max(self.job.step, r.step)
            if r.completed and self.job.outcome is None:
                refused = self._completion_refused(wid, r)
                if refused:
                    self.event(
                        "worker",
                        f"worker {wid} reported completion at step {r.step}; ignored: {refused}",
                    )
                elif self.spec.checkpoints:  # the final checkpoint decides (``_finish``)
                    self.job.completing = (wid, r.step)
                    self._save_control()
                else:
                    self._decide(JobState.SUCCEEDED, f"worker {wid} completed step {r.step}")
            self._save_worker(w)
            self.wake.set()

    def _completion_refused(self, wid: int, r: DoneReport) -> str:
        formed = [g for g in self.job.generations if g.formed]
        current = set(self.job.latest.members if self.job.latest else ())
        current |= set(formed[-1].members if formed else ())
        return completion_refused(
            worker_id=wid, step=r.step, current=current, job_length=self.job.job_length
        )

    # -- API: users ----------------------------------------------------------------------
    def on_scale(self, n: int) -> None:
        with self.lock:
            if self.job.outcome is not None or self.job.stop_requested_at is not None:
                raise RequestError(f"job {self.spec.name} is finishing; it cannot be scaled")
            lo, hi = self.spec.min_workers, self.spec.max_workers
            if not lo <= n <= hi:
                raise RequestError(
                    f"{n} workers is outside [{lo}, {hi}] (--min-workers, --max-workers)"
                )
            self._set_target(n, "tidal scale")
            self.wake.set()

    def on_stop(self) -> None:
        with self.lock:
            if self.job.stop_requested_at is None and self.job.outcome is None:
                self.job.stop_requested_at = time.monotonic()
                self.event("stop", "stop requested: members stop after the current step")
                self.wake.set()

    # -- reads for the dashboard: plain values, under the coordinator's own lock ----------
    def worker_steps(self) -> tuple[int, list[tuple[int, int, bool]]]:
        """The job's step, and each live worker's (id, step, is a member)."""
        with self.lock:
            self._drain()  # as of the heartbeats answered so far
            return self.job.step, [
                (w.id, w.step, w.state == WorkerState.RUNNING)
                for w in self.job.workers.values()
                if w.live
            ]

    def sample(self) -> tuple[int, int, int, dict[str, float], list]:
        """(step, world size, target, numeric metrics, the per-step values not yet taken)
        for the dashboard's history (``tidal.dashboard.history.Recorder``)."""
        with self.lock:
            self._drain()  # as of the heartbeats answered so far
            metrics = {k: v for k, v in self.job.metrics.items() if isinstance(v, (int, float))}
            values = self.job.step_log.take()
            return self.job.step, self.job.world_size(), self.job.target, metrics, values

    _status_cache: tuple[float, JobStatus] | None = None

    def status(self, *, fresh: bool = False) -> JobStatus:
        """The job's status (``tidal status --json``). Readers share one snapshot for up to
        ``STATUS_MAX_AGE_S``: however many poll (the CLI, dashboards, Prometheus), the job
        pays one flush per interval; the status is built from the journal's copy in memory,
        never read from SQLite (``journal.Journal``). ``fresh``: as of now (after
        a change the caller made, e.g. ``tidal scale``). The snapshot is shared: callers
        must not change it."""
        cached = self._status_cache
        if not fresh and cached is not None and time.monotonic() - cached[0] < STATUS_MAX_AGE_S:
            return cached[1]
        with self.lock:
            self.flush()
        status = self.journal.status()
        status.coordinator_pid = os.getpid()
        self._status_cache = (time.monotonic(), status)
        return status
