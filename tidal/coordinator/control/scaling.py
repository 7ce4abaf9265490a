"""How the target worker count moves: the schedule, the policy, the capacity, leavers.

A part of ``Coordinator``; every method runs on the control loop under the coordinator's
lock. Decisions come from pure functions (``policy``, ``scale_rules``); this turns them
into the job's new target (``Ledger.set_target``) and actions for the executor (a SIGTERM
notice: ``actions.SignalWorker``), and records each as an event with its reason. The target
is what was requested (``--workers``, ``tidal scale``, ``--schedule`` or the policy) within
the capacity available now; workers beyond the capacity get a preemption notice (SIGTERM)
and leave at a step boundary, as on a cloud that reclaims spot instances.
"""

from __future__ import annotations

import math
import signal
import time
from typing import TYPE_CHECKING

from tidal.coordinator.actions import SignalWorker
from tidal.coordinator.rules.scale_rules import capacity_victims, leaver_target, schedule_ahead
from tidal.protocol import WorkerState

if TYPE_CHECKING:
    from tidal.config import JobSpec
    from tidal.coordinator.control.generations import Generations
    from tidal.coordinator.control.ledger import Ledger
    from tidal.coordinator.control.lifecycle import Lifecycle
    from tidal.coordinator.executor import Executor
    from tidal.coordinator.job import Job
    from tidal.coordinator.records.accounting import Accounting
    from tidal.policy.registry import Policy


def int_metric(job: Job, key: str) -> int | None:
    """A metric the script logs that the coordinator reads as a count (``max_steps``: the
    job's length as registered first); None when absent or not finite."""
    if key == "max_steps" and job.job_length is not None:
        return job.job_length or None  # as registered (``Effects.apply_register``)
    value = job.metrics.get(key)  # a script may log anything under any name: NaN too
    return int(value) if value and math.isfinite(value) else None


class Scaling:
    def __init__(
        self,
        *,
        job: Job,
        spec: JobSpec,
        accounting: Accounting,
        executor: Executor,
        ledger: Ledger,
        lifecycle: Lifecycle,
        generations: Generations,
        policy: Policy,
    ) -> None:
        self.job = job
        self.spec = spec
        self.accounting = accounting
        self.executor = executor
        self.ledger = ledger
        self.lifecycle = lifecycle
        self.generations = generations
        self.policy = policy

    def observe(self, now: float) -> None:
        """Feed the accounting what the job does now (``Accounting.observe``)."""
        job = self.job
        latest = job.latest
        live = sum(1 for w in job.workers.values() if w.live)
        split = job.metrics.get("compute_s"), job.metrics.get("comm_s")
        ws = int_metric(job, "world_size") or 0
        if None not in split and all(map(math.isfinite, split)) and ws == job.world_size():
            self.accounting.note_split(ws, *split)
        self.accounting.observe(
            now=now,
            step=job.step,
            world_size=job.world_size(),
            generation=latest.id if latest else 0,
            live=live,
        )

    def apply_schedule(self) -> None:
        job = self.job
        latest = job.latest
        formed = latest is not None and latest.formed
        for at, count in schedule_ahead(
            self.spec.schedule,
            job.schedule_done,
            job.step,
            formed=formed,
            settled=job.settled_step,
        ):
            job.schedule_done += 1
            job.schedule_applied_at = time.monotonic()
            self.ledger.set_target(count, f"--schedule at step {at}")

    def apply_policy(self) -> None:
        job = self.job
        pauses = [g.pause_s for g in job.generations if g.pause_s is not None]
        changed = job.target_changed_at
        m = self.accounting.measurements(
            step=job.step,
            world_size=job.world_size(),
            target=job.requested,
            min_workers=self.spec.min_workers,
            max_workers=self.spec.max_workers,
            global_batch=int_metric(job, "global_batch_size"),
            max_steps=int_metric(job, "max_steps"),
            pause_s=sum(pauses) / len(pauses) if pauses else None,
            since_change_s=time.monotonic() - changed if changed is not None else None,
        )
        decision = self.policy(m)
        if decision.target != job.requested:
            self.ledger.event("policy", f"{self.spec.policy}: {decision.reason}")
            self.ledger.set_target(decision.target, f"{self.spec.policy} policy")

    def enforce_capacity(self) -> None:
        job = self.job
        cap = self.accounting.capacity()
        if cap is None:
            return
        self.ledger.set_target(job.requested, f"capacity {cap} (--capacity)")
        if self.spec.torchrun:  # the world restarts at the new target (``worlds``)
            return
        alive = [w.id for w in job.workers.values() if w.live and not w.retired and not w.preempted]
        victims = [job.workers[wid] for wid in capacity_victims(alive, job.members, cap)]
        for w in victims:
            w.preempted = True
            self.ledger.event(
                "capacity", f"capacity {cap}: preemption notice (SIGTERM) to worker {w.id}"
            )
            if w.state in (WorkerState.PENDING, WorkerState.STARTING, WorkerState.STANDBY):
                self.lifecycle.retire(w)
            self.executor.do(SignalWorker(worker_id=w.id, signum=signal.SIGTERM, why="capacity"))

    def release_leavers(self) -> None:
        """Preemption notices: each leaver leaves at the next step boundary (a planned
        change, nothing redone). A notice the coordinator did not send means capacity went
        away: the target shrinks with it."""
        job = self.job
        while job.leaving:
            w = job.workers[job.leaving.pop(0)]
            if not w.live or w.retired:
                continue
            target = leaver_target(
                sent_by_us=w.preempted,
                requested=job.requested,
                min_workers=self.spec.min_workers,
            )
            if target is not None:
                self.ledger.set_target(target, f"worker {w.id} preempted")
            was_member = w.id in job.members
            self.lifecycle.retire(w)
            if was_member:
                self.generations.open(
                    [m for m in job.members if m != w.id],
                    f"worker {w.id} left: preemption notice ({w.notice or 'SIGTERM'})",
                )
