"""Prometheus exposition of jobs (``GET /metrics``), labelled by job.

Built at scrape time from the same ``JobStatus`` that ``tidal status --json`` prints, so the
two cannot disagree, and the same code serves a live coordinator (its own job) and
``tidal dashboard`` (every job of a home, read from SQLite).

Families (each with a ``job`` label):

| name | type | what |
|---|---|---|
| ``tidal_world_size`` | gauge | members of the generation that trains now (0 when none) |
| ``tidal_target_workers`` | gauge | the count the job is scaling to |
| ``tidal_min_workers``, ``tidal_max_workers`` | gauge | the job's bounds |
| ``tidal_step`` | gauge | the highest committed step |
| ``tidal_generation`` | gauge | id of the newest generation |
| ``tidal_samples_per_second`` | gauge | throughput rank 0 measured (``samples_per_s``) |
| ``tidal_rescale_pause_seconds`` | histogram | training stall of each membership change (``pause_s``) |
| ``tidal_worker_failures_total`` | counter | workers that ended ``failed`` (crash, kill, hang) |
| ``tidal_checkpoint_stall_seconds`` | gauge | what the last checkpoint cost the training thread |
| ``tidal_cost_dollars`` | gauge | the job's cost so far (the ``cost`` metric; 0 until reported) |
| ``tidal_job_state`` | gauge | 1 for the job's state, 0 for the others (label ``state``) |
| ``tidal_workers`` | gauge | workers per state (label ``state``) |
| ``tidal_metric`` | gauge | every metric the script reported (label ``name``) |
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from tidal.protocol import JobState, JobStatus, WorkerState

PAUSE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Reported metrics with a family of their own (not repeated in tidal_metric).
OWN_FAMILY = {"samples_per_s", "checkpoint_stall_s", "cost", "world_size"}

__all__ = ["CONTENT_TYPE_LATEST", "JobsCollector", "families", "render"]


def _finite(v: object) -> float:
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return f if math.isfinite(f) else 0.0


def families(statuses: Iterable[JobStatus]) -> list[Metric]:
    """The metric families of ``statuses``, one sample per job in each."""
    job = ["job"]
    g = {
        "world_size": GaugeMetricFamily(
            "tidal_world_size", "Members of the generation that trains now.", labels=job
        ),
        "target": GaugeMetricFamily(
            "tidal_target_workers", "Worker count the job is scaling to.", labels=job
        ),
        "min": GaugeMetricFamily("tidal_min_workers", "The job's --min-workers.", labels=job),
        "max": GaugeMetricFamily("tidal_max_workers", "The job's --max-workers.", labels=job),
        "step": GaugeMetricFamily("tidal_step", "Highest committed training step.", labels=job),
        "generation": GaugeMetricFamily(
            "tidal_generation", "Id of the newest generation (membership epoch).", labels=job
        ),
        "rate": GaugeMetricFamily(
            "tidal_samples_per_second", "Training throughput measured by rank 0.", labels=job
        ),
        "stall": GaugeMetricFamily(
            "tidal_checkpoint_stall_seconds",
            "Training-thread stall of the last durable checkpoint.",
            labels=job,
        ),
        "cost": GaugeMetricFamily(
            "tidal_cost_dollars", "The job's cost so far (0 until reported).", labels=job
        ),
    }
    failures = CounterMetricFamily(
        "tidal_worker_failures",
        "Workers that ended failed: crashed, killed, or killed after missing heartbeats.",
        labels=job,
    )
    pauses = HistogramMetricFamily(
        "tidal_rescale_pause_seconds",
        "Training stall of each membership change (generation pause_s).",
        labels=job,
    )
    state = GaugeMetricFamily(
        "tidal_job_state", "1 for the job's current state.", labels=["job", "state"]
    )
    workers = GaugeMetricFamily("tidal_workers", "Workers per state.", labels=["job", "state"])
    reported = GaugeMetricFamily(
        "tidal_metric", "Latest value of each metric the script reported.", labels=["job", "name"]
    )
    for s in statuses:
        m = s.metrics
        lab = [s.name]
        g["world_size"].add_metric(lab, s.world_size)
        g["target"].add_metric(lab, s.target_workers)
        g["min"].add_metric(lab, s.min_workers)
        g["max"].add_metric(lab, s.max_workers)
        g["step"].add_metric(lab, s.step)
        g["generation"].add_metric(lab, s.generations[-1].id if s.generations else 0)
        g["rate"].add_metric(lab, _finite(m.get("samples_per_s", 0.0)) if s.world_size else 0.0)
        g["stall"].add_metric(lab, _finite(m.get("checkpoint_stall_s", 0.0)))
        g["cost"].add_metric(lab, _finite(getattr(s, "cost", 0.0) or m.get("cost", 0.0)))
        failures.add_metric(lab, sum(1 for w in s.workers if w.state == WorkerState.FAILED))
        values = [p.pause_s for p in s.generations if p.pause_s is not None]
        counts = [sum(1 for v in values if v <= le) for le in PAUSE_BUCKETS]
        pauses.add_metric(
            lab,
            buckets=[(str(le), c) for le, c in zip(PAUSE_BUCKETS, counts, strict=True)]
            + [("+Inf", len(values))],
            sum_value=sum(values),
        )
        for st in JobState:
            state.add_metric([s.name, st.value], 1.0 if s.state == st else 0.0)
        for ws in WorkerState:
            workers.add_metric([s.name, ws.value], sum(1 for w in s.workers if w.state == ws))
        for key in sorted(m):
            if key not in OWN_FAMILY:
                reported.add_metric([s.name, key], _finite(m[key]))
    return [*g.values(), failures, pauses, state, workers, reported]


class JobsCollector:
    """A prometheus_client collector that asks ``get_statuses`` at every scrape."""

    def __init__(self, get_statuses: Callable[[], Iterable[JobStatus]]) -> None:
        self._get = get_statuses

    def collect(self) -> Iterator[Metric]:
        yield from families(self._get())


def render(get_statuses: Callable[[], Iterable[JobStatus]]) -> bytes:
    """The text exposition format (``CONTENT_TYPE_LATEST``) of the jobs' metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobsCollector(get_statuses))
    return generate_latest(registry)
