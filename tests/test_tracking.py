"""``tidal run --track`` (issue 55): every committed step's ``tidal.log`` values go to MLflow
or W&B once, under one run per job, across resizes, coordinator restarts and ``tidal resume``.

Table tests of the rules (``tracking.plan``: which steps go now, what an interrupted batch
still needs; the setting's forms), the worker's resend to a restarted coordinator through the
real API in process, the forwarder against MLflow's file store (an interrupted batch mended,
an unreachable server), and real jobs: 300 logged steps of digits through
``--schedule 100:3,200:1`` and a SIGKILL of the coordinator give exactly one MLflow point per
step per metric under one run (the acceptance test), and a job tracked in W&B offline mode,
stopped and resumed, leaves each step once under one run id in its ``.wandb`` files."""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from e2e_helpers import Home, summarize, wait_gone

from tidal.config import JobSpec, Track, parse_track
from tidal.coordinator.records.db import Database
from tidal.coordinator.records.home import db_path
from tidal.coordinator.records.records import WorkerRecord
from tidal.coordinator.records.step_metrics import StepLog, StepValue
from tidal.dashboard.history import HistoryStore, Recorder
from tidal.protocol import JobState, worker_token
from tidal.tracking.forwarder import Forwarder
from tidal.tracking.plan import (
    Record,
    Row,
    Sighting,
    committed_before,
    next_batch,
    observe,
    record_for,
    unsent,
)
from tidal.tracking.table import TrackerTable
from tidal.tracking.trackers import check_available, resolve_track
from tidal.worker.agent.client import Agent, WorkerEnv

NAN = float("nan")


# -- which steps go now ------------------------------------------------------------------------
def _rows(*spec: tuple[int, str, int]) -> list[Row]:
    return [Row(step=s, name=n, value=float(s), seq=q) for s, n, q in spec]


def _seen(rows: list[Row], at: float, **later: float) -> dict:
    """Every row seen at ``at``; ``later``: 'STEP_NAME' seen at another time."""
    out = {}
    for r in rows:
        when = later.get(f"s{r.step}_{r.name}", at)
        out[(r.step, r.name)] = Sighting(seq=r.seq, at=when, wall=100.0 + when)
    return out


ROWS = _rows((0, "loss", 1), (0, "acc", 2), (1, "loss", 3), (2, "loss", 4), (3, "loss", 5))
GOING, STOPPED, SUCCEEDED = (False, False), (True, False), (True, True)  # (ending, final)
# name: (sent_through, committed, now, seen late, (ending, final), max_points, sent, through)
BATCHES = {
    "committed and settled steps go in order": (-1, 3, 10, {}, GOING, 9, [0, 0, 1, 2], 2),
    "a step not committed waits, and those after it": (-1, 1, 10, {}, GOING, 9, [0, 0], 0),
    "a row changed lately holds its step and the later ones": (
        -1, 9, 10, {"s1_loss": 9.5}, GOING, 9, [0, 0], 0
    ),
    "nothing settled: nothing goes, the mark stays": (
        -1, 9, 10, {"s0_acc": 9.9}, GOING, 9, [], -1
    ),
    "steps at or below the mark never go again": (1, 9, 10, {}, GOING, 9, [2, 3], 3),
    "a job that succeeded sends everything": (
        -1, 3, 0, {"s3_loss": 0.0}, SUCCEEDED, 9, [0, 0, 1, 2, 3], 3
    ),
    "a stopped job sends its committed steps, keeps the rest for its resume": (
        -1, 3, 0, {"s2_loss": 0.0}, STOPPED, 9, [0, 0, 1, 2], 2
    ),
    "a batch ends before the limit, never inside a step": (-1, 9, 10, {}, GOING, 3, [0, 0, 1], 1),
    "a step larger than the limit goes alone": (-1, 9, 10, {}, GOING, 1, [0, 0], 0),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BATCHES))
def test_next_batch_sends_ready_steps_in_order_once(case: str) -> None:
    sent_through, committed, now, later, (ending, final), limit, steps, through = BATCHES[case]
    seen = _seen(ROWS, at=0.0, **later)
    points, got = next_batch(
        ROWS,
        seen,
        sent_through=sent_through,
        committed=committed,
        now=now,
        ending=ending,
        final=final,
        max_points=limit,
    )
    assert [p.step for p in points] == steps
    assert got == through
    assert all(p.wall == 100.0 + seen[(p.step, p.name)].at for p in points)


