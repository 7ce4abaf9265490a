"""Table tests of who counts as busy in the script (``tidal.coordinator.rules.busy``) and of a
peer's reading of it (``tidal.worker.membership.busy``)."""

from __future__ import annotations

import pytest

from tidal.coordinator.rules.busy import BUSY_AFTER_S, BusyFacts, busy_members
from tidal.worker.membership.busy import FRESH_BEATS, peers_busy, script_s


def _w(wid, gen=3, script=5.0, silent=0.5):
    return BusyFacts(worker_id=wid, generation=gen, script_s=script, silent_s=silent)


@pytest.mark.parametrize(
    "workers, busy",
    [
        ([_w(0), _w(1, script=None)], {0}),  # 1 is in a collective
        ([_w(0, script=BUSY_AFTER_S / 2)], set()),  # a forward and backward, not an evaluation
        ([_w(0, script=BUSY_AFTER_S)], {0}),
        ([_w(0, silent=10.5)], set()),  # silent past the heartbeat timeout (SIGSTOP, lost)
        ([_w(0, silent=None)], set()),
        ([_w(0, gen=2)], set()),  # busy in an older generation
        ([_w(0), _w(1)], {0, 1}),
    ],
)
def test_busy_members(workers, busy):
    assert busy_members(workers, generation=3, heartbeat_timeout_s=10.0) == busy


def test_nobody_is_busy_before_a_generation_formed():
    assert busy_members([_w(0)], generation=None, heartbeat_timeout_s=10.0) == frozenset()


@pytest.mark.parametrize(
    "busy, me, age, result",
    [
        ([0], 1, 0.5, True),  # my peer is busy
        ([1], 1, 0.5, False),  # only I am (a stale claim of my own)
        ([7], 1, 0.5, False),  # not of my generation
        ([0], 1, FRESH_BEATS * 1.0 + 0.1, False),  # the answer is too old to trust
        ([], 1, 0.0, False),
    ],
)
def test_peers_busy(busy, me, age, result):
    got = peers_busy(busy=busy, members=[0, 1], me=me, answer_age_s=age, interval_s=1.0)
    assert got is result


def test_script_time_is_said_only_in_a_group():
    assert script_s(3.0, in_group=True) == 3.0
    assert script_s(3.0, in_group=False) is None
    assert script_s(None, in_group=True) is None
