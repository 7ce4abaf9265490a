"""How the target worker count moves: the schedule, the policy, the capacity.

A mixin of ``Coordinator``; every method runs on the control loop under ``self.lock``.
Decisions come from pure functions (``policy``); this turns them into the job's new target
and actions for the executor (a SIGTERM notice: ``actions.SignalWorker``), and records each
as an event with its reason. The target is what was requested (``--workers``, ``tidal scale``,
``--schedule`` or the policy) within the capacity available now; workers beyond the
capacity get a preemption notice (SIGTERM) and leave at a step boundary, as on a cloud that
reclaims spot instances.
"""

from __future__ import annotations

import math
import signal
import time

from tidal.coordinator.actions import SignalWorker
from tidal.coordinator.scale_rules import capacity_victims, leaver_target, schedule_ahead
from tidal.protocol import WorkerState


class Scaling:
    def _int_metric(self, key: str) -> int | None:
        if key == "max_steps" and self.job.job_length is not None:
            return self.job.job_length or None  # as registered (``Handlers.on_register``)
        value = self.job.metrics.get(key)  # a script may log anything under any name: NaN too
        return int(value) if value and math.isfinite(value) else None

    def _observe(self, now: float) -> None:
        latest = self.job.latest
        live = sum(1 for w in self.job.workers.values() if w.live)
        split = self.job.metrics.get("compute_s"), self.job.metrics.get("comm_s")
        ws = self._int_metric("world_size") or 0
        if None not in split and all(map(math.isfinite, split)) and ws == self.job.world_size():
            self.accounting.note_split(ws, *split)
        self.accounting.observe(
            now=now,
            step=self.job.step,
            world_size=self.job.world_size(),
            generation=latest.id if latest else 0,
            live=live,
        )

    def _apply_schedule(self) -> None:
        latest = self.job.latest
        formed = latest is not None and latest.formed
        for at, count in schedule_ahead(
            self.spec.schedule,
            self.job.schedule_done,
            self.job.step,
            formed=formed,
            settled=self.job.settled_step,
        ):
            self.job.schedule_done += 1
            self.job.schedule_applied_at = time.monotonic()
            self._set_target(count, f"--schedule at step {at}")

    def _apply_policy(self) -> None:
        pauses = [g.pause_s for g in self.job.generations if g.pause_s is not None]
        changed = self.job.target_changed_at
        m = self.accounting.measurements(
            step=self.job.step,
            world_size=self.job.world_size(),
            target=self.job.requested,
            min_workers=self.spec.min_workers,
            max_workers=self.spec.max_workers,
            global_batch=self._int_metric("global_batch_size"),
            max_steps=self._int_metric("max_steps"),
            pause_s=sum(pauses) / len(pauses) if pauses else None,
            since_change_s=time.monotonic() - changed if changed is not None else None,
        )
        decision = self._policy(m)
        if decision.target != self.job.requested:
            self.event("policy", f"{self.spec.policy}: {decision.reason}")
            self._set_target(decision.target, f"{self.spec.policy} policy")

    def _enforce_capacity(self) -> None:
        cap = self.accounting.capacity()
        if cap is None:
            return
        self._set_target(self.job.requested, f"capacity {cap} (--capacity)")
        alive = [
            w.id for w in self.job.workers.values() if w.live and not w.retired and not w.preempted
        ]
        victims = [self.job.workers[wid] for wid in capacity_victims(alive, self.job.members, cap)]
        for w in victims:
            w.preempted = True
            self.event("capacity", f"capacity {cap}: preemption notice (SIGTERM) to worker {w.id}")
            if w.state in (WorkerState.PENDING, WorkerState.STARTING, WorkerState.STANDBY):
                self._retire(w)
            self.executor.do(SignalWorker(worker_id=w.id, signum=signal.SIGTERM, why="capacity"))

    def _release_leavers(self) -> None:
        """Preemption notices: each leaver leaves at the next step boundary (a planned
        change, nothing redone). A notice the coordinator did not send means capacity went
        away: the target shrinks with it."""
        while self.job.leaving:
            w = self.job.workers[self.job.leaving.pop(0)]
            if not w.live or w.retired:
                continue
            target = leaver_target(
                sent_by_us=w.preempted,
                requested=self.job.requested,
                min_workers=self.spec.min_workers,
            )
            if target is not None:
                self._set_target(target, f"worker {w.id} preempted")
            was_member = w.id in self.job.members
            self._retire(w)
            if was_member:
                self._open(
                    [m for m in self.job.members if m != w.id],
                    f"worker {w.id} left: preemption notice ({w.notice or 'SIGTERM'})",
                )
