"""Restart-based membership carried out (``tidal run --torchrun``, ``Worlds``, a part):
worlds stopped and opened, the job's success and a world that never forms.

A part of ``Coordinator``; every method runs under the coordinator's lock, from the control
loop (``loop.ControlLoop``), which calls it instead of ``policy.reconcile`` under
``--torchrun``. What to do comes from the pure rules (``world_rules``); this reads the facts
from the ``Job``, stops members (a retire and a SIGTERM: ``actions.SignalWorker``; the grace
period's SIGKILL is ``exit_rules.to_kill``'s), starts fresh workers (``Lifecycle``) and opens
worlds (``Generations.open``). The workers' side is ``tidal.worker.compat.torchrun``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

from tidal.coordinator.actions import SignalWorker
from tidal.coordinator.control.lifecycle import NOT_STARTED
from tidal.coordinator.rules.world_rules import World, plan_world, world_finished, world_timed_out
from tidal.policy.schedule import future_peak
from tidal.protocol import JobState, WorkerState

if TYPE_CHECKING:
    from tidal.config import JobSpec
    from tidal.coordinator.control.generations import Generations
    from tidal.coordinator.control.ledger import Ledger
    from tidal.coordinator.control.lifecycle import Lifecycle
    from tidal.coordinator.executor import Executor
    from tidal.coordinator.job import Job
    from tidal.coordinator.records.records import WorkerRecord


class Worlds:
    def __init__(
        self,
        *,
        job: Job,
        spec: JobSpec,
        executor: Executor,
        ledger: Ledger,
        lifecycle: Lifecycle,
        generations: Generations,
    ) -> None:
        self.job = job
        self.spec = spec
        self.executor = executor
        self.ledger = ledger
        self.lifecycle = lifecycle
        self.generations = generations

    def _members(self) -> list[WorkerRecord]:
        latest = self.job.latest
        return [self.job.workers[m] for m in latest.members] if latest is not None else []

    def facts(self) -> World:
        """The latest world and the fresh workers, as ``world_rules.World``."""
        job = self.job
        members = self._members()
        inside = {w.id for w in members}
        outside = [
            w for w in job.workers.values() if w.live and not w.retired and w.id not in inside
        ]
        return World(
            members=tuple(w.id for w in members),
            live=tuple(w.id for w in members if w.live),
            stopped=any(w.retired for w in members),
            broken=any(w.state == WorkerState.FAILED and not w.retired for w in members),
            finished=any(w.state == WorkerState.EXITED and not w.retired for w in members),
            standby=tuple(sorted(w.id for w in outside if w.state == WorkerState.STANDBY)),
            starting=sum(1 for w in outside if w.state in NOT_STARTED),
            target=job.target,
            spares=max(
                self.spec.spares,
                future_peak(self.spec.schedule, job.step, job.job_length) - job.target,
            ),
        )

    def reconcile(self) -> None:
        """One pass's change of worlds (``world_rules.plan_world``): stop the latest, retire
        surplus warm workers, open the next, start fresh ones."""
        job = self.job
        latest = job.latest
        plan = plan_world(self.facts())
        if plan.stop:
            why = job.restart_why or f"{len(latest.members)} -> {job.target} workers"
            job.restart_why = why
            self.stop_world(why)
        for wid in plan.retire:
            self.lifecycle.retire(job.workers[wid])
        if plan.open is not None:
            n = len(plan.open)
            if latest is None:
                reason = f"start with {n} workers"
            else:
                reason = f"restart {latest.id}: {job.restart_why or 'the world stopped'}"
            self.generations.open(list(plan.open), reason)
            job.latest.stopped_at = job.world_stopped_at if latest is not None else None
            job.restart_why = None
        starting = sum(1 for w in job.workers.values() if w.state in NOT_STARTED)
        for _ in range(max(0, min(plan.start, self.executor.max_starting - starting))):
            self.lifecycle.start_worker()
        self.generations.settle_schedule()

    def stop_world(self, why: str) -> None:
        """Stop every live member of the latest world: asked to exit (retired) and sent
        SIGTERM, as torchrun stops its workers; ``to_kill`` SIGKILLs what outlives the grace
        period."""
        job = self.job
        live = [w for w in self._members() if w.live and not w.retired]
        if not live:
            return
        job.world_stopped_at = time.time()
        ids = [w.id for w in live]
        self.ledger.event(
            "restart", f"generation {job.latest.id} stops ({why}): SIGTERM to workers {ids}"
        )
        for w in live:
            started = w.state not in NOT_STARTED  # ``retire`` signals the others itself
            self.lifecycle.retire(w)
            if started:
                self.executor.do(SignalWorker(worker_id=w.id, signum=signal.SIGTERM, why=why))

    def finish(self) -> None:
        """Succeed once every member of the latest world finished (``world_finished``)."""
        job = self.job
        latest = job.latest
        if job.outcome is not None or latest is None:
            return
        members = self._members()
        codes = tuple(None if w.live else w.exit_code for w in members)
        if world_finished(
            formed=latest.formed, stopped=any(w.retired for w in members), codes=codes
        ):
            script = os.path.basename(self.spec.script)
            self.ledger.decide(
                JobState.SUCCEEDED,
                f"every worker of generation {latest.id} finished ({script} exited 0)",
            )

    def check_formed(self) -> None:
        """Fail a world whose process group never formed within ``--start-timeout``
        (``world_rules.world_timed_out``); the first world's wait counts from the job's
        creation."""
        job = self.job
        latest = job.latest
        if job.outcome is not None or latest is None or not job.members:
            return
        if any(w.retired for w in self._members()):  # stopped: the next one is awaited
            return
        first = latest is job.generations[0]
        since = job.created if first else latest.opened_at
        why = world_timed_out(
            formed=latest.formed,
            waited_s=time.time() - since,
            timeout_s=self.spec.start_timeout_s,
            gen_id=latest.id,
        )
        if why is not None:
            self.ledger.decide(JobState.FAILED, why)
