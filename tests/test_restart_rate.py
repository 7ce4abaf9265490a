"""A rate of ``--max-restarts`` in a real coordinator (a real ``TCPStore``, real SQLite, no
worker processes: the test plays their exits): losses inside the window stop replacements,
their times survive the coordinator's restart record, and a loss an hour later is replaced
again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tidal.backends import Exit
from tidal.backends.local import LocalBackend
from tidal.config import JobSpec
from tidal.coordinator.control.controller import Coordinator
from tidal.coordinator.records.records import WorkerRecord
from tidal.coordinator.recovery import Control
from tidal.protocol import WorkerState


@pytest.fixture
def coord(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def no_start(*_args, **_kwargs):
        raise AssertionError("the test's coordinator must not start a worker process")

    monkeypatch.setattr(LocalBackend, "start", no_start)
    spec = JobSpec(
        name="rate", script=str(tmp_path / "x.py"), workers=4, max_workers=6, max_restarts="2/h"
    )
    c = Coordinator(spec, tmp_path / "home")
    with c.lock:
        for wid in range(6):
            c.job.workers[wid] = WorkerRecord(
                id=wid, state=WorkerState.STANDBY, pid=1, host="h", last_heartbeat=time.time()
            )
        c.generations.open([0, 1, 2, 3], "four members")
    try:
        yield c
    finally:
        c.close()


def lose(c: Coordinator, wid: int, at: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: at)
    with c.lock:
        c.lifecycle.on_exit(Exit(worker_id=wid, returncode=-9))
        c.ledger.save_control()


def test_losses_past_the_rate_stop_replacements_until_the_window_passes(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    t0 = 1_000_000.0
    lose(coord, 0, t0, monkeypatch)
    lose(coord, 1, t0 + 60, monkeypatch)
    assert coord.job.target == 4  # two within 2/h: both replaced
    saved = Control.from_dict(coord.executor.saved_control())
    assert saved.loss_times == [t0, t0 + 60] and saved.failures == 2

    lose(coord, 2, t0 + 120, monkeypatch)  # a third within the hour: past the rate
    assert coord.job.target == 3, coord.job.target  # the three live workers left (3, 4, 5)
    said = [e.message for e in coord.executor.status().events]
    assert any("losses past --max-restarts 2/h" in m for m in said), said[-5:]
    saved = Control.from_dict(coord.executor.saved_control())
    assert saved.loss_times == [t0 + 60, t0 + 120]  # what a rate of 2 needs, no more

    target = coord.job.target
    lose(coord, 3, t0 + 3700, monkeypatch)  # an hour after the first two: within again
    assert coord.job.target == target
    assert coord.job.loss_times == [t0 + 120, t0 + 3700]
