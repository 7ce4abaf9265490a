"""What readers see of a live job: snapshots the control loop publishes, read without its
lock.

A part of ``Coordinator``, which also writes the fast-moving values (``flush``). The loop
publishes a ``LiveView`` at every flush (at least every ``loop.FLUSH_EVERY_S``, and after a
change a caller asked to see); the
status is built from the journal's copy of the job's records in memory (``journal``), which
the same flush brings up to date. So a dashboard, ``tidal status`` or Prometheus, however
many poll, never waits for a pass and never makes one wait: what they read is at most one
flush interval old. Only a caller that changed the job and must see the change (``tidal
scale``, ``tidal stop``) asks for ``status(fresh=True)``, which flushes under the lock.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.coordinator.actions import RecordJob
from tidal.coordinator.control.scaling import int_metric
from tidal.protocol import JobStatus, WorkerState

if TYPE_CHECKING:
    from tidal.coordinator.control.ledger import Ledger
    from tidal.coordinator.executor import Executor
    from tidal.coordinator.job import Job
    from tidal.coordinator.records.accounting import Accounting

STATUS_MAX_AGE_S = 0.5  # readers share one status for this long (``Views.status``)


@dataclass(frozen=True, kw_only=True)
class LiveView:
    """The job as of one flush: its step, world size and target, its numeric metrics, and
    each live worker's (id, step, is a member)."""

    step: int
    world_size: int
    target: int
    metrics: dict[str, float]
    workers: tuple[tuple[int, int, bool], ...]

    @staticmethod
    def of(job: Job) -> LiveView:
        return LiveView(
            step=job.step,
            world_size=job.world_size(),
            target=job.target,
            metrics={k: v for k, v in job.metrics.items() if isinstance(v, (int, float))},
            workers=tuple(
                (w.id, w.step, w.state == WorkerState.RUNNING)
                for w in job.workers.values()
                if w.live
            ),
        )


class Views:
    def __init__(
        self,
        *,
        job: Job,
        executor: Executor,
        lock: threading.RLock,
        accounting: Accounting,
        ledger: Ledger,
        drain: Callable[[], None],
        url: str,
    ) -> None:
        """``drain``: applies the queued facts (``Handlers.drain``), before a flush;
        ``url``: the API's, recorded while the job is served."""
        self.job = job
        self.executor = executor
        self.lock = lock
        self.accounting = accounting
        self.ledger = ledger
        self.drain = drain
        self.url = url
        self.last_flush = 0.0  # monotonic
        self.view = LiveView.of(job)  # published by ``publish_view``
        self._status_cache: tuple[float, JobStatus] | None = None

    def flush(self) -> None:
        """Write the fast-moving values to SQLite (under the lock), the heartbeats queued
        since the last pass applied first; then publishes what readers see."""
        self.drain()
        job = self.job
        self.last_flush = time.monotonic()
        job.metrics.update(
            self.accounting.summary(
                step=job.step,
                global_batch=int_metric(job, "global_batch_size"),
                max_steps=int_metric(job, "max_steps"),
            )
        )
        self.executor.do(
            RecordJob(
                values={
                    "state": job.state.value,
                    "step": job.step,
                    "world_size": job.world_size(),
                    "target_workers": job.target,
                    "metrics": job.metrics,
                    # A job that ended is served by nobody: no address to call (the
                    # records of one whose coordinator died keep its last one).
                    "url": (self.url or None) if not job.state.terminal else None,
                }
            )
        )
        self.ledger.save_workers()
        self.ledger.save_control()
        self.publish_view()

    def publish_view(self) -> None:
        """Under the lock, after a flush: what readers see from now on."""
        self.view = LiveView.of(self.job)
        self._status_cache = None

    def worker_steps(self) -> tuple[int, list[tuple[int, int, bool]]]:
        """The job's step, and each live worker's (id, step, is a member), as of the last
        flush; lock-free."""
        view = self.view
        return view.step, list(view.workers)

    def sample(self) -> tuple[int, int, int, dict[str, float], list, dict]:
        """(step, world size, target, numeric metrics, the per-step values not yet taken,
        each worker's newest per-step record among them: ``StepLog.applied``) for the
        dashboard's history (``tidal.dashboard.history.Recorder``). The values are taken
        from the job, under the lock: an API call's thread may be applying heartbeats (a
        value added between the two would be lost, or counted as written before it was)."""
        view = self.view
        log = self.job.step_log
        with self.lock:
            values, applied = log.take(), log.applied()
        return view.step, view.world_size, view.target, dict(view.metrics), values, applied

    def status(self, *, fresh: bool = False) -> JobStatus:
        """The job's status (``tidal status --json``), as of the last flush, shared by every
        reader for up to ``STATUS_MAX_AGE_S``; lock-free. ``fresh``: as of now (flushed under
        the lock first), for a caller that changed the job (e.g. ``tidal scale``). The
        snapshot is shared: callers must not change it."""
        cached = self._status_cache
        if not fresh and cached is not None and time.monotonic() - cached[0] < STATUS_MAX_AGE_S:
            return cached[1]
        if fresh:
            with self.lock:
                self.flush()
        status = self.executor.status()
        status.coordinator_pid = os.getpid()
        self._status_cache = (time.monotonic(), status)
        return status
