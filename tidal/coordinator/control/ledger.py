"""The job's changes written down: events, the outcome, the target, worker rows and the
control record, each through the executor (the only code that touches the records).

A part of ``Coordinator``, shared by its other parts; every method runs under the
coordinator's lock. It holds no state of its own: what it writes is read from the ``Job``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tidal.coordinator.actions import RecordControl, RecordEvent, RecordJob, RecordWorkers
from tidal.coordinator.records.records import changed_rows
from tidal.coordinator.recovery import control_of
from tidal.coordinator.rules import phase
from tidal.coordinator.rules.scale_rules import effective_target
from tidal.protocol import EventView, JobState

if TYPE_CHECKING:
    from tidal.coordinator.executor import Executor
    from tidal.coordinator.job import Job
    from tidal.coordinator.records.accounting import Accounting
    from tidal.coordinator.records.records import WorkerRecord


class Ledger:
    def __init__(self, *, job: Job, executor: Executor, accounting: Accounting) -> None:
        self.job = job
        self.executor = executor
        self.accounting = accounting  # the capacity available now (``set_target``)
        self._control: dict | None = None  # the control record as last written

    def event(self, kind: str, message: str) -> None:
        self.executor.do(RecordEvent(event=EventView(time=time.time(), kind=kind, message=message)))

    def decide(self, outcome: JobState, why: str | None, *, overturn: bool = False) -> None:
        """Decide the job's outcome: the one door (``phase.decide``), recorded at once."""
        for action in phase.decide(self.job, outcome, why, now=time.time(), overturn=overturn):
            self.executor.do(action)

    def set_target(self, n: int, why: str) -> None:
        """The requested count; the target is that, within the capacity available now."""
        job = self.job
        job.requested = n
        effective = effective_target(n, self.accounting.capacity())
        if effective != job.target:
            self.event("scale", f"target {job.target} -> {effective} ({why})")
            job.target = effective
            job.target_changed_at = time.monotonic()
            self.executor.do(RecordJob(values={"target_workers": effective}))
        self.save_control()

    def save_worker(self, w: WorkerRecord) -> None:
        """Write one worker's row now (a change the status must show at once)."""
        self.executor.do(RecordWorkers(rows=(w.row(),)))

    def save_workers(self) -> None:
        """Write the worker rows that changed since they were written (``changed_rows``
        against the journal's copy of what SQLite holds)."""
        rows = changed_rows(
            [w.row() for w in self.job.workers.values()], self.executor.records.workers
        )
        if rows:
            self.executor.do(RecordWorkers(rows=tuple(rows)))

    def save_control(self) -> None:
        """Write the control record (``recovery.Control``) as the job holds it now, if it
        differs from the one last written here: one diff, however many changes a pass
        made and however many of its steps ask (``phase.decide`` writes its own)."""
        control = control_of(self.job).to_dict()
        if control != self._control:
            self.executor.do(RecordControl(control=control))
            self._control = control