@pytest.mark.parametrize(
    ("at", "count"),
    [(0.5, 0), (1.0, 3), (1.5, 3), (2.0, 7), (9.0, 9)],
)
def test_a_step_counts_as_committed_once_the_count_passed_it_a_while_ago(at, count) -> None:
    samples = [(1.0, 3), (2.0, 7), (3.0, 9)]
    assert committed_before(samples, at=at) == count


def test_a_row_written_again_is_seen_anew_and_the_mark_forgets_old_sightings() -> None:
    first = observe({}, _rows((4, "loss", 1), (5, "loss", 2)), now=1.0, wall=11.0, after=-1)
    again = observe(first, _rows((4, "loss", 1), (5, "loss", 7)), now=3.0, wall=13.0, after=-1)
    assert again[(4, "loss")].at == 1.0  # unchanged: its first sighting stays
    assert again[(5, "loss")] == Sighting(seq=7, at=3.0, wall=13.0)  # a new value: seen now
    assert set(observe(again, [], now=4.0, wall=14.0, after=4)) == {(5, "loss")}
    # a value that changed after it was seen does not count as settled
    points, _ = next_batch(_rows((5, "loss", 8)), again, sent_through=4, committed=9, now=100.0)
    assert points == []


def test_an_interrupted_batch_sends_only_what_the_tracker_lacks() -> None:
    rows = _rows((7, "loss", 1), (7, "acc", 2), (8, "loss", 3))
    assert unsent(rows, {("loss", 7), ("acc", 7)}) == rows[2:]
    assert unsent(rows, set()) == rows
    assert unsent(rows, None) == rows  # the tracker cannot tell: all go (W&B drops its own)


def test_a_job_keeps_its_run_unless_the_tracker_changed() -> None:
    old = Record(kind="mlflow", target="file:///m", key="k1", run_id="r1", sent_through=41)
    assert record_for(old, kind="mlflow", target="file:///m", key="k2") == old
    assert record_for(None, kind="mlflow", target="file:///m", key="k2") == Record(
        kind="mlflow", target="file:///m", key="k2"
    )
    fresh = record_for(old, kind="wandb", target=None, key="k3")
    assert (fresh.key, fresh.run_id, fresh.sent_through, fresh.sending_through) == (
        "k3",
        None,
        -1,
        -1,
    )


