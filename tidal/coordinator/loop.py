"""The coordinator's control loop: one pass (``tick``) and the steps it takes in order.

A mixin of ``Coordinator``; every method runs under ``self.lock``. A pass drains the queued
heartbeats, takes in the backend's reports (exits, placement), checks silence, then asks
the pure rules what to do, in this order: the job's outcome (a completed job's final
checkpoint), a re-form after a reported failed collective, the --schedule, the policy, the
capacity, and the reconciliation of the members with the target (``policy.reconcile``),
whose plan opens the next generation (``_open``) and starts workers. Once an outcome is
decided the pass winds the job down instead (``end_rules.wind_down``). Changes go to the
workers' answers at the end of the pass (``Handlers._publish``) and to SQLite at least
every ``FLUSH_EVERY_S`` (``flush``, in ``controller``).

Contract: a pass never blocks on a worker or the network; everything with a side effect
goes through ``self.executor`` (``actions``), in the order the pass decided it.
"""

from __future__ import annotations

import time

from tidal.checkpoint.store import NAME_RE, newest_good
from tidal.coordinator import phase
from tidal.coordinator.actions import (
    AbandonGeneration,
    KillEveryWorker,
    OpenGeneration,
    RecordGeneration,
)
from tidal.coordinator.end_rules import final_checkpoint, start_timed_out, wind_down
from tidal.coordinator.lifecycle import NOT_STARTED, STOP_GRACE_S
from tidal.coordinator.records import GenerationRecord
from tidal.coordinator.reform_rules import every_member_lost, reform_due, repeated_failure
from tidal.coordinator.scale_rules import schedule_settled
from tidal.coordinator.stop_rules import MemberExit, stop_outcome
from tidal.coordinator.verdicts import Act
from tidal.policy.reconcile import Pool, reconcile
from tidal.policy.schedule import future_peak
from tidal.protocol import JobState, WorkerState

FLUSH_EVERY_S = 0.5
# Silence is judged against timeouts of seconds: four checks a second are enough, and a
# check walks every worker (at 1,024 workers, most of a tick's CPU when done every 20 ms).
HEALTH_EVERY_S = 0.25
REFORM_GRACE_S = 0.1  # let a dead peer's exit be seen before re-forming on a failure report


class ControlLoop:
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
        self._finish_script_stop()
        if self.job.outcome is None and self.job.script_stop is None:
            self._observe(now)
            self._release_leavers()
            self._maybe_reform(now)
            self._apply_schedule()
            self._apply_policy()
            self._enforce_capacity()
            if self.job.stop_requested_at is not None:
                if self.job.outcome is None:  # its event is the stop's own (``_apply_stop``)
                    self.decide(JobState.STOPPED, None)
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
        verdict = final_checkpoint(
            step=step,
            written=step in self.job.checkpointed,
            error=self.job.checkpoint_failed.get(step),
            writer=writer,
            writer_live=writer is not None and self.job.workers[writer].live,
        )
        if verdict.act is Act.SUCCEED:
            self.decide(JobState.SUCCEEDED, f"worker {wid} completed step {step}")
        elif verdict.act is Act.FAIL:
            self.decide(JobState.FAILED, verdict.why)

    def _finish_script_stop(self) -> None:
        """Decide the outcome of a job a member's script stopped, once its generation's
        members have exited (``stop_rules.stop_outcome``)."""
        stop = self.job.script_stop
        if stop is None or self.job.outcome is not None:
            return
        exits = {}
        for w in (self.job.workers[m] for m in stop.members if m in self.job.workers):
            code = None if w.live else (w.exit_code if w.exit_code is not None else -1)
            exits[w.id] = MemberExit(
                code=code,
                killed=w.kill_reason is not None,
                detail=self.executor.describe_exit(w.id) if code is not None and code > 0 else "",
            )
        verdict = stop_outcome(
            stop=stop,
            exits=exits,
            checkpoints=self.checkpoint_dir is not None,
            written=stop.step in self.job.checkpointed,
            error=self.job.checkpoint_failed.get(stop.step),
        )
        if verdict.act is Act.SUCCEED:
            self.decide(JobState.SUCCEEDED, verdict.why)
        elif verdict.act is Act.FAIL:
            self.decide(JobState.FAILED, verdict.why)

    def _maybe_reform(self, now: float) -> None:
        """Re-form the latest generation with the same members once a reported failed
        collective is due (``reform_rules.reform_due``), unless it failed too many times in a row
        at the same step (``reform_rules.repeated_failure``): then the job fails saying so."""
        req = self.job.reform_requested
        if req is None or self.job.outcome is not None:  # decided earlier in this pass
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
            self.decide(JobState.FAILED, fail)
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
                    future_peak(self.spec.schedule, self.job.step, self.job.job_length)
                    - self.job.target,
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
        the target count (or it cannot get there within the start timeout, or a newer
        generation needs them to form: ``scale_rules.schedule_settled``)."""
        at = self.spec.schedule[self.job.schedule_done - 1][0] if self.job.schedule_done else None
        if schedule_settled(
            held_at=at,
            settled=self.job.settled_step,
            members=len(self.job.members),
            target=self.job.target,
            waited_s=time.monotonic() - self.job.schedule_applied_at,
            timeout_s=self.spec.start_timeout_s,
            newer_forming=bool(self.job.members) and not self.job.latest.formed,
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
        (``reform_rules.every_member_lost``) or fail."""
        step = None
        if self.checkpoint_dir is not None:
            path, warnings = newest_good(self.checkpoint_dir)
            for line in warnings:
                self.event("checkpoint", line)
            step = int(NAME_RE.match(path.name).group(1)) if path is not None else None
        verdict = every_member_lost(
            keeps_checkpoints=self.checkpoint_dir is not None,
            checkpoint_step=step,
            step=self.job.step,
        )
        if verdict.act is Act.FAIL:
            self.decide(JobState.FAILED, verdict.why)
        else:
            self.event("failure", verdict.why)

    def _check_start_timeout(self) -> None:
        if self.job.outcome is not None:  # decided earlier in this pass
            return
        why = start_timed_out(
            pending=self.job.state == JobState.PENDING,
            waited_s=time.time() - self.job.created,
            start_timeout_s=self.spec.start_timeout_s,
            failed=self.job.failed_collectives,
        )
        if why:
            self.decide(JobState.FAILED, why)

    def _wind_down(self, now: float) -> bool:
        """Once the outcome is decided: let members finish, tell the rest to exit, kill
        what outlives the grace period, then record the end (once: a pass after it
        changes nothing)."""
        if self.job.phase is phase.Phase.ENDED:
            return False
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
        phase.end(self.job)
        self.flush()
        self.event("job", f"job ended: {self.job.state.value} at step {self.job.step}")
        return False

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
