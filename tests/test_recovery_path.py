"""Which path a generation's state recovery took and how many steps it redid (issue 16): the
merge of the members' reports (pure rules), the wire message old workers still send, the
status table's column, and a home written before the columns existed."""

from __future__ import annotations

import json
import sqlite3

import pytest
from pydantic import ValidationError

from tidal.coordinator.records import db as dbmod
from tidal.coordinator.records.db import Database
from tidal.coordinator.recovery import Control, rebuild
from tidal.coordinator.rules.reform_rules import merge_recovery, neighbour_copy_event
from tidal.display import print_status, recovery_cell
from tidal.protocol import HeartbeatRequest, JobStatus, RecoveryPath, StepReport

N, H, R, C, K = (
    RecoveryPath.NONE,
    RecoveryPath.HEAL,
    RecoveryPath.RESHARD,
    RecoveryPath.NEIGHBOUR_COPY,
    RecoveryPath.CHECKPOINT,
)


@pytest.mark.parametrize(
    ("recorded", "path", "redone", "merged"),
    [
        ((None, None), None, 0, (None, None)),  # an old worker: nothing said, nothing kept
        ((H, 1), None, 0, (H, 1)),  # an old worker after a new one changes nothing
        ((None, None), N, 0, (N, 0)),
        ((None, None), C, 3, (C, 3)),
        ((N, 0), H, 0, (H, 0)),  # none < heal
        ((H, 0), R, 0, (R, 0)),  # heal < reshard
        ((R, 0), C, 2, (C, 2)),  # reshard < neighbour_copy
        ((C, 2), K, 5, (K, 5)),  # neighbour_copy < checkpoint
        ((K, 5), N, 0, (K, 5)),  # a milder later report keeps the worst
        ((C, 2), R, 0, (C, 2)),
        ((C, 3), C, 2, (C, 3)),  # the most steps any member redid
        ((C, 2), C, 3, (C, 3)),
        ((None, None), None, 4, (None, 4)),  # steps redone without a path are still told
    ],
)
def test_a_generation_keeps_the_most_severe_path_and_the_most_steps(
    recorded, path, redone, merged
) -> None:
    assert merge_recovery(recorded, path, redone) == merged


@pytest.mark.parametrize(
    ("recorded", "path", "redone", "said"),
    [
        ((None, None), C, 3, "generation 7: rebuilt from neighbour copies, 3 steps redone"),
        ((N, 0), C, 1, "generation 7: rebuilt from neighbour copies, 1 steps redone"),
        ((C, 0), C, 2, "generation 7: rebuilt from neighbour copies, 2 steps redone"),
        ((C, 3), C, 3, None),  # once per generation
        ((C, 3), C, 4, None),
        ((K, 5), C, 3, None),  # the checkpoint rollback has its own event
        ((None, None), C, 0, None),  # nothing redone
        ((None, None), K, 3, None),
        ((None, None), R, 0, None),
        ((None, None), None, 3, None),
    ],
)
def test_the_neighbour_copy_event_is_said_once(recorded, path, redone, said) -> None:
    assert neighbour_copy_event(7, recorded, path, redone) == said


def test_an_old_step_report_validates_and_a_new_one_round_trips() -> None:
    old = StepReport.model_validate_json('{"generation": 2, "start_step": 5, "first_step_time": 1}')
    assert (old.recovery, old.redone_steps) == (None, 0)
    old_hb = HeartbeatRequest.model_validate(
        {"reports": [{"generation": 2, "start_step": 5, "first_step_time": 1.0}]}
    )
    assert old_hb.reports[0].recovery is None
    new = StepReport(
        generation=2, start_step=5, first_step_time=1.0, recovery="neighbour_copy", redone_steps=3
    )
    assert new.recovery is RecoveryPath.NEIGHBOUR_COPY
    wire = json.loads(new.model_dump_json())
    assert (wire["recovery"], wire["redone_steps"]) == ("neighbour_copy", 3)
    assert StepReport.model_validate(wire) == new
    for bad in ({"recovery": "teleport"}, {"redone_steps": -1}):
        with pytest.raises(ValidationError):
            StepReport(generation=2, start_step=5, first_step_time=1.0, **bad)