# -- the setting -----------------------------------------------------------------------------
def test_track_forms_and_refusals() -> None:
    assert parse_track("mlflow") == Track("mlflow")
    assert parse_track("mlflow:http://h:5000") == Track("mlflow", "http://h:5000")
    assert parse_track("wandb:team/proj") == Track("wandb", "team/proj")
    for bad, words in [
        ("neptune", "write mlflow[:TRACKING_URI] or wandb"),
        ("mlflow:", "nothing after ':'"),
        ("wandb:a/b/c", "[ENTITY/]PROJECT"),
        ("wandb:my proj", "[ENTITY/]PROJECT"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_track(bad)
    with pytest.raises(ValueError, match="bad --track"):
        JobSpec(name="j", script="x.py", track="tensorboard")


def test_the_job_records_where_its_tracker_is(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = {"MLFLOW_TRACKING_URI": "http://mlflow:5000", "WANDB_PROJECT": "p", "WANDB_ENTITY": "e"}
    assert resolve_track("mlflow", {}) == "mlflow"
    assert resolve_track("mlflow", env) == "mlflow:http://mlflow:5000"
    assert resolve_track("mlflow:./runs", env) == f"mlflow:{(tmp_path / 'runs').as_uri()}"
    assert resolve_track("mlflow:file:runs", {}) == f"mlflow:{(tmp_path / 'runs').as_uri()}"
    assert resolve_track("mlflow:sqlite:///db.sqlite", {}) == "mlflow:sqlite:///db.sqlite"
    assert resolve_track("mlflow:databricks", {}) == "mlflow:databricks"
    assert resolve_track("wandb", env) == "wandb:e/p"
    assert resolve_track("wandb:q", env) == "wandb:q"  # the flag wins over the shell
    assert resolve_track("wandb", {}) == "wandb"


@pytest.mark.parametrize(
    ("name", "sent"),
    [
        ("loss", "loss"),
        ("eval/acc top-1", "eval/acc top-1"),  # MLflow takes / and spaces
        ("acc@1", "acc_1"),
        ("grad_norm[0]", "grad_norm_0_"),
        ("/abs", "_abs"),  # a name must not read as another path
        ("a//b", "a__b"),
        ("a/../b", "a_.._b"),
    ],
)
def test_metric_names_mlflow_refuses_are_sent_with_underscores(name: str, sent: str) -> None:
    from tidal.tracking.mlflow_sink import metric_name

    assert metric_name(name) == sent


def test_a_missing_tracker_package_is_one_line(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
    )
    with pytest.raises(ValueError, match=r"^--track wandb needs the wandb package: pip install"):
        check_available("wandb:p")


# -- a restarted coordinator gets again what the dead one took but did not write down -----------
def _until(pred, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _loss_rows(home: Path, job: str) -> dict[int, tuple[float, int]]:
    db = Database(db_path(home))
    try:
        rows = db._read(
            "SELECT step, value, seq FROM step_metrics WHERE job = ? AND name = 'loss'", (job,)
        )
    finally:
        db.close()
    return {s: (v, q) for s, v, q in rows}


def test_a_restarted_coordinator_gets_again_the_records_the_dead_one_had_not_written(
    served_coordinator, tmp_path: Path
) -> None:
    coord, url = served_coordinator
    with coord.lock:
        coord.job.workers[0] = WorkerRecord(id=0)
    recorder = Recorder(coord, tmp_path)
    agent = Agent(WorkerEnv(url=url, token=worker_token(coord.token, 0), worker_id=0))
    try:
        agent.register(max_steps=10)
        for step in range(4):
            agent.post_step_metrics(step, 1, {"loss": float(step)})
        agent.send_soon()
        _until(lambda: len(agent._delivered) == 4, what="steps 0-3 delivered")
        with coord.lock:
            coord.flush()  # the loop's pass applies them
        recorder.tick(force=True)  # written down: steps 0 to 3, and worker 0's mark
        written = _loss_rows(tmp_path, "served")
        assert sorted(written) == [0, 1, 2, 3]
        assert coord.executor.saved_step_metrics(0) == (1, 3)

        for step in range(4, 7):  # taken by the coordinator, never written: it dies
            agent.post_step_metrics(step, 1, {"loss": float(step)})
        agent.send_soon()
        _until(lambda: len(agent._delivered) == 7, what="steps 4-6 delivered")
        with coord.lock:
            coord.flush()
            # What its successor starts with (``recovery``): the rows in SQLite, an empty
            # step log, and the worker not registered with it yet (answered 409).
            coord.job.step_log = StepLog()
            coord.job.workers[0].adopted = False
        agent.send_soon()
        _until(lambda: agent.epoch == 2, what="the worker registered again")
        _until(lambda: len(agent._delivered) == 4, what="steps 3-6 delivered again")
        assert [r.step for r in agent._delivered] == [3, 4, 5, 6]  # from the saved mark on
        with coord.lock:
            coord.flush()
        recorder.tick(force=True)
    finally:
        agent.close()
        recorder.close()
    rows = _loss_rows(tmp_path, "served")
    assert {s: v for s, (v, _) in rows.items()} == {s: float(s) for s in range(7)}
    assert all(rows[s][1] == written[s][1] for s in (0, 1, 2))  # not written again
    assert coord.executor.saved_step_metrics(0) == (1, 6)


# -- the forwarder against the real trackers ---------------------------------------------------
def _write_steps(home: Path, job: str, steps: range, gen: int = 1) -> None:
    store = HistoryStore(db_path(home))
    try:
        values = [
            StepValue(step=s, name=n, value=s + (0.5 if n == "acc" else 0.0), generation=gen)
            for s in steps
            for n in ("loss", "acc")
        ]
        store.append(job, [], steps=values)
    finally:
        store.close()


def _forwarder(home: Path, track: Track, committed: int, lines: list[str]) -> Forwarder:
    f = Forwarder(
        track=track,
        job="j",
        db=db_path(home),
        committed=lambda: committed,
        note=lines.append,
    )
    f.start()
    return f


def test_mlflow_gets_each_step_once_under_one_run_an_interrupted_batch_mended(
    tmp_path: Path, monkeypatch
) -> None:
    pytest.importorskip("mlflow")
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow >= 3.13's opt-in
    uri = (tmp_path / "mlruns").as_uri()
    track, lines = Track("mlflow", uri), []
    _write_steps(tmp_path, "j", range(50))
    first = _forwarder(tmp_path, track, committed=40, lines=lines)
    _until(lambda: first.record is not None and first.record.sent_through == 39, 30, "step 39")
    assert first.close(None) is None  # a coordinator that stops mid-job: the run stays open
    run_id = first.record.run_id
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(run_id).info.status == "RUNNING"

    # The next coordinator's predecessor died sending steps 40 to 44, after 40 to 42 arrived.
    table = TrackerTable(db_path(tmp_path))
    table.save("j", replace(table.load("j"), sending_through=44))
    table.close()
    client.log_batch(
        run_id,
        metrics=[
            Metric(key=n, value=s + (0.5 if n == "acc" else 0.0), timestamp=0, step=s)
            for s in (40, 41, 42)
            for n in ("loss", "acc")
        ],
    )
    second = _forwarder(tmp_path, track, committed=40, lines=lines)
    assert second.close(JobState.SUCCEEDED) is None  # the job's end: everything goes
    assert second.record.run_id == run_id and second.record.sent_through == 49
    for name, offset in (("loss", 0.0), ("acc", 0.5)):
        history = client.get_metric_history(run_id, name)
        assert sorted(m.step for m in history) == list(range(50)), name
        assert all(m.value == m.step + offset for m in history)
    runs = client.search_runs(experiment_ids=["0"])
    assert [r.info.run_id for r in runs] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(run_id).info.run_name == "j"
    assert any(
        "steps 40 to 44" in x and "6 of their points had arrived, 4 sent" in x for x in lines
    )
    # ``tidal resume`` of the job: the same run, RUNNING again, then ended as the job is
    _write_steps(tmp_path, "j", range(50, 55), gen=2)
    third = _forwarder(tmp_path, track, committed=55, lines=lines)
    _until(lambda: third.record is not None and third.record.run_id == run_id, 30, "the run")
    _until(lambda: client.get_run(run_id).info.status == "RUNNING", 30, "RUNNING again")
    assert third.close(JobState.STOPPED) is None
    assert client.get_run(run_id).info.status == "KILLED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(55))


def test_an_unreachable_tracker_never_holds_the_job_and_its_end_says_what_was_not_sent(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    pytest.importorskip("mlflow")
    import socket

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries: none
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _write_steps(tmp_path, "j", range(10))
    lines: list[str] = []
    f = _forwarder(tmp_path, Track("mlflow", f"http://127.0.0.1:{port}"), 10, lines)
    _until(lambda: f.failures >= 2, 60, "two failed attempts")  # nothing waits for them
    started = time.monotonic()
    left = f.close(JobState.SUCCEEDED, timeout_s=3.0)
    assert time.monotonic() - started < 5.0
    assert left is not None and "were not all sent" in left and "--history" in left, left
    warnings = [x for x in lines if "(retrying)" in x]
    assert len(warnings) == 1, lines  # said once, not at every retry: an event and a warning
    said = [x for x in capsys.readouterr().err.splitlines() if "(retrying)" in x]
    assert len(said) == 1 and said[0].endswith(warnings[0]), said  # the tidal logger's line
    assert TrackerTable(db_path(tmp_path)).load("j").sent_through == -1


def _wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, 0xBEE1, a version), then
    LevelDB's log format (32 KiB blocks of chunks: crc32, length, kind full, first, middle or
    last), each record a ``wandb.proto`` ``Record``. W&B 0.31 ships its reader in Go only
    (``wandb-core``; the Python ``datastore`` of older releases is gone)."""
    data = path.read_bytes()
    assert struct.unpack("<4sH", data[:6]) == (b":W&B", 0xBEE1), data[:7]
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room  # a block's tail too short for a chunk header: padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # full, first
            parts = chunk
        elif kind in (3, 4):  # middle, last
            parts += chunk
        if kind in (1, 4):
            yield parts


def _wandb_history(root: Path) -> list[dict]:
    """Every history row of the offline runs under ``root``, decoded with W&B's protobufs."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(root.glob("wandb/offline-run-*/run-*.wandb")):
        for data in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                        for i in record.history.item
                    }
                )
    return rows


# -- real jobs ---------------------------------------------------------------------------------
STEPS = 300
KILL_AT = 250


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_300_steps_a_resize_schedule_and_a_coordinator_sigkill_give_one_mlflow_point_each(
    tidal_home: Home, tmp_path: Path, monkeypatch
) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow >= 3.13's opt-in
    uri = (tmp_path / "mlruns").as_uri()
    faults = tmp_path / "faults"
    # The job waits at step 250 while its coordinator is killed: the values of the last
    # second or so are in flight (taken, not yet written down), the tracker some way behind.
    # Whichever worker is the one member left after step 200 (under load the first to start
    # is not always worker 0).
    faults.write_text(";".join(f"hold@worker={w},step={KILL_AT}" for w in range(3)))
    started = time.monotonic()
    job = tidal_home.start(
        "tracked",
        "--workers",
        "2",
        "--max-workers",
        "3",
        "--schedule",
        "100:3,200:1",
        "--track",
        f"mlflow:{uri}",
        script_args=["--max-steps", str(STEPS), "--log-every", "1"],
        faults=f"@{faults}",
    )
    held = Path(f"{faults}.held")
    try:
        job.wait_for(lambda _s: held.exists(), timeout=90, what=f"the member held at {KILL_AT}")
        old = job.coordinator_info()
        os.kill(old["pid"], signal.SIGKILL)
        assert not wait_gone([old["pid"]], timeout=10)
        table = TrackerTable(db_path(tidal_home.path))  # where the dead one had got to
        sent_at_kill = table.load("tracked").sent_through
        table.close()
        job.wait_for(
            lambda s: s.get("coordinator_pid") not in (None, old["pid"]),
            timeout=30,
            what="a restarted coordinator",
            interval=0.05,
        )
    finally:
        Path(f"{faults}.release").touch()
    job.wait_state("succeeded", "failed", "stopped", "interrupted", timeout=90)
    elapsed = time.monotonic() - started
    tidal_home.assert_no_processes(timeout=60)  # the coordinator ended the run and exited
    cli = tidal_home.cli("status", "tracked", "--json", "--history", timeout=60)
    assert cli.returncode == 0, cli.stderr
    status = json.loads(cli.stdout)
    assert status["state"] == "succeeded" and status["step"] == STEPS, summarize(status)
    assert [(g["world_size"], g["start_step"]) for g in status["generations"]] == [
        (2, 0),
        (3, 100),
        (1, 200),
    ], summarize(status)
    events = [e["message"] for e in status["events"]]
    assert any("coordinator restarted" in m for m in events), summarize(status)
    assert any("re-registered" in m for m in events), summarize(status)

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs(experiment_ids=["0"])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # one run, through the restart
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    history = status["history"]
    for name, steps in (("loss", list(range(STEPS))), ("accuracy", list(range(STEPS)))):
        points = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert [s for s, _ in points] == steps, (name, [s for s, _ in points])  # once each
        assert [v for _, v in points] == pytest.approx(history[name]["value"], rel=1e-12)
    tested = client.get_metric_history(run.info.run_id, "test_accuracy")
    assert [m.step for m in tested] == [STEPS]
    # both coordinators sent to that run, the second from where the first had got to
    opened = [m for m in events if m.startswith("tracking: MLflow run")]
    assert len(opened) == 2 and all(run.info.run_id in m for m in opened), events
    assert (f"from step {sent_at_kill + 1} on" in opened[1]) == (sent_at_kill >= 0), opened
    print(
        f"tracked job of {STEPS} steps, coordinator SIGKILLed at step {KILL_AT} with the "
        f"tracker at step {sent_at_kill}: {elapsed:.1f} s"
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_job_tracked_in_wandb_offline_keeps_one_run_through_a_stop_and_a_resume(
    tidal_home: Home, tmp_path: Path, monkeypatch
) -> None:
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    steps, faults = 100, tmp_path / "faults"
    faults.write_text("hold@worker=0,step=60;hold@worker=1,step=60")  # stopped meanwhile
    job = tidal_home.start(
        "wb",
        "--workers",
        "2",
        "--checkpoint-every",
        "20",
        "--track",
        "wandb:tidal-tests",
        script_args=["--max-steps", str(steps), "--log-every", "1"],
        faults=f"@{faults}",
    )
    try:
        job.wait_for(lambda _s: Path(f"{faults}.held").exists(), 90, "the members held")
        assert job.stop().returncode == 0
    finally:
        Path(f"{faults}.release").touch()
    stopped = job.wait_state("stopped", "failed", "succeeded", timeout=90)
    assert stopped["state"] == "stopped", summarize(stopped)
    at = stopped["step"]
    tidal_home.assert_no_processes(timeout=60)
    proc = tidal_home.cli("resume", "wb", "--quiet", timeout=180)
    assert proc.returncode == 0, f"{proc.stderr}\n{job.logs_tail()}"

    table = TrackerTable(db_path(tidal_home.path))
    record = table.load("wb")
    table.close()
    assert record.run_id == record.key and record.sent_through == steps  # the run: Tidal's id
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"))  # one per coordinator
    assert [f.name.rsplit("-", 1)[1] for f in folders] == [record.key] * 2, folders
    rows = _wandb_history(tmp_path)
    assert [r["_step"] for r in rows] == list(range(steps + 1)), [r["_step"] for r in rows]
    names = [set(r) - {"_step", "_runtime", "_timestamp"} for r in rows]
    assert all(n == {"loss", "accuracy"} for n in names[:at]), names[:at]
    # the stopped run's evaluation after its loop waited for the resumed run's step ``at``
    assert names[at] == {"loss", "accuracy", "test_loss", "test_accuracy"}, names[at]
    assert names[steps] == {"test_loss", "test_accuracy"}
    tidal_home.assert_no_processes()
