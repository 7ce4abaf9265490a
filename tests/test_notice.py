"""The store's change counter (``store_keys.notice_key``, ``worker.notice``): a real
coordinator (never ticking) and its real TCPStore; rank 0's ``Notices`` and its waiting
thread see what a worker would. A change members must act on at a step boundary moves the
count once, after the answer that tells it is published; a change they need not act on
does not. The thread learns of a change asynchronously, so a True is awaited (``_seen``)
and a False is checked after the thread had time to wake (``_quiet``)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tidal.coordinator.records.records import WorkerRecord
from tidal.protocol import WorkerConfig, WorkerState
from tidal.store_auth import derive_key
from tidal.worker.membership.notice import Notices

#: Long enough for the thread to wake on a key the coordinator set (it wakes in well under
#: a millisecond on an idle machine): a False checked after it means nothing woke it.
SETTLE_S = 0.3


def _seen(notices: Notices, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if notices.changed():
            return True
        time.sleep(0.002)
    return False


def _quiet(notices: Notices) -> bool:
    time.sleep(SETTLE_S)
    return not notices.changed()


@pytest.fixture
def coord_and_notices(served_coordinator):
    coord, _ = served_coordinator
    with coord.lock:
        for wid in (0, 1):
            coord.job.workers[wid] = WorkerRecord(id=wid, state=WorkerState.STANDBY)
        coord.publisher.publish()
    cfg = WorkerConfig.from_spec(
        coord.spec,
        store_host=coord.host,
        store_port=coord.executor.store.port,
        store_namespace=coord.store_namespace,
        store_key=coord.store_key,
    )
    notices = Notices()
    notices.follow(cfg)
    notices.mark()
    notices.changed()  # starts the thread, as rank 0's first step does
    yield coord, notices, cfg
    notices.close()


def test_a_new_generation_and_a_stop_are_noticed_once_each(coord_and_notices):
    coord, notices, _ = coord_and_notices
    assert _quiet(notices)
    with coord.lock:
        coord.generations.open([0, 1], "test")
        coord.publisher.publish()
        # The answer is published before the count moves: a reader that sees the count
        # fetches an answer naming the new generation.
        assert (
            coord.publisher.answers.generation is not None
            and coord.publisher.answers.generation.id == 1
        )
    assert _seen(notices)
    assert _quiet(notices)  # once
    with coord.lock:
        coord.job.settled_step = 7  # told to holding members in the answer; no switch
        coord.publisher.publish()
    assert _quiet(notices)
    coord.on_stop()
    with coord.lock:
        coord.publisher.publish()
    assert _seen(notices)
    assert not notices.broken


def test_mark_before_a_fetch_hides_only_what_that_fetch_saw(coord_and_notices):
    coord, notices, _ = coord_and_notices
    with coord.lock:
        coord.generations.open([0], "first")
        coord.publisher.publish()
    time.sleep(SETTLE_S)  # the thread saw generation 1's count before the mark
    notices.mark()  # a worker marks, then fetches the answer naming generation 1
    assert _quiet(notices)
    with coord.lock:
        coord.generations.open([0, 1], "second")
        coord.publisher.publish()
    assert _seen(notices)


def test_a_store_that_goes_away_stops_the_notices_until_a_new_one_is_followed(
    coord_and_notices,
):
    coord, notices, cfg = coord_and_notices
    dead = cfg.model_copy(update={"store_port": _closed_port()})
    notices.follow(dead)
    notices.mark()
    assert notices.broken  # heartbeats tell meanwhile
    assert not notices.changed()
    notices.follow(cfg)  # the next registration names a live store
    assert not notices.broken
    notices.mark()
    notices.changed()
    with coord.lock:
        coord.generations.open([0, 1], "after")
        coord.publisher.publish()
    assert _seen(notices)


def test_a_standby_waits_for_its_admission_without_polling(coord_and_notices):
    """``wait`` (a standby between fetches) blocks until a change is published, woken by
    the thread (not a poll): it returns within milliseconds of the new generation, and
    after its timeout when nothing moved; with no counter to follow it says so at once."""
    import threading

    coord, notices, cfg = coord_and_notices
    notices.mark()
    t0 = time.monotonic()
    assert notices.wait(0.3)  # nothing published: the whole timeout
    assert time.monotonic() - t0 >= 0.29

    def admit() -> None:
        time.sleep(0.2)
        with coord.lock:
            coord.generations.open([0, 1], "admitted")
            coord.publisher.publish()

    opener = threading.Thread(target=admit)
    t0 = time.monotonic()
    opener.start()
    assert notices.wait(30)
    waited = time.monotonic() - t0
    opener.join()
    assert 0.19 <= waited < 10  # woken by the change, long before its timeout
    assert notices.changed()  # and ``wait`` did not consume it
    nowhere = Notices()
    assert not nowhere.wait(5)  # never followed a store: the caller polls
    notices.follow(cfg.model_copy(update={"store_port": _closed_port()}))
    notices.mark()
    assert not notices.wait(5)  # the store is gone: the caller polls


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_thread_learns_of_a_store_that_went_away():
    """The coordinator died: the thread's connection closes, ``changed`` says broken."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = _config(server.port)
    notices = Notices()
    notices.follow(cfg)
    notices.mark()
    notices.changed()
    time.sleep(SETTLE_S)
    assert not notices.changed() and not notices.broken
    del server  # the store's server stops, its connections close
    deadline = time.monotonic() + 10
    while not notices.broken and time.monotonic() < deadline:
        notices.changed()
        time.sleep(0.01)
    assert notices.broken


EXITS = """
import sys, time
from tidal.protocol import WorkerConfig
from tidal.worker.membership.notice import Notices
n = Notices()
n.follow(WorkerConfig.model_validate_json(sys.argv[1]))
n.mark()
n.changed()
time.sleep(0.05)
thread = n._waiter._thread
assert thread.is_alive()
if sys.argv[2] == "close":
    n.close()
    assert not thread.is_alive()
"""


@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_process_whose_thread_waits_in_the_store_exits_cleanly(how):
    """The thread blocks in C++; one whose ``wait`` returns while the interpreter finalises
    aborts the process ("terminate called without an active exception", exit -6). So
    ``close``, and the exit hook when nobody called it, wake and join it first: the count
    moves once per exit (the wake), and every exit is clean."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = _config(server.port)
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", EXITS, cfg.model_dump_json(), how],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "terminate called" not in done.stderr
    # each exit moved the count once (its wake), and left nothing waiting
    assert server.add("tidal-test/notice", 0) == 3


def _config(port: int) -> WorkerConfig:
    from tidal.config import JobSpec

    spec = JobSpec(name="notice-test", script="train.py", workers=1)
    return WorkerConfig.from_spec(
        spec,
        store_host="127.0.0.1",
        store_port=port,
        store_namespace="tidal-test",
        store_key=derive_key("notice-test"),
    )
