"""One job's records as SQLite holds them, and the status built from them.

``Database.load_records`` reads them (``tidal status`` of a job no coordinator serves, and
a restarted coordinator); ``journal.Journal`` keeps the live job's copy in memory, changed by
the same writes that go to SQLite. Both build ``tidal status --json`` with ``Records.status``,
so a live job reads the same as its records once they are flushed (tested).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import quote

from tidal.protocol import (
    CheckpointView,
    EventView,
    GenerationView,
    JobState,
    JobStatus,
    WorkerView,
)


class WorkerRow(NamedTuple):
    """A worker's row: the ``workers`` table's columns after ``job``, in order
    (``WorkerRecord.row``). A tuple, not a dataclass: 1,024 of them are compared each flush
    (``records.changed_rows``) and written as SQL parameters as they are."""

    id: int
    pid: int | None
    host: str | None
    state: str  # a ``WorkerState`` value
    rank: int | None
    last_heartbeat: float | None
    exit_code: int | None
    node: str | None


@dataclass(kw_only=True)
class JobRow:
    """The ``jobs`` table's row of a job (``spec`` and ``metrics`` decoded)."""

    state: str
    spec: dict
    created: float
    step: int = 0
    world_size: int = 0
    target_workers: int = 0
    url: str | None = None
    metrics: dict = field(default_factory=dict)
    checkpoint_failures: int = 0
    last_checkpoint_error: str | None = None


@dataclass(kw_only=True)
class Records:
    """A job's rows: the job, its workers (by id), generations (by id), events (in order),
    and the checkpoints it keeps (by step)."""

    job: JobRow
    workers: dict[int, WorkerRow] = field(default_factory=dict)
    generations: dict[int, GenerationView] = field(default_factory=dict)
    events: list[EventView] = field(default_factory=list)
    checkpoints: dict[int, CheckpointView] = field(default_factory=dict)

    def copy(self) -> Records:
        """A copy whose containers a writer may change while a reader builds the status
        (the rows in them are never changed in place)."""
        return Records(
            job=JobRow(**{**vars(self.job), "metrics": dict(self.job.metrics)}),
            workers=dict(self.workers),
            generations=dict(self.generations),
            events=list(self.events),
            checkpoints=dict(self.checkpoints),
        )

    def status(self, name: str) -> JobStatus:
        job, spec, metrics = self.job, self.job.spec, self.job.metrics
        workers = [
            WorkerView(
                id=r.id,
                pid=r.pid,
                host=r.host,
                state=r.state,
                rank=r.rank,
                last_heartbeat=r.last_heartbeat,
                exit_code=r.exit_code,
                node=r.node,
            )
            for _, r in sorted(self.workers.items())
        ]
        return JobStatus(
            name=name,
            state=job.state,
            step=job.step,
            world_size=job.world_size,
            target_workers=job.target_workers,
            pending_workers=sum(r.state == "pending" for r in self.workers.values()),
            standby_workers=sum(r.state == "standby" for r in self.workers.values()),
            spares=spec.get("spares", 0),  # a job recorded before --spares had none
            min_workers=spec["min_workers"],
            max_workers=spec["max_workers"],
            script=spec["script"],
            created=job.created,
            url=job.url,
            workers=workers,
            generations=[g for _, g in sorted(self.generations.items())],
            events=list(self.events),
            metrics=metrics,
            checkpoints=[c for _, c in sorted(self.checkpoints.items())],
            cost=metrics.get("cost", 0.0),
            cost_per_1k_samples=metrics.get("cost_per_1k_samples"),
            checkpoint_failures=job.checkpoint_failures,
            last_checkpoint_error=job.last_checkpoint_error,
            projected_cost=metrics.get("projected_cost"),
            **_observability_urls(job.url, name, job.state),
        )


def _observability_urls(url: str | None, name: str, state: str) -> dict[str, str | None]:
    """The job's dashboard page and ``/metrics`` on its coordinator (None once it ended)."""
    if not url or JobState(state).terminal:
        return {"dashboard_url": None, "metrics_url": None}
    return {"dashboard_url": f"{url}/jobs/{quote(name, safe='')}", "metrics_url": f"{url}/metrics"}