def test_the_coordinator_records_the_worst_path_and_says_it_once(served_coordinator) -> None:
    from tidal.coordinator.records.records import WorkerRecord
    from tidal.protocol import WorkerState

    coord, _ = served_coordinator
    with coord.lock:
        for wid in range(3):
            coord.job.workers[wid] = WorkerRecord(
                id=wid, state=WorkerState.STANDBY, pid=1, host="h"
            )
        coord.generations.open([0, 1, 2], "three members")
        gen = coord.job.latest.id
    reports = [(R, 0), (C, 2), (C, 3), (None, 0)]  # the last: a worker of an older version
    for wid, (path, redone) in enumerate(reports):
        r = StepReport(
            generation=gen, start_step=10, first_step_time=1.0, recovery=path, redone_steps=redone
        )
        coord.on_heartbeat(wid % 3, HeartbeatRequest(step=10, generation=gen, reports=[r]))
    live = coord.status(fresh=True)
    g = live.generations[-1]
    assert (g.recovery, g.redone_steps) == (RecoveryPath.NEIGHBOUR_COPY, 3)
    said = [e.message for e in live.events if e.kind == "recovery"]
    assert said == [f"generation {gen}: rebuilt from neighbour copies, 2 steps redone"]
    # A restarted coordinator rebuilds them from the records, and its view says the same.
    recorded = coord.executor.db.load_status(coord.spec.name)
    assert recorded.generations[-1] == g
    again = rebuild(recorded, Control(requested=3), namespace="ns", now=1.0)
    assert again.generations[-1].view() == g


def old_home(path) -> None:
    """A ``tidal.db`` as the previous version wrote it: generations without the recovery
    columns (the other tables as they are now)."""
    schema = dbmod.SCHEMA.replace("    recovery TEXT, redone_steps INTEGER, ", "    ")
    assert "redone_steps" not in schema
    conn = sqlite3.connect(path)
    conn.executescript(schema)
    spec = {"min_workers": 1, "max_workers": 2, "script": "s.py"}
    conn.execute(
        "INSERT INTO jobs (name, state, spec, created, target_workers) VALUES (?, ?, ?, ?, ?)",
        ("old", "succeeded", json.dumps(spec), 1.0, 1),
    )
    conn.execute(
        "INSERT INTO generations (job, id, members, reason, opened_at, start_step, pause_s) "
        "VALUES ('old', 1, '[0]', 'start', 2.0, 0, 0.5)"
    )
    conn.commit()
    conn.close()


def test_a_home_written_before_the_columns_opens(tmp_path) -> None:
    path = tmp_path / "tidal.db"
    old_home(path)
    db = Database(path)  # migrated: the columns are added
    try:
        (g,) = db.load_status("old").generations
        assert (g.recovery, g.redone_steps, g.pause_s) == (None, None, 0.5)
        db.upsert_generation("old", g.model_copy(update={"recovery": K, "redone_steps": 4}))
        (g,) = db.load_status("old").generations
        assert (g.recovery, g.redone_steps) == (K, 4)
    finally:
        db.close()


