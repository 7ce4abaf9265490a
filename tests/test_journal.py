"""The live job's status is built from memory (``journal.Journal``), and reads the same as
its SQLite records after the same writes (issue 15: SQLite is a sink; reads are served from
memory). A real coordinator (``served_coordinator``: it never ticks) and a second connection
to its database, as ``tidal status`` of a job no coordinator serves reads it."""

from __future__ import annotations

from tidal.coordinator.records.db import Database
from tidal.coordinator.records.records import WorkerRecord
from tidal.protocol import (
    CheckpointFailure,
    CheckpointView,
    RecoveryPath,
    StepReport,
    WorkerState,
)


def from_sqlite(coord) -> dict:
    db = Database(coord.executor.db.path, readonly=True)
    try:
        return db.load_status(coord.spec.name).model_dump(exclude={"coordinator_pid"})
    finally:
        db.close()


def from_memory(coord) -> dict:
    return coord.status(fresh=True).model_dump(exclude={"coordinator_pid"})


def test_the_live_status_reads_the_same_as_the_records(served_coordinator, tmp_path):
    coord, _ = served_coordinator
    assert from_memory(coord) == from_sqlite(coord)  # just created
    kept = tmp_path / "step-10"
    kept.mkdir()
    with coord.lock:
        for wid, state in enumerate([WorkerState.STANDBY] * 3 + [WorkerState.PENDING]):
            coord.job.workers[wid] = WorkerRecord(id=wid, state=state, pid=100 + wid, host="h")
        coord.generations.open(
            [0, 1], "two members"
        )  # a generation, its event, worker rows, target
        coord.job.workers[2].last_heartbeat = 12.5
        for path, redone in [(RecoveryPath.RESHARD, 0), (RecoveryPath.NEIGHBOUR_COPY, 2)]:
            coord.effects.on_step_report(
                StepReport(
                    generation=coord.job.latest.id,
                    start_step=8,
                    first_step_time=1.0,
                    recovery=path,
                    redone_steps=redone,
                )
            )
        coord.job.step = 10
        coord.job.metrics.update(loss=0.25, samples_per_s=float("nan"))
        coord.effects.on_checkpoint(CheckpointView(step=10, path=str(kept), bytes=5))
        coord.effects.on_checkpoint(CheckpointView(step=20, path=str(tmp_path / "pruned"), bytes=5))
        coord.effects.on_checkpoint_failure(CheckpointFailure(step=30, error="disk full"))
        coord.job.target = 3
    live, recorded = from_memory(coord), from_sqlite(coord)
    assert live == recorded or _nan_equal(live, recorded)
    assert [g["members"] for g in live["generations"]] == [[0, 1]]
    (gen,) = live["generations"]  # the worst path its members took, the most steps redone
    assert (gen["recovery"], gen["redone_steps"], gen["start_step"]) == ("neighbour_copy", 2, 8)
    assert any(e["kind"] == "recovery" for e in live["events"])
    assert [c["step"] for c in live["checkpoints"]] == [10]  # the pruned one dropped
    assert (live["checkpoint_failures"], live["last_checkpoint_error"]) == (1, "disk full")
    assert (live["pending_workers"], live["standby_workers"], live["target_workers"]) == (1, 1, 3)
    assert {w["id"]: w["state"] for w in live["workers"]}[0] == WorkerState.RUNNING
    assert any("two members" in e["message"] for e in live["events"])


def test_a_status_read_does_not_read_sqlite(served_coordinator):
    coord, _ = served_coordinator

    def refuse(name):
        raise AssertionError("the live status read SQLite")

    coord.executor.db.load_records = coord.executor.db.load_status = refuse
    with coord.lock:
        coord.job.step = 7
    assert coord.status(fresh=True).step == 7


def _nan_equal(a, b) -> bool:
    """Equal, NaN equal to NaN (a metric may be NaN: ``wire_float``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_nan_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_nan_equal, a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b
