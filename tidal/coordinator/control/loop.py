"""The coordinator's control loop: one pass (``tick``) and the steps it takes in order.

A part of ``Coordinator``; every method runs under the coordinator's lock. A pass drains the
queued heartbeats, takes in the backend's reports (exits, placement), checks silence, then
asks the pure rules what to do, in this order: the job's outcome (a completed job's final
checkpoint), a re-form after a reported failed collective, the --schedule, the policy, the
capacity, and the reconciliation of the members with the target (``policy.reconcile``),
whose plan opens the next generation (``Generations.open``) and starts workers. Once an
outcome is decided (``phase.decide``) the pass winds the job down instead
(``end_rules.wind_down``). Changes go to the workers' answers at the end of the pass
(``Publisher.publish``) and to SQLite at least every ``FLUSH_EVERY_S`` (``Views.flush``).

Contract: a pass never blocks on a worker or the network; everything with a side effect
goes through the executor (``actions``), in the order the pass decided it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from tidal.checkpoint.location import Location
from tidal.coordinator.actions import AbandonGeneration, KillEveryWorker
from tidal.coordinator.control.lifecycle import NOT_STARTED, STOP_GRACE_S
from tidal.coordinator.rules import phase
from tidal.coordinator.rules.end_rules import final_checkpoint, start_timed_out, wind_down
from tidal.coordinator.rules.reform_rules import reform_due, repeated_failure
from tidal.coordinator.rules.stop_rules import MemberExit, stop_outcome
from tidal.coordinator.rules.verdicts import Act
from tidal.policy.reconcile import Pool, reconcile
from tidal.policy.schedule import future_peak
from tidal.protocol import JobState, WorkerState

if TYPE_CHECKING:
    from tidal.config import JobSpec
    from tidal.coordinator.control.generations import Generations
    from tidal.coordinator.control.handlers import Handlers
    from tidal.coordinator.control.ledger import Ledger
    from tidal.coordinator.control.lifecycle import Lifecycle
    from tidal.coordinator.control.publish import Publisher
    from tidal.coordinator.control.scaling import Scaling
    from tidal.coordinator.control.views import Views
    from tidal.coordinator.control.worlds import Worlds
    from tidal.coordinator.executor import Executor
    from tidal.coordinator.job import Job

FLUSH_EVERY_S = 0.5
# Silence is judged against timeouts of seconds: four checks a second are enough, and a
# check walks every worker (at 1,024 workers, most of a tick's CPU when done every 20 ms).
HEALTH_EVERY_S = 0.25
REFORM_GRACE_S = 0.1  # let a dead peer's exit be seen before re-forming on a failure report


class ControlLoop:
    def __init__(
        self,
        *,
        job: Job,
        spec: JobSpec,
        executor: Executor,
        lock: threading.RLock,
        ledger: Ledger,
        publisher: Publisher,
        handlers: Handlers,
        views: Views,
        lifecycle: Lifecycle,
        generations: Generations,
        worlds: Worlds,
        scaling: Scaling,
        checkpoint_dir: Location | None,
    ) -> None:
        """``worlds``: what reconciles the members with the target under ``--torchrun``
        (restart-based), instead of ``policy.reconcile``."""
        self.job = job
        self.spec = spec
        self.executor = executor
        self.lock = lock
        self.ledger = ledger
        self.publisher = publisher
        self.handlers = handlers
        self.views = views
        self.lifecycle = lifecycle
        self.generations = generations
        self.worlds = worlds
        self.scaling = scaling
        self.checkpoint_dir = checkpoint_dir
        self._last_health = 0.0  # when the loop last checked heartbeats (monotonic)

    def tick(self) -> bool:
        """One pass of the loop; returns False once the job has ended. Whatever it changed
        is published to the workers' answers at its end (``Publisher.publish``)."""
        with self.lock:
            try:
                return self._pass()
            finally:
                self.publisher.publish()

    def _pass(self) -> bool:
        job = self.job
        now = time.monotonic()
        self.handlers.drain()
        exits = self.executor.poll()
        if self.spec.torchrun:  # a peer's signal first: its peers' errors follow from it
            exits.sort(key=lambda ex: ex.returncode >= 0)
        for ex in exits:
            self.lifecycle.on_exit(ex)
        for line in self.executor.news():
            self.ledger.event("host", line)
        self.lifecycle.track_placement()
        if now - self._last_health >= HEALTH_EVERY_S:
            self._last_health = now
            self.lifecycle.check_heartbeats()
        self.lifecycle.answer_state_lost()
        self._finish()
        if self.spec.torchrun:
            self.worlds.finish()
        self._finish_script_stop()
        if job.outcome is None and job.script_stop is None:
            self.scaling.observe(now)
            self.scaling.release_leavers()
            self.maybe_reform(now)
            self.scaling.apply_schedule()
            self.scaling.apply_policy()
            self.scaling.enforce_capacity()
            if job.stop_requested_at is not None:
                if job.outcome is None:  # its event is the stop's own (``apply_stop``)
                    self.ledger.decide(JobState.STOPPED, None)
            elif self.spec.torchrun:
                self.worlds.reconcile()
                self.worlds.check_formed()
            else:
                self.reconcile()
            self._check_start_timeout()
        if job.outcome is not None:
            return self._wind_down(now)
        if self.flush_due():
            self.views.flush()
        return True

    def flush_due(self) -> bool:
        """Whether this pass flushes: every ``FLUSH_EVERY_S``, and at once when readers
        would see another world size than the job's (a generation formed, or the job
        ended): a short job's history and status must not miss its size."""
        stale = self.views.view.world_size != self.job.world_size()
        return stale or time.monotonic() - self.views.last_flush > FLUSH_EVERY_S

    def _finish(self) -> None:
        """Decide a completed job's outcome by its final checkpoint (``end_rules``)."""
        job = self.job
        if job.completing is None or job.outcome is not None:
            return
        wid, step = job.completing
        formed = [g for g in job.generations if g.formed]
        writer = formed[-1].members[0] if formed else None
        verdict = final_checkpoint(
            step=step,
            written=step in job.checkpointed,
            error=job.checkpoint_failed.get(step),
            writer=writer,
            writer_live=writer is not None and job.workers[writer].live,
        )
        if verdict.act is Act.SUCCEED:
            self.ledger.decide(JobState.SUCCEEDED, f"worker {wid} completed step {step}")
        elif verdict.act is Act.FAIL:
            self.ledger.decide(JobState.FAILED, verdict.why)

    def _finish_script_stop(self) -> None:
        """Decide the outcome of a job a member's script stopped, once its generation's
        members have exited (``stop_rules.stop_outcome``)."""
        job = self.job
        stop = job.script_stop
        if stop is None or job.outcome is not None:
            return
        exits = {}
        for w in (job.workers[m] for m in stop.members if m in job.workers):
            code = None if w.live else w.exit_code
            exits[w.id] = MemberExit(
                running=w.live,
                code=code,
                killed=w.kill_reason is not None,
                detail=self.executor.describe_exit(w.id) if code is not None and code > 0 else "",
            )
        verdict = stop_outcome(
            stop=stop,
            exits=exits,
            checkpoints=self.checkpoint_dir is not None,
            written=stop.step in job.checkpointed,
            error=job.checkpoint_failed.get(stop.step),
        )
        if verdict.act is Act.SUCCEED:
            self.ledger.decide(JobState.SUCCEEDED, verdict.why)
        elif verdict.act is Act.FAIL:
            self.ledger.decide(JobState.FAILED, verdict.why)

    def maybe_reform(self, now: float) -> None:
        """Re-form the latest generation with the same members once a reported failed
        collective is due (``reform_rules.reform_due``), unless it failed too many times in
        a row at the same step (``reform_rules.repeated_failure``): then the job fails
        saying so."""
        job = self.job
        req = job.reform_requested
        if req is None or job.outcome is not None:  # decided earlier in this pass
            return
        latest = job.latest
        due = reform_due(
            requested_at=req.at,
            now=now,
            grace_s=REFORM_GRACE_S,
            reported_gen=req.generation,
            latest_gen=latest.id if latest else 0,
            unreported=len(set(latest.members) - req.reporters) if latest else 0,
        )
        if due is not False:
            job.reform_requested = None
        if not due:
            return
        job.failed_collectives, fail = repeated_failure(
            job.failed_collectives,
            step=max(job.step, req.step),  # the report may be ahead of the heartbeats
            worker_id=req.worker_id,
            error=req.error,
        )
        if fail:
            self.ledger.decide(JobState.FAILED, fail)
            return
        self.generations.open(job.members, req.why)

    def reconcile(self) -> None:
        """The members with the target (``policy.reconcile``): retire, open, start."""
        job = self.job
        members = [m for m in job.members if job.workers[m].live]
        inside = set(members)  # not the list: O(N) a pass, not O(N^2)
        outside = [
            w for w in job.workers.values() if w.live and not w.retired and w.id not in inside
        ]
        # an empty generation (every member lost) never forms: its successor is open
        settling = bool(job.members) and not job.latest.formed
        plan = reconcile(
            Pool(
                members=members,
                standby=[w.id for w in outside if w.state == WorkerState.STANDBY],
                starting=[w.id for w in outside if w.state in NOT_STARTED],
                target=job.target,
                # --spares warm ones always; more if a scheduled scale-up will need them
                spares=max(
                    self.spec.spares,
                    future_peak(self.spec.schedule, job.step, job.job_length) - job.target,
                ),
                forming=not job.generations,
                settling=settling,
                settling_s=time.time() - job.latest.opened_at if settling else 0.0,
                ending=any(job.workers[m].state == WorkerState.STOPPING for m in members),
                nodes={m: job.workers[m].node for m in members},  # a scale-down spreads
            )
        )
        for wid in plan.retire:
            self.lifecycle.retire(job.workers[wid])
        if plan.members is not None:
            self.generations.open(plan.members, plan.reason, to_standby=plan.to_standby)
        # No more workers starting (launched, not registered) at once than the backend can
        # bring up; the rest start on later passes, as these register.
        starting = sum(1 for w in job.workers.values() if w.state in NOT_STARTED)
        for _ in range(max(0, min(plan.start, self.executor.max_starting - starting))):
            self.lifecycle.start_worker()
        self.generations.settle_schedule()

    def _check_start_timeout(self) -> None:
        job = self.job
        if job.outcome is not None:  # decided earlier in this pass
            return
        why = start_timed_out(
            pending=job.state == JobState.PENDING,
            waited_s=time.time() - job.created,
            start_timeout_s=self.spec.start_timeout_s,
            failed=job.failed_collectives,
        )
        if why:
            self.ledger.decide(JobState.FAILED, why)

    def _wind_down(self, now: float) -> bool:
        """Once the outcome is decided: let members finish, tell the rest to exit, kill
        what outlives the grace period, then record the end (once: a pass after it
        changes nothing)."""
        job = self.job
        if job.phase is phase.Phase.ENDED:
            return False
        alive = len(self.executor.alive())
        plan = wind_down(
            failed=job.outcome == JobState.FAILED,
            waited_s=None if job.wind_down_since is None else now - job.wind_down_since,
            alive=alive,
            grace_s=STOP_GRACE_S,
        )
        if plan.begin:
            job.wind_down_since = now
            if job.latest is not None:
                self.executor.do(AbandonGeneration(prefix=job.latest.store_prefix))
            for w in job.workers.values():
                if w.live and w.id not in job.members:
                    self.lifecycle.retire(w)
            if self.spec.torchrun and not plan.kill:  # its scripts learn of it as torchrun's
                self.worlds.stop_world(f"the job {job.outcome.value}")
        if plan.kill:
            self.executor.do(KillEveryWorker(why=f"{STOP_GRACE_S:.0f} s after the job's end"))
        if not plan.end:
            return True
        for ex in self.executor.poll():
            self.lifecycle.on_exit(ex)
        phase.end(job)
        self.views.flush()
        self.ledger.event("job", f"job ended: {job.state.value} at step {job.step}")
        return False

    def settled(self) -> bool:
        """True when nothing is in motion that a pass must notice within tenths of a
        second (``pacing.loop_wait``): the latest generation formed, no re-form, leaver,
        stop or outcome pending, no worker still starting."""
        job = self.job
        latest = job.latest
        if latest is None or not latest.formed or job.leaving:
            return False
        pending = (job.outcome, job.stop_requested_at, job.reform_requested, job.state_lost)
        if any(p is not None for p in pending):
            return False
        return not any(w.state in NOT_STARTED for w in job.workers.values())
