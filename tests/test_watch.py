"""The NCCL abort watch (``tidal.worker.membership.watch``): its rule as a table, and its executor
thread with a real clock (the abort it calls is the test's: NCCL needs a GPU)."""

from __future__ import annotations

import threading
import time

import pytest

from tidal.worker.membership.watch import GRACE_FLOOR_S, AbortWatch, Facts, abort_reason, grace_s


@pytest.mark.parametrize(
    ("open_s", "step_s", "dropped", "aborts"),
    [
        (None, 0.1, True, False),  # nothing waits: nothing to cut
        (0.5, 0.1, True, False),  # a member dropped, but within the grace (planned leave)
        (1.5, 0.1, True, True),  # ... and past it: the member is gone
        (1.5, 1.0, True, False),  # a long step's grace is 4 steps
        (4.5, 1.0, True, True),
        (1.5, None, True, True),  # no step time yet (a heal): the floor
        (50.0, 0.1, False, False),  # nobody dropped, within the collective timeout
        (60.0, 0.1, False, True),  # the collective timeout
    ],
)
def test_abort_rule(open_s, step_s, dropped, aborts):
    reason = abort_reason(Facts(open_s=open_s, step_s=step_s, dropped=dropped, timeout_s=60.0))
    assert (reason is not None) == aborts
    if aborts:
        assert ("dropped" in reason) == dropped and "waited" in reason


@pytest.mark.parametrize(
    ("open_s", "busy", "stopped", "dropped", "aborts"),
    [
        # a peer alive and busy in its script (an evaluation): wait past the timeout
        (60.0, True, False, False, False),
        (3600.0, True, False, False, False),
        (59.0, False, False, False, False),
        (60.0, False, False, False, True),  # no peer busy (hung, or its answer stale)
        # dropped (killed as hung, or dead) wins over a busy claim: cut after the grace
        (1.5, True, False, True, True),
        # the job is stopping (a member's script stopped it and left): cut after the grace
        (0.5, False, True, False, False),
        (1.5, False, True, False, True),
        (1.5, True, True, False, True),
    ],
)
def test_abort_rule_with_a_busy_peer(open_s, busy, stopped, dropped, aborts):
    facts = Facts(
        open_s=open_s, step_s=0.1, dropped=dropped, timeout_s=60.0, busy=busy, stopped=stopped
    )
    assert (abort_reason(facts) is not None) == aborts


def test_script_time_is_kept_between_windows():
    watch = AbortWatch(
        lambda s: Facts(open_s=s, step_s=None, dropped=False, timeout_s=60.0), lambda: None
    )
    try:
        assert watch.script_s() is None  # no window closed yet
        watch.open()
        assert watch.script_s() is None  # in a collective
        assert watch.close() is None
        time.sleep(0.05)
        assert watch.script_s() >= 0.05
        watch.open()
        assert watch.script_s() is None
    finally:
        watch.stop()


def test_grace():
    assert grace_s(None) == GRACE_FLOOR_S == grace_s(0.01)
    assert grace_s(2.0) == 8.0


class Recorder:
    def __init__(self) -> None:
        self.calls: list[float] = []
        self.dropped = False
        self.event = threading.Event()

    def facts(self, open_s):
        return Facts(open_s=open_s, step_s=None, dropped=self.dropped, timeout_s=60.0)

    def abort(self) -> None:
        self.calls.append(time.monotonic())
        self.event.set()


@pytest.mark.timeout(20)
def test_the_watch_aborts_an_open_window_once_and_close_reports_it():
    rec = Recorder()
    watch = AbortWatch(rec.facts, rec.abort)
    try:
        rec.dropped = True
        time.sleep(GRACE_FLOOR_S + 0.3)
        assert rec.calls == []  # no window open: a dropped member alone cuts nothing
        opened = time.monotonic()
        watch.open()
        assert rec.event.wait(5)
        waited = rec.calls[0] - opened
        assert GRACE_FLOOR_S <= waited < GRACE_FLOOR_S + 1.0
        time.sleep(0.3)
        assert len(rec.calls) == 1  # once per window
        reason = watch.close()
        assert reason is not None and "dropped" in reason
        assert watch.close() is None  # told once
        watch.open()
        rec.dropped = False
        time.sleep(GRACE_FLOOR_S + 0.3)
        assert watch.close() is None and len(rec.calls) == 1  # nobody dropped: no abort
    finally:
        watch.stop()
