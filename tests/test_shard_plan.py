"""``shard_plan.decide``: where a new sharded generation's state comes from, as a table
(no processes), and the facts' wire encoding."""

from __future__ import annotations

import pytest

from tidal.worker.sharded.plan import (
    Layout,
    MemberFacts,
    Path,
    Slot,
    Source,
    decide,
    decode,
    encode,
)

FRESH_LAYOUT = Layout(gen=0, world=1, rank=0)


def live(step, gen, world, rank, copy=None):
    """Facts of a member at ``step`` holding rank ``rank`` of generation ``gen``'s layout;
    ``copy``: (copy_step, gen, world, rank, neighbour)."""
    c = {}
    if copy is not None:
        cs, cg, cw, cr, nb = copy
        c = dict(copy_step=cs, copy=Layout(gen=cg, world=cw, rank=cr), neighbour=nb)
    return MemberFacts(step=step, live=Layout(gen=gen, world=world, rank=rank), **c)


def joiner():
    return MemberFacts(step=None, live=FRESH_LAYOUT)


LIVE, OWN, NB = Slot.LIVE, Slot.OWN, Slot.NEIGHBOUR


def srcs(*pairs):
    return tuple(Source(member=m, slot=s) for m, s in pairs)


CASES = [
    # (what happened, facts, committed step, path, step, world, sources)
    (
        "a fresh job: rank 0's initial parameters",
        [joiner(), joiner()],
        0,
        Path.FRESH,
        0,
        1,
        srcs((0, LIVE)),
    ),
    (
        "scale-up: the old members hold both ranks; the joiner nothing",
        [live(15, 1, 2, 0), live(15, 1, 2, 1), joiner()],
        15,
        Path.LIVE,
        15,
        2,
        srcs((0, LIVE), (1, LIVE)),
    ),
    (
        "members in a new order: each old rank from whoever held it",
        [live(15, 1, 2, 1), joiner(), live(15, 1, 2, 0)],
        15,
        Path.LIVE,
        15,
        2,
        srcs((2, LIVE), (0, LIVE)),
    ),
    (
        "a planned shrink: the whole state was gathered onto every member (world 1)",
        [live(30, 2, 1, 0)],
        30,
        Path.LIVE,
        30,
        1,
        srcs((0, LIVE)),
    ),
    (
        "after the gather any holder serves, the lowest first",
        [live(30, 2, 1, 0), live(30, 2, 1, 0)],
        30,
        Path.LIVE,
        30,
        1,
        srcs((0, LIVE)),
    ),
    (
        "a kill lost rank 0's live rows: its successor's copy and the survivor's snapshot",
        [live(47, 4, 2, 1, copy=(40, 4, 2, 1, 0))],
        47,
        Path.COPY,
        40,
        2,
        srcs((0, NB), (0, OWN)),
    ),
    (
        "a peer died inside the all-reduce: one survivor committed past the other",
        [live(48, 4, 3, 0, copy=(40, 4, 3, 0, 2)), live(47, 4, 3, 1, copy=(40, 4, 3, 1, 0))],
        48,
        Path.COPY,
        40,
        3,
        srcs((0, OWN), (1, OWN), (0, NB)),
    ),
    (
        "a laggard at the best step but in an older layout is not mixed in",
        [live(20, 3, 2, 0), live(20, 2, 3, 1)],
        20,
        Path.LOST,
        0,
        0,
        (),
    ),
    (
        "both holders of rank 1 lost (its own member and its successor)",
        [live(47, 4, 3, 0, copy=(40, 4, 3, 0, 2))],
        47,
        Path.LOST,
        0,
        0,
        (),
    ),
    (
        "nobody trained but the job had committed steps: never a silent restart",
        [joiner(), joiner()],
        12,
        Path.LOST,
        0,
        0,
        (),
    ),
    (
        "the newest copy step that covers wins over an older one",
        [live(55, 5, 2, 0, copy=(50, 5, 2, 0, 1)), live(55, 5, 2, 1, copy=(50, 5, 2, 1, 0))],
        55,
        Path.LIVE,
        55,
        2,
        srcs((0, LIVE), (1, LIVE)),
    ),
    (
        "copies of different steps: only a step whose copies cover is used",
        [live(33, 6, 2, 1, copy=(30, 6, 2, 1, 0)), live(21, 5, 1, 0, copy=(20, 5, 1, 0, None))],
        33,
        Path.COPY,
        30,
        2,
        srcs((0, NB), (0, OWN)),
    ),
]


@pytest.mark.parametrize(
    "facts, committed, path, step, world, sources",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_decide(facts, committed, path, step, world, sources) -> None:
    d = decide(facts, committed)
    assert d.path == path, d.reason
    if path != Path.LOST:
        assert (d.step, d.world, d.sources) == (step, world, sources), d
        assert d.replicated_from.member in {s.member for s in d.sources}
    else:
        assert "both holders" in d.reason or "no copy step" in d.reason


def test_a_copy_rollback_counts_the_steps_each_member_redoes() -> None:
    d = decide(
        [live(48, 4, 3, 0, copy=(40, 4, 3, 0, 2)), live(47, 4, 3, 1, copy=(40, 4, 3, 1, 0))], 48
    )
    assert (d.redone(48), d.redone(47), d.redone(None)) == (8, 7, 0)


def test_the_roll_back_sends_the_replicated_state_of_the_copy_step() -> None:
    """The replicated state (RNG, scheduler, optimizer scalars) must be the copy step's, so
    it comes from a member's own snapshot, never from its live (later) state."""
    d = decide([live(47, 4, 2, 1, copy=(40, 4, 2, 1, 0))], 47)
    assert d.replicated_from == Source(member=0, slot=Slot.OWN)


@pytest.mark.parametrize("facts", [joiner(), *(f for c in CASES for f in c[1])])
def test_facts_survive_the_wire(facts) -> None:
    assert decode(encode(facts)) == facts


def test_a_row_nobody_wrote_is_refused() -> None:
    import torch

    with pytest.raises(ValueError, match="not a member's facts"):
        decode(torch.zeros(10, dtype=torch.int64))
