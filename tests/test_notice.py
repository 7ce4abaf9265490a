"""The store's change counter (``protocol.notice_key``, ``worker.notice``): a real
coordinator (never ticking) and its real TCPStore; rank 0's ``Notices`` reads what a
worker would. A change members must act on at a step boundary moves the count once, after
the answer that tells it is published; a change they need not act on does not."""

from __future__ import annotations

import pytest

from tidal.coordinator.records import WorkerRecord
from tidal.protocol import WorkerConfig, WorkerState
from tidal.worker.notice import Notices


@pytest.fixture
def coord_and_notices(served_coordinator):
    coord, _ = served_coordinator
    with coord.lock:
        for wid in (0, 1):
            coord.job.workers[wid] = WorkerRecord(id=wid, state=WorkerState.STANDBY)
        coord._publish()
    cfg = WorkerConfig.from_spec(
        coord.spec,
        store_host=coord.host,
        store_port=coord.executor.store.port,
        store_namespace=coord.store_namespace,
    )
    notices = Notices()
    notices.follow(cfg)
    notices.mark()
    return coord, notices, cfg


def test_a_new_generation_and_a_stop_are_noticed_once_each(coord_and_notices):
    coord, notices, _ = coord_and_notices
    assert not notices.changed()
    with coord.lock:
        coord._open([0, 1], "test")
        coord._publish()
        # The answer is published before the count moves: a reader that sees the count
        # fetches an answer naming the new generation.
        assert coord.answers.generation is not None and coord.answers.generation.id == 1
    assert notices.changed()
    assert not notices.changed()  # once
    with coord.lock:
        coord.job.settled_step = 7  # told to holding members in the answer; no switch
        coord._publish()
    assert not notices.changed()
    coord.on_stop()
    with coord.lock:
        coord._publish()
    assert notices.changed()
    assert not notices.broken


def test_mark_before_a_fetch_hides_only_what_that_fetch_saw(coord_and_notices):
    coord, notices, _ = coord_and_notices
    with coord.lock:
        coord._open([0], "first")
        coord._publish()
    notices.mark()  # a worker marks, then fetches the answer naming generation 1
    assert not notices.changed()
    with coord.lock:
        coord._open([0, 1], "second")
        coord._publish()
    assert notices.changed()


def test_a_store_that_goes_away_stops_the_notices_until_a_new_one_is_followed(
    coord_and_notices,
):
    coord, notices, cfg = coord_and_notices
    dead = cfg.model_copy(update={"store_port": _closed_port()})
    notices.follow(dead)
    assert not notices.changed()
    assert notices.broken  # heartbeats tell meanwhile
    notices.follow(cfg)  # the next registration names a live store
    assert not notices.broken
    with coord.lock:
        coord._open([0, 1], "after")
        coord._publish()
    assert notices.changed()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