def test_a_read_only_home_written_before_the_columns_is_read(tmp_path, monkeypatch) -> None:
    path = tmp_path / "tidal.db"
    old_home(path)

    def refused(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(Database, "_open", staticmethod(refused))  # opened with mode=ro
    db = Database(path, readonly=True)
    try:
        (g,) = db.load_status("old").generations
        assert (g.recovery, g.redone_steps, g.start_step) == (None, None, 0)
    finally:
        db.close()


@pytest.mark.parametrize(
    ("path", "redone", "cell"),
    [(None, None, ""), (N, 0, "none"), (R, 0, "reshard"), (C, 3, "neighbour_copy (-3)")],
)
def test_the_recovery_cell(path, redone, cell) -> None:
    assert recovery_cell(path, redone) == cell


def test_the_status_table_shows_the_recovery(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    gen = {"world_size": 2, "members": [0, 1], "reason": "r", "opened_at": 1.0, "pause_s": 0.1}
    s = JobStatus(
        name="j",
        state="running",
        step=20,
        world_size=2,
        target_workers=2,
        min_workers=1,
        max_workers=2,
        script="s.py",
        created=1.0,
        generations=[
            {**gen, "id": 1, "start_step": 0},
            {**gen, "id": 2, "start_step": 7, "recovery": "neighbour_copy", "redone_steps": 3},
        ],
    )
    print_status(s)
    out = capsys.readouterr().out
    assert "recovery" in out and "neighbour_copy (-3)" in out


GLOO_ERROR = (
    "worker 2 reported a failed collective at step 5: DistBackendError: "
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed"
)


def test_text_with_square_brackets_is_printed_as_text(capsys, monkeypatch) -> None:
    """A gloo error quoted in an event or a reason ("[/__w/.../pair.cc:553] ...") is not
    rich markup: printing it once crashed the coordinator (its progress display), six
    times in a row, and left the job without a coordinator."""
    from tidal.display import Progress
    from tidal.protocol import EventView

    monkeypatch.setenv("COLUMNS", "400")
    gen = {"world_size": 2, "members": [0, 1], "opened_at": 1.0, "pause_s": 0.1}
    s = JobStatus(
        name="j[/x]",
        state="running",
        step=20,
        world_size=2,
        target_workers=2,
        min_workers=1,
        max_workers=2,
        script="[/s].py",
        created=1.0,
        generations=[{**gen, "id": 1, "start_step": 0, "reason": GLOO_ERROR}],
        events=[EventView(time=1.0, kind="failure", message=GLOO_ERROR)],
    )
    print_status(s)
    out = capsys.readouterr().out
    assert out.count("[/__w/pytorch/pytorch/third_party/gloo") == 2, out

    import time

    progress = Progress(coord=None, enabled=True)
    progress._new_events = lambda: [EventView(time=1.0, kind="failure", message=GLOO_ERROR)]
    progress._last = time.monotonic() - 0.3  # events are due, the progress line is not
    progress.update()
    assert "[/__w/pytorch" in capsys.readouterr().out


def test_a_generation_that_forms_wakes_the_loop_and_is_flushed_at_once(
    served_coordinator,
) -> None:
    """The first report of a generation's first step forms it: the loop is woken (a joiner
    or start held back while it settled may go now) and its next pass flushes, whatever the
    time since the last flush, so readers see the new world size."""
    import time

    from tidal.coordinator.records.records import WorkerRecord
    from tidal.protocol import WorkerState

    coord, _ = served_coordinator
    with coord.lock:
        for wid in range(2):
            coord.job.workers[wid] = WorkerRecord(
                id=wid, state=WorkerState.STANDBY, pid=1, host="h"
            )
        coord.generations.open([0, 1], "two members")
        gen = coord.job.latest.id
        coord.flush()
    coord.wake.clear()
    assert coord.views.view.world_size == 0 and not coord.loop.flush_due()
    report = StepReport(generation=gen, start_step=0, first_step_time=1.0)
    coord.on_heartbeat(0, HeartbeatRequest(step=1, generation=gen, reports=[report]))
    assert coord.wake.is_set()
    coord.views.last_flush = time.monotonic()
    assert coord.loop.flush_due()
    coord.wake.clear()  # a second member's report of the same step wakes nothing
    coord.on_heartbeat(1, HeartbeatRequest(step=1, generation=gen, reports=[report]))
    assert not coord.wake.is_set()
