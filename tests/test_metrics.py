"""Prometheus exposition: ``tidal.metrics`` families, and ``GET /metrics`` of a real coordinator
(in-process, no worker). The live job's ``/metrics`` is also read in the browser test."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tidal.metrics import render
from tidal.protocol import API_PREFIX, GenerationView, JobStatus, WorkerView

REQUIRED = [
    "tidal_world_size",
    "tidal_target_workers",
    "tidal_step",
    "tidal_samples_per_second",
    "tidal_rescale_pause_seconds_bucket",
    "tidal_rescale_pause_seconds_count",
    "tidal_rescale_pause_seconds_sum",
    "tidal_worker_failures_total",
    "tidal_checkpoint_stall_seconds",
    "tidal_cost_dollars",
]


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, parsed by prometheus_client's own text parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(parsed: dict, sample: str, /, **labels: str) -> float:
    return parsed[(sample, frozenset(labels.items()))]


def _status(name: str, **kw) -> JobStatus:
    base = dict(
        name=name,
        state="running",
        step=120,
        world_size=3,
        target_workers=3,
        min_workers=1,
        max_workers=4,
        script="train.py",
        created=0.0,
    )
    return JobStatus(**{**base, **kw})


def test_families_hold_every_required_metric_labelled_by_job() -> None:
    gens = [
        GenerationView(
            id=i + 1,
            world_size=2,
            members=[0, 1],
            start_step=0,
            reason="r",
            pause_s=p,
            opened_at=0.0,
        )
        for i, p in enumerate([None, 0.02, 0.3])
    ]
    workers = [
        WorkerView(id=0, rank=0, pid=1, state="running"),
        WorkerView(id=1, rank=None, pid=2, state="failed"),
    ]
    a = _status(
        "a",
        generations=gens,
        workers=workers,
        metrics={
            "samples_per_s": 1234.5,
            "loss": 0.25,
            "checkpoint_stall_s": 0.012,
            "cost": 1.5,
        },
    )
    b = _status("b", state="succeeded", world_size=0, step=7, metrics={"samples_per_s": 99.0})
    parsed = samples(render(lambda: [a, b]).decode())
    for name in REQUIRED:
        for job in ("a", "b"):
            assert any(k[0] == name and ("job", job) in k[1] for k in parsed), (name, job)
    assert value(parsed, "tidal_world_size", job="a") == 3
    assert value(parsed, "tidal_step", job="a") == 120
    assert value(parsed, "tidal_samples_per_second", job="a") == 1234.5
    assert value(parsed, "tidal_samples_per_second", job="b") == 0  # nothing trains
    assert value(parsed, "tidal_checkpoint_stall_seconds", job="a") == 0.012
    assert value(parsed, "tidal_cost_dollars", job="a") == 1.5
    assert value(parsed, "tidal_cost_dollars", job="b") == 0
    assert value(parsed, "tidal_worker_failures_total", job="a") == 1
    # the histogram of pauses: 0.02 and 0.3 (a generation without a pause is not counted)
    assert value(parsed, "tidal_rescale_pause_seconds_bucket", job="a", le="0.025") == 1
    assert value(parsed, "tidal_rescale_pause_seconds_bucket", job="a", le="0.5") == 2
    assert value(parsed, "tidal_rescale_pause_seconds_bucket", job="a", le="+Inf") == 2
    assert value(parsed, "tidal_rescale_pause_seconds_count", job="a") == 2
    assert value(parsed, "tidal_rescale_pause_seconds_sum", job="a") == pytest.approx(0.32)
    assert value(parsed, "tidal_metric", job="a", name="loss") == 0.25
    assert value(parsed, "tidal_job_state", job="b", state="succeeded") == 1
    assert value(parsed, "tidal_job_state", job="b", state="running") == 0


def test_non_finite_metrics_do_not_break_the_exposition() -> None:
    s = _status("nan", metrics={"loss": float("nan"), "samples_per_s": float("inf")})
    parsed = samples(render(lambda: [s]).decode())
    assert value(parsed, "tidal_metric", job="nan", name="loss") == 0
    assert value(parsed, "tidal_samples_per_second", job="nan") == 0


@pytest.fixture
def served(served_coordinator):
    return served_coordinator


def test_coordinator_serves_metrics_of_its_job(served) -> None:
    coord, url = served
    with coord.lock:
        coord.job.metrics.update(samples_per_s=10.0, checkpoint_stall_s=0.25)
        coord.flush()  # as the loop does every half second: reads see it from then on
    resp = httpx.get(url + "/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    parsed = samples(resp.text)
    for name in REQUIRED:
        assert any(k[0] == name and ("job", "served") in k[1] for k in parsed), name
    assert value(parsed, "tidal_target_workers", job="served") == 1
    cost = httpx.get(url + API_PREFIX + "/status").json()["cost"]  # the coordinator's accounting
    assert value(parsed, "tidal_cost_dollars", job="served") == cost
    assert value(parsed, "tidal_checkpoint_stall_seconds", job="served") == 0.25
    assert value(parsed, "tidal_job_state", job="served", state="pending") == 1


def test_status_names_the_dashboard_and_metrics_urls(served) -> None:
    _, url = served
    data = httpx.get(url + API_PREFIX + "/status").json()
    assert data["dashboard_url"] == f"{url}/jobs/served"
    assert data["metrics_url"] == f"{url}/metrics"
    assert httpx.get(data["dashboard_url"]).status_code == 200
    assert httpx.get(data["metrics_url"]).status_code == 200
