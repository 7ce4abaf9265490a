"""Per-step metrics (issue 12): ``tidal.log`` at step s records one value for step s (rank 0's,
or the mean over the members that logged it), the newest generation's when a step is redone,
in the status history (``tidal status --json --history``), the dashboard and TensorBoard.

Table tests of the rules (the coordinator's ``StepLog``, the SQLite rows, the TensorBoard
sink, the worker's outbox, ``tidal.log``'s routing), one in-process round trip through the
API, and one real job: 300 logged steps across two resizes give 300 points everywhere."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from e2e_helpers import Home, summarize

import tidal
from tidal.coordinator.records.db import Database
from tidal.coordinator.records.home import db_path
from tidal.coordinator.records.records import WorkerRecord
from tidal.coordinator.records.step_metrics import StepLog, StepValue
from tidal.dashboard.history import HistoryStore, Recorder
from tidal.dashboard.sources import HomeSource
from tidal.protocol import MAX_STEP_RECORDS, HeartbeatRequest, StepMetrics, worker_token
from tidal.worker.agent import client as agent_mod
from tidal.worker.agent.client import Agent, WorkerEnv
from tidal.worker.trainer.elastic import post_step_metrics

NAN, INF = float("nan"), float("inf")


def rec(step: int, gen: int, **values: float) -> StepMetrics:
    return StepMetrics(step=step, generation=gen, values=values)


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


# -- the coordinator's rules -----------------------------------------------------------------
# Each case: reports (worker, step, generation, value of "loss") in arrival order; the value
# kept for each step; the gauge (status.metrics["loss"]) at the end.
CASES = {
    "rank 0 once per step": (
        [(0, 0, 1, 3.0), (0, 1, 1, 2.0), (0, 2, 1, 1.0)],
        {0: 3.0, 1: 2.0, 2: 1.0},
        1.0,
    ),
    "logged twice in a step: the last value": (
        [(0, 0, 1, 3.0), (0, 0, 1, 2.5)],
        {0: 2.5},
        2.5,
    ),
    "redone in a newer generation: the last value wins": (
        [(0, 4, 1, 9.0), (1, 4, 2, 4.0)],
        {4: 4.0},
        4.0,
    ),
    "a late report of the superseded generation is ignored": (
        [(1, 4, 2, 4.0), (0, 4, 1, 9.0)],
        {4: 4.0},
        4.0,
    ),
    "mean over the members that reported": (
        [(0, 7, 3, 1.0), (1, 7, 3, 2.0), (2, 7, 3, 6.0)],
        {7: 3.0},
        3.0,
    ),
    "mean: a member's last value counts once": (
        [(0, 7, 3, 1.0), (1, 7, 3, 2.0), (1, 7, 3, 4.0)],
        {7: 2.5},
        2.5,
    ),
    "mean: a redo forgets the old generation's members": (
        [(0, 7, 3, 1.0), (1, 7, 3, 2.0), (2, 7, 4, 10.0)],
        {7: 10.0},
        10.0,
    ),
    "gauge: a member's late report of an older step does not move it back": (
        [(0, 5, 3, 1.0), (0, 6, 3, 2.0), (1, 5, 3, 3.0)],
        {5: 2.0, 6: 2.0},
        2.0,
    ),
    "gauge: a newer generation redoing an older step moves it": (
        [(0, 10, 3, 1.0), (0, 8, 4, 5.0)],
        {8: 5.0, 10: 1.0},
        5.0,
    ),
    "non-finite values are carried": (
        [(0, 0, 1, NAN), (0, 1, 1, INF), (0, 2, 1, 1.0), (1, 2, 1, INF)],
        {0: NAN, 1: INF, 2: INF},
        INF,
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_step_log_keeps_one_value_per_step(case: str) -> None:
    reports, expected, gauge = CASES[case]
    log = StepLog()
    metrics: dict[str, float] = {}
    kept: dict[int, float] = {}
    for worker, step, gen, value in reports:
        metrics.update(log.add(worker, rec(step, gen, loss=value)))
        for v in log.take():  # what the recorder writes: the newest value of each row
            kept[v.step] = v.value
    assert kept.keys() == expected.keys()
    assert all(same(kept[s], expected[s]) for s in expected), kept
    assert same(metrics["loss"], gauge), metrics


def test_step_log_take_returns_each_changed_value_once_and_is_bounded() -> None:
    log = StepLog(max_open=3, max_pending=4)
    log.add(0, rec(0, 1, loss=1.0, acc=0.5))
    log.add(0, rec(0, 1, loss=0.9))
    assert [(v.step, v.name, v.value) for v in log.take()] == [(0, "acc", 0.5), (0, "loss", 0.9)]
    assert log.take() == []
    for step in range(1, 7):
        log.add(0, rec(step, 1, loss=float(step)))
    assert [v.step for v in log.take()] == [3, 4, 5, 6] and log.dropped == 2
    # step 1 left the open window: a late value starts over (only its own generation's)
    log.add(1, rec(1, 1, loss=11.0))
    assert [v.value for v in log.take()] == [11.0]


# -- SQLite ----------------------------------------------------------------------------------
def test_rows_are_one_per_step_and_name_newest_generation_wins(tmp_path: Path) -> None:
    store = HistoryStore(db_path(tmp_path))
    sv = StepValue
    store.append("j", [], steps=[sv(0, "loss", 3.0, 1), sv(1, "loss", 2.0, 1), sv(1, "a", NAN, 1)])
    first = store.read_steps("j")
    assert first["series"]["loss"] == {"step": [0, 1], "value": [3.0, 2.0]}
    assert math.isnan(first["series"]["a"]["value"][0])  # NaN is stored as NULL, read back
    store.append("j", [], steps=[sv(1, "loss", 1.5, 2), sv(2, "loss", 1.0, 2)])
    store.append("j", [], steps=[sv(1, "loss", 99.0, 1)])  # older generation: refused
    store.append("other", [], steps=[sv(1, "loss", 7.0, 1)])
    newer = store.read_steps("j", after=first["seq"])  # what changed since the first read
    assert newer["series"]["loss"]["step"][:2] == [1, 2]
    everything = store.read_steps("j")["series"]["loss"]
    assert everything == {"step": [0, 1, 2], "value": [3.0, 1.5, 1.0]}
    store.close()
    # a second writer (a resumed job's coordinator) goes on from the stored seq
    again = HistoryStore(db_path(tmp_path))
    again.append("j", [], steps=[sv(3, "loss", 0.5, 3)])
    assert again.read_steps("j", after=newer["seq"])["series"]["loss"]["step"] == [3]
    again.close()
    db = Database(db_path(tmp_path), readonly=True)
    history = db.step_history("j")
    db.close()
    assert history["loss"].step == [0, 1, 2, 3]
    dumped = json.loads(history["a"].model_dump_json())
    assert dumped == {"step": [1], "value": ["NaN"]}


def test_a_first_load_thins_long_series_keeping_the_last_step(tmp_path: Path) -> None:
    store = HistoryStore(db_path(tmp_path))
    store.append("j", [], steps=[StepValue(s, "loss", float(s), 1) for s in range(1001)])
    got = store.read_steps("j", max_points=100)["series"]["loss"]["step"]
    assert len(got) <= 102 and got[0] == 0 and got[-1] == 1000
    assert len(store.read_steps("j", max_points=None)["series"]["loss"]["step"]) == 1001
    store.close()


# -- TensorBoard -----------------------------------------------------------------------------
def test_tensorboard_writes_a_step_once_when_it_settled(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from test_tensorboard import scalars

    import tidal.tensorboard as tb

    clock = [100.0]
    sink = tb.TensorBoardSink(tmp_path / "tb", "j")
    sink._clock = lambda: clock[0]
    sv = StepValue
    sink.record_steps([sv(0, "loss", 3.0, 1), sv(1, "loss", 2.0, 1)], committed=1)
    clock[0] += tb.SETTLE_S
    sink.record_steps([], committed=1)  # step 0 settled; step 1 not committed yet
    sink.record_steps([sv(0, "loss", 9.0, 2)], committed=2)  # written already: TB keeps 3.0
    clock[0] += tb.SETTLE_S
    sink.record_steps([sv(2, "loss", NAN, 1), sv(3, "loss", 0.5, 1)], committed=4)
    # a sampled gauge of a logged name is not written again; the runtime's gauges are
    sink.record(time=1.0, step=4, world_size=2, target=2, metrics={"loss": 0.5, "rate": 7.0})
    sink.close()  # the rest, settled or not
    got = scalars(tmp_path / "tb" / "j")
    assert got["metrics/loss"] == [(0, 3.0), (1, 2.0), (3, 0.5)]  # NaN: not written
    assert got["metrics/rate"] == [(4, 7.0)]


# -- the worker's side -----------------------------------------------------------------------
def test_log_refuses_an_unknown_reduction_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"reduce must be None \(rank 0's value\) or 'mean'"):
        tidal.log(loss=1.0, reduce="max")
    tidal.log(loss=1.0, reduce="mean")  # alone: nothing to report to, no error
    tidal.log(loss=1.0)


@pytest.mark.parametrize(
    ("last_rank", "reduce", "sent"),
    [(0, None, True), (1, None, False), (1, "mean", True), (None, "mean", False)],
)
def test_who_reports_a_logged_value(last_rank, reduce, sent) -> None:
    posted = []
    agent = SimpleNamespace(post_step_metrics=lambda *a: posted.append(a))
    post_step_metrics(
        agent, last_rank=last_rank, step=12, generation=3, metrics={"loss": 0.5}, reduce=reduce
    )
    assert posted == ([(12, 3, {"loss": 0.5})] if sent else [])


def test_the_outbox_merges_a_step_batches_heartbeats_and_is_bounded(monkeypatch, capsys) -> None:
    monkeypatch.setattr(agent_mod, "MAX_STEP_OUTBOX", 2500)
    agent = Agent(WorkerEnv(url="http://127.0.0.1:9", token="t", worker_id=4))
    try:
        agent.post_step_metrics(0, 1, {"loss": 1.0})
        agent.post_step_metrics(0, 1, {"loss": 0.5, "acc": 0.1})  # same step: one record
        agent.post_step_metrics(0, 2, {"loss": 0.4})  # redone in generation 2: another
        req = agent._drain()
        assert [(r.step, r.generation, r.values) for r in req.step_metrics] == [
            (0, 1, {"loss": 0.5, "acc": 0.1}),
            (0, 2, {"loss": 0.4}),
        ]
        for step in range(3000):
            agent.post_step_metrics(step, 3, {"loss": float(step)})
        assert "drops per-step metrics" in capsys.readouterr().err
        first = agent._drain()
        assert len(first.step_metrics) == MAX_STEP_RECORDS
        assert first.step_metrics[0].step == 500  # the oldest 500 were dropped
        agent._requeue(first)  # not delivered: back in front
        sent = []
        while agent._step_metrics:
            sent += [r.step for r in agent._drain().step_metrics]
        assert sent == list(range(500, 3000))
        # what the wire carries validates (NaN and infinities as strings)
        agent.post_step_metrics(7, 3, {"loss": NAN, "gn": INF})
        wire = agent._drain().model_dump_json()
        back = HeartbeatRequest.model_validate_json(wire).step_metrics[0].values
        assert math.isnan(back["loss"]) and back["gn"] == INF
    finally:
        agent._client.close()
        agent._beat_client.close()


# -- through the API, in process ----------------------------------------------------------
def test_heartbeats_carry_step_values_to_the_status_dashboard_and_history(
    served_coordinator, tmp_path: Path
) -> None:
    coord, url = served_coordinator
    with coord.lock:
        for wid in (0, 1):
            coord.job.workers[wid] = WorkerRecord(id=wid)
    recorder = Recorder(coord, tmp_path)
    agents = [
        Agent(WorkerEnv(url=url, token=worker_token(coord.token, wid), worker_id=wid))
        for wid in (0, 1)
    ]
    try:
        for a in agents:
            a.register(max_steps=3)
        for step in range(3):  # rank 0 alone, then a mean over both at step 2
            agents[0].post_step_metrics(step, 1, {"loss": 3.0 - step})
        agents[1].post_step_metrics(2, 1, {"loss": 3.0})
    finally:
        for a in agents:
            a.close()  # delivers the outbox
    with coord.lock:
        coord.job.step = 3
        coord.flush()  # the loop's pass: the queued heartbeats applied, the view published
    recorder.close()  # a last tick: the rows go to SQLite
    assert (
        coord.status(fresh=True).metrics["loss"] == 2.0
    )  # the gauge: step 2's mean of 1.0 and 3.0
    source = HomeSource(tmp_path)
    try:
        data = source.job_data("served")
    finally:
        source.close()
    assert data["steps"]["series"]["loss"] == {"step": [0, 1, 2], "value": [3.0, 2.0, 2.0]}


# -- a real job ------------------------------------------------------------------------------
STEPS = 300


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_300_logged_steps_give_300_points_across_two_resizes(tidal_home: Home, tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from test_tensorboard import scalars

    tb = tmp_path / "tb"
    started = time.monotonic()
    proc, job = tidal_home.run(
        "steps",
        "--workers",
        "2",
        "--max-workers",
        "3",
        "--schedule",
        "100:3,200:1",
        "--tensorboard",
        str(tb),
        script_args=["--max-steps", str(STEPS), "--log-every", "1"],
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, f"{proc.stderr}\n{job.logs_tail()}"
    cli = tidal_home.cli("status", "steps", "--json", "--history", timeout=60)
    assert cli.returncode == 0, cli.stderr
    status = json.loads(cli.stdout)
    assert status["state"] == "succeeded", summarize(status)
    gens = status["generations"]
    assert [(g["world_size"], g["start_step"]) for g in gens] == [(2, 0), (3, 100), (1, 200)], (
        summarize(status)
    )
    history = status["history"]
    got = scalars(tb / "steps")
    for name in ("loss", "accuracy"):
        assert history[name]["step"] == list(range(STEPS)), (name, history[name]["step"])
        points = got[f"metrics/{name}"]
        assert [s for s, _ in points] == list(range(STEPS)), (name, points)
        assert [v for _, v in points] == pytest.approx(history[name]["value"], rel=1e-6)
    # the evaluation digits logs after its loop is one more point, at the final step count
    assert history["test_accuracy"]["step"] == [STEPS]
    assert [s for s, _ in got["metrics/test_accuracy"]] == [STEPS]
    assert status["metrics"]["test_accuracy"] == history["test_accuracy"]["value"][0]
    assert status["metrics"]["loss"] == history["loss"]["value"][-1]  # the gauge: the last
    plain = json.loads(tidal_home.cli("status", "steps", "--json").stdout)
    assert "history" not in plain  # nothing heavy by default
    print(f"job of {STEPS} steps: {elapsed:.1f} s")
    tidal_home.assert_no_processes()
