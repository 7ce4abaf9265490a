"""What each fact does to the job (``facts``): one method per kind of fact.

A part of ``Coordinator``. These run only from ``Handlers.drain``, under the lock, in the
order the facts arrived; they change the job, write what must outlive a crash through the
executor, and wake the loop when a decision is due. Decisions stay with the control loop's
rules: a failure report asks for a re-form (``reform_rules.reform_due`` decides when), a
done report may complete the job (``end_rules.completion_refused``,
``end_rules.final_checkpoint``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.coordinator.actions import (
    AdoptWorker,
    DropCheckpoint,
    RecordCheckpoint,
    RecordCheckpointFailure,
    RecordGeneration,
)
from tidal.coordinator.control.scaling import int_metric
from tidal.coordinator.records.records import ReformRequest
from tidal.coordinator.rules import phase
from tidal.coordinator.rules.checkpoint_rules import pruned_records, streak_verdict
from tidal.coordinator.rules.end_rules import completion_refused, final_checkpoint
from tidal.coordinator.rules.reform_rules import merge_recovery, neighbour_copy_event
from tidal.coordinator.rules.scale_rules import schedule_near
from tidal.coordinator.rules.stop_rules import accept_stop
from tidal.policy.schedule import ignored as schedule_ignored
from tidal.protocol import (
    CheckpointFailure,
    CheckpointView,
    DoneReport,
    FailureKind,
    FailureReport,
    HeartbeatRequest,
    JobState,
    RegisterRequest,
    RegisterResponse,
    StepReport,
    StopAnswer,
    StopReport,
    WorkerConfig,
    WorkerState,
)

if TYPE_CHECKING:
    from tidal.config import JobSpec
    from tidal.coordinator.control.ledger import Ledger
    from tidal.coordinator.control.lifecycle import Lifecycle
    from tidal.coordinator.control.publish import Publisher
    from tidal.coordinator.control.wake import Wake
    from tidal.coordinator.executor import Executor
    from tidal.coordinator.job import Job
    from tidal.coordinator.records.records import WorkerRecord


class RequestError(ValueError):
    """A client asked for something the job cannot do; the message says why."""


class ReRegister(RuntimeError):
    """A worker that a previous coordinator of the job started called before registering
    with this one (HTTP 409): it must register again, saying where it stands."""


class Effects:
    def __init__(
        self,
        *,
        job: Job,
        spec: JobSpec,
        executor: Executor,
        ledger: Ledger,
        publisher: Publisher,
        lifecycle: Lifecycle,
        wake: Wake,
        config: WorkerConfig,
        resumed_step: int | None,
    ) -> None:
        """``config``: what every registered worker is told (``RegisterResponse``);
        ``resumed_step``: the checkpoint's step a resumed job started from."""
        self.job = job
        self.spec = spec
        self.executor = executor
        self.ledger = ledger
        self.publisher = publisher
        self.lifecycle = lifecycle
        self.wake = wake
        self.config = config
        self.resumed_step = resumed_step

    def worker(self, wid: int) -> WorkerRecord:
        """Worker ``wid``'s record; ``RequestError`` if the job has none."""
        w = self.job.workers.get(wid)
        if w is None:
            raise RequestError(f"unknown worker {wid}")
        return w

    def caller(self, wid: int) -> WorkerRecord:
        """The worker making a call; ``ReRegister`` if it has not registered with this
        coordinator yet (a previous one started it)."""
        w = self.worker(wid)
        if not w.adopted:
            raise ReRegister(f"worker {wid}: the coordinator restarted; register again")
        return w

    def apply_register(self, wid: int, req: RegisterRequest) -> RegisterResponse:
        w = self.worker(wid)
        if not w.live:
            raise RequestError(
                f"worker {wid} was counted as lost ({w.kill_reason or 'its process ended'}); "
                "it must exit"
            )
        saved = None
        if not w.adopted:  # it trained on while the previous coordinator was away
            w.adopted = True
            # what of its per-step records the dead coordinator wrote down: it sends the rest
            saved = self.executor.saved_step_metrics(wid)
            if wid not in self.executor.alive():  # its pid was not known: it is now
                self.executor.do(
                    AdoptWorker(worker_id=wid, pid=req.pid, env=self.lifecycle.worker_env(wid))
                )
            self.job.step = max(self.job.step, req.step)
            self.ledger.event(
                "worker",
                f"worker {wid} re-registered (generation {req.generation}, step {req.step})",
            )
        w.pid, w.host, w.last_heartbeat = req.pid, req.host, time.time()
        if req.max_steps is not None and self.job.job_length is None:
            self.job.job_length = req.max_steps
            for line in schedule_ignored(self.spec.schedule, req.max_steps):
                self.ledger.event("scale", line)  # and its spares are retired (``reconcile``)
        elif req.max_steps is not None and req.max_steps != self.job.job_length:
            self.ledger.event(
                "worker",
                f"worker {wid} runs {req.max_steps} steps, the job {self.job.job_length}: "
                f"the job's length stays {self.job.job_length}",
            )
        if w.state in (WorkerState.PENDING, WorkerState.STARTING):
            w.state = WorkerState.STANDBY
            w.node = w.node or self.executor.node(wid)
        self.ledger.save_worker(w)
        self.ledger.event("worker", f"worker {wid} ready (pid {req.pid})")
        self.wake.set()  # a ready worker may complete the generation being formed
        return RegisterResponse(job=self.spec.name, config=self.config, saved_step_metrics=saved)

    def apply_heartbeat(self, w: WorkerRecord, req: HeartbeatRequest) -> None:
        w.step = req.step
        w.script_s, w.beat_generation = req.script_s, req.generation
        if req.holding:
            w.held = (req.step, req.generation)
        self.job.step = max(self.job.step, req.step)
        self.job.metrics.update(req.metrics)
        for record in req.step_metrics:  # values of tidal.log, one per (step, name)
            self.job.metrics.update(self.job.step_log.add(w.id, record))
        for c in req.checkpoints:
            self.on_checkpoint(c)
        for f in req.checkpoint_failures:
            self.on_checkpoint_failure(f)
        if req.leaving and w.id not in self.job.leaving and not w.retired:
            self.job.leaving.append(w.id)
            w.notice = w.notice or req.notice
        for report in req.reports:
            self.on_step_report(report)
        for d in req.departures:
            self.ledger.event(
                "leave",
                f"worker {w.id} left before the update of step {d.step} of generation "
                f"{d.generation}: {d.why}",
            )
        if req.leaving or schedule_near(self.spec.schedule, req.step):
            self.wake.set()  # a preemption notice, or members at or just before a scheduled step

    def on_checkpoint(self, c: CheckpointView) -> None:
        self.executor.do(RecordCheckpoint(checkpoint=c))
        self.job.checkpointed = {*self.job.checkpointed, c.step}
        self.drop_pruned_checkpoints()
        size = "size unknown" if c.bytes is None else f"{c.bytes} bytes"  # both optional
        took = "" if c.seconds_to_write is None else f", {c.seconds_to_write:.2f} s to write"
        self.ledger.event("checkpoint", f"checkpoint of step {c.step}: {c.path} ({size}{took})")

    def drop_pruned_checkpoints(self) -> None:
        """Forget the recorded checkpoints that their writer pruned (``pruned_records``): as
        a new one is recorded, and as a worker reports its end (a writer prunes the last
        time as it closes: ``Durable.close``)."""
        records = [(old.step, old.path) for old in self.executor.checkpoints()]
        for step in pruned_records(
            records, keep=self.spec.keep_checkpoints, exists=lambda p: Path(p).exists()
        ):
            self.executor.do(DropCheckpoint(step=step))

    def on_checkpoint_failure(self, f: CheckpointFailure) -> None:
        """An event and the status fields; the job fails if it is its last step's checkpoint
        (the done report may come first: the job's end is recorded only once every worker,
        the writer included, has exited, so either order ends the same)."""
        self.job.checkpoint_failed = {**self.job.checkpoint_failed, f.step: f.error}
        self.executor.do(RecordCheckpointFailure(error=f.error))
        self.ledger.event("checkpoint", f"checkpoint of step {f.step} failed: {f.error}")
        if self.job.outcome == JobState.SUCCEEDED and f.step >= self.job.step:
            # the end rule's words for it (one source)
            why = final_checkpoint(
                step=f.step, written=False, error=f.error, writer=None, writer_live=False
            ).why
            self.ledger.decide(JobState.FAILED, why, overturn=True)
        elif (
            self.job.outcome is None
            and self.job.stop_requested_at is None
            and (
                f.step != int_metric(self.job, "max_steps")  # the final one: ``_finish`` decides
            )
        ):
            # Too many in a row: the job fails rather than train on unprotected
            # (``checkpoint_rules``; ``docs/decisions/full-disk.md``).
            written = self.job.checkpointed
            newest = max(written, default=self.resumed_step)
            why = streak_verdict(self.job.checkpoint_failed, written, newest_on_disk=newest)
            if why is not None:
                self.ledger.decide(JobState.FAILED, why)

    def on_step_report(self, r: StepReport) -> None:
        gens = self.job.generations
        index = next((i for i, g in enumerate(gens) if g.id == r.generation), None)
        if index is None:
            return
        gen = gens[index]
        if gen.start_step is None:  # formed: joiners and starts held back for it may go
            gen.start_step = r.start_step
            self.wake.set()
        prev_formed = [g.id for g in gens[:index] if g.formed]
        if (
            r.prev_last_step_time is not None
            and prev_formed
            and r.prev_generation == prev_formed[-1]
        ):
            pause = r.first_step_time - r.prev_last_step_time
            if gen.pause_s is None or pause > gen.pause_s:
                gen.pause_s, gen.pause_phases = pause, r.phases or None
        elif gen.stopped_at is not None:  # a restarted world (--torchrun): since the stop
            pause = r.first_step_time - gen.stopped_at
            if gen.pause_s is None or pause > gen.pause_s:
                gen.pause_s = pause
        recorded = (gen.recovery, gen.redone_steps)
        gen.recovery, gen.redone_steps = merge_recovery(recorded, r.recovery, r.redone_steps)
        self.executor.do(RecordGeneration(generation=gen.view()))
        said = neighbour_copy_event(gen.id, recorded, r.recovery, r.redone_steps)
        if said:
            self.ledger.event("recovery", said)
        for action in phase.start_running(self.job):
            self.executor.do(action)

    def apply_failure(self, wid: int, r: FailureReport) -> None:
        self.caller(wid)
        if r.kind == FailureKind.FORGED_STORE:  # told whatever it led to (``store_auth``)
            self.ledger.event("security", f"worker {wid} refused a forged store value: {r.error}")
        latest = self.job.latest
        if latest is None or r.generation != latest.id or self.job.outcome is not None:
            return  # a newer generation already answers it
        if self.job.script_stop is not None:  # a member's script ended the job: it left
            return
        if r.kind == FailureKind.SCRIPT_MISMATCH:  # no re-form can mend it (``FailureKind``)
            self.ledger.decide(JobState.FAILED, f"worker {wid}: {r.error}")
            self.wake.set()
            return
        if r.kind == FailureKind.STATE_LOST:  # the control loop rolls back or fails
            if self.job.state_lost is None:
                self.job.state_lost = (latest.id, f"worker {wid}: {r.error}")
                self.wake.set()
            return
        what = "a failed collective"
        if r.kind == FailureKind.FORGED_STORE:
            what = "a forged store value"  # its event is out already (above)
        else:
            self.ledger.event(
                "failure", f"worker {wid} reported {what} at step {r.step}: {r.error}"
            )
        req = self.job.reform_requested
        if req is not None and req.generation == latest.id:  # another member's report of it
            if wid not in req.reporters:
                self.job.reform_requested = replace(req, reporters=req.reporters | {wid})
                self.wake.set()  # it may be the last member's: re-form at once
            return
        # none pending, or one for an older generation (dropped once its grace is over):
        # this one must not be lost with it, or its members wait for a re-form forever
        self.job.reform_requested = ReformRequest(
            at=time.monotonic(),
            generation=latest.id,
            why=f"worker {wid} reported {what}",
            worker_id=wid,
            step=r.step,
            error=r.error,
            reporters=frozenset({wid}),
        )
        self.wake.set()  # a dead peer's exit may be waiting to be polled

    def apply_done(self, wid: int, r: DoneReport) -> None:
        w = self.caller(wid)
        self.drop_pruned_checkpoints()
        w.ask_to_exit(time.monotonic())
        self.job.step = max(self.job.step, r.step)
        if r.completed and self.job.outcome is None and self.job.script_stop is None:
            refused = self._completion_refused(wid, r)
            if refused:
                self.ledger.event(
                    "worker",
                    f"worker {wid} reported completion at step {r.step}; ignored: {refused}",
                )
            elif self.spec.checkpoints:  # the final checkpoint decides (``_finish``)
                self.job.completing = (wid, r.step)
                self.ledger.save_control()
            else:
                self.ledger.decide(JobState.SUCCEEDED, f"worker {wid} completed step {r.step}")
        self.ledger.save_worker(w)
        self.wake.set()

    def _completion_refused(self, wid: int, r: DoneReport) -> str:
        formed = self.job.formed()
        current = set(self.job.members) | set(formed.members if formed else ())
        return completion_refused(
            worker_id=wid, step=r.step, current=current, job_length=self.job.job_length
        )

    def apply_script_stop(self, wid: int, r: StopReport) -> StopAnswer:
        """A member's script ended the job early (``stop_rules.accept_stop``); answered before
        the member leaves its group, and published at once: its peers, whose next collective
        fails when it leaves, find the stop in the answer they fetch then."""
        self.caller(wid)
        gen = next((g for g in self.job.generations if g.id == r.generation), None)
        formed = self.job.formed()
        current = set(self.job.members) | set(formed.members if formed else ())
        verdict = accept_stop(
            worker_id=wid,
            step=r.step,
            generation=r.generation,
            writes=r.writes,
            members=tuple(gen.members) if gen is not None else (wid,),
            current=current,
            recorded=self.job.script_stop,
            decided=self.job.outcome is not None or self.job.stop_requested_at is not None,
        )
        if verdict.event is not None:
            self.ledger.event("stop", verdict.event)
        if verdict.record is not None:
            self.job.script_stop = verdict.record
            self.job.step = max(self.job.step, r.step)
            self.job.reform_requested = None  # its peers' failures are the stop, not a fault
            self.publisher.publish()
            self.wake.set()
        return StopAnswer(step=verdict.step, writer=verdict.writer)

    def apply_scale(self, n: int) -> None:
        finishing = self.job.stop_requested_at is not None or self.job.script_stop is not None
        if self.job.outcome is not None or finishing:
            raise RequestError(f"job {self.spec.name} is finishing; it cannot be scaled")
        self.ledger.set_target(n, "tidal scale")
        self.wake.set()

    def apply_stop(self) -> None:
        if self.job.stop_requested_at is None and self.job.outcome is None:
            self.job.stop_requested_at = time.monotonic()
            self.ledger.event("stop", "stop requested: members stop after the current step")
            self.wake.set()
