"""How a re-forming member polls the store (``group.pauses``): its first polls come fast
(what it waits for arrives within milliseconds), then slow to the old fixed rate."""

from __future__ import annotations

import itertools

import pytest

from tidal.worker.membership import group as grp


def test_the_first_poll_is_fast_and_each_next_a_quarter_longer_up_to_the_cap() -> None:
    first = list(itertools.islice(grp.pauses(), 4))
    assert first == pytest.approx([1e-4, 1.25e-4, 1.5625e-4, 1.953125e-4])
    many = list(itertools.islice(grp.pauses(), 200))
    assert max(many) == grp.POLL_S and many[-1] == grp.POLL_S
    assert all(b >= a for a, b in itertools.pairwise(many))


@pytest.mark.parametrize(
    ("cap_s", "within_s", "polls_at_most"),
    [
        # a peer that arrives 2 ms after the wait began is seen within 0.6 ms, not 2 ms
        (grp.POLL_S, 0.002, 11),
        # the rendezvous polls at most every millisecond
        (0.001, 0.002, 13),
    ],
)
def test_a_wait_of_two_milliseconds_costs_few_polls(cap_s, within_s, polls_at_most) -> None:
    elapsed, polls = 0.0, 0
    for pause in grp.pauses(cap_s):
        if elapsed >= within_s:
            break
        elapsed += pause
        polls += 1
    assert polls <= polls_at_most
    assert pause <= 0.6 * within_s  # the poll after the arrival comes soon
    assert max(itertools.islice(grp.pauses(cap_s), 100)) == cap_s
