"""Where a new generation's sharded state comes from: a pure decision from what each member
holds (issue 16; ``sharding="fsdp"``).

Each member of a new generation says what it holds (``MemberFacts``): its *live* shards
(the rows of one layout, at its committed step) and its *neighbour copy* (a snapshot of its
own rows at a copy step, plus a copy of its ring neighbour's rows at the same step). From
everyone's facts, ``decide`` picks one way to assemble every row of the state at one step:

- ``FRESH``: nobody has trained and nothing was committed: the new rank 0's initial
  parameters are the state (a fresh job adopts rank 0's initialisation, as with DDP).
- ``LIVE``: the members at the highest step, all from its newest layout, hold every one of
  its ranks' rows between them: nothing is redone. A planned change first gathers the whole
  state onto every member (``sharded.gather_full``), so leavers take no rows with them.
- ``COPY``: the live rows do not cover the state (a member died with the only live copy of
  its shard), but the copies at one copy step do (each lost rank's own snapshot or its
  neighbour's copy survives): every member rolls back to that step; the steps after it are
  redone, the same steps, so the result is the same mathematics.
- ``LOST``: neither covers it (both holders of a shard died): the job must roll back to a
  durable checkpoint, or fail saying so. Training on from anything else would be a silent
  divergence.

A layout is named by the generation that made it, its world size and the member's rank in
it. Members that hold a layout's rows at the same step hold the same state (synchronous
training), so any holder of a rank's rows may serve them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class Path(enum.Enum):
    """How the state of a new generation is assembled (see the module contract)."""

    FRESH = "fresh"
    LIVE = "reshard"
    COPY = "neighbour_copy"
    LOST = "lost"


class Slot(enum.Enum):
    """Which of a member's holdings serves a rank's rows."""

    LIVE = "live"  # its live shards
    OWN = "own"  # its snapshot of its own rows at the copy step
    NEIGHBOUR = "neighbour"  # its copy of its ring neighbour's rows at the copy step


@dataclass(frozen=True, kw_only=True)
class Layout:
    gen: int  # the generation whose sharding this is (0: a worker's initial full tensors)
    world: int
    rank: int


@dataclass(frozen=True, kw_only=True)
class MemberFacts:
    """What one member holds. ``step`` is the committed step of its live rows, or None for a
    worker that never trained (its live rows are then its initial parameters, layout
    ``(0, 1, 0)``); ``copy`` names the layout of its snapshot taken at ``copy_step`` and
    ``neighbour`` the rank (in that layout) whose rows it keeps a copy of."""

    step: int | None
    live: Layout
    copy_step: int | None = None
    copy: Layout | None = None
    neighbour: int | None = None


@dataclass(frozen=True, kw_only=True)
class Source:
    member: int  # rank in the new generation
    slot: Slot


@dataclass(frozen=True, kw_only=True)
class Decision:
    path: Path
    step: int  # the step every member is at once the state is assembled
    world: int  # the world size of the layout the rows come from
    sources: tuple[Source, ...]  # per rank of that layout, who serves its rows
    replicated_from: Source  # who sends the replicated state (buffers, RNG, tracked, ...)
    reason: str

    def redone(self, step: int | None) -> int:
        """Steps a member at committed ``step`` redoes after this decision."""
        return max(0, (step or 0) - self.step)


def decide(facts: Sequence[MemberFacts], committed_step: int) -> Decision:
    """How the new generation assembles its state (module contract). ``committed_step`` is
    the highest step the coordinator knows a member committed (a lower bound)."""
    if not facts:
        raise ValueError("a generation has at least one member")
    trained = [i for i, f in enumerate(facts) if f.step is not None]
    if trained:
        best = max(facts[i].step for i in trained)
        at_best = [i for i in trained if facts[i].step == best]
        gen = max(facts[i].live.gen for i in at_best)
        holders = [i for i in at_best if facts[i].live.gen == gen]
        world = facts[holders[0]].live.world
        got = _cover(
            world, {facts[i].live.rank: Source(member=i, slot=Slot.LIVE) for i in reversed(holders)}
        )
        if got is not None:
            return Decision(
                path=Path.LIVE,
                step=best,
                world=world,
                sources=got,
                replicated_from=Source(member=holders[0], slot=Slot.LIVE),
                reason=f"live shards of generation {gen} at step {best}",
            )
        missing = f"no live member holds rank {_first_gap(world, facts, holders)} of {world}"
    elif committed_step == 0:
        return Decision(
            path=Path.FRESH,
            step=0,
            world=1,
            sources=(Source(member=0, slot=Slot.LIVE),),
            replicated_from=Source(member=0, slot=Slot.LIVE),
            reason="a fresh job: rank 0's initial parameters",
        )
    else:
        missing = "no member has trained"
    copy = _from_copies(facts)
    if copy is not None:
        return copy
    return Decision(
        path=Path.LOST,
        step=0,
        world=0,
        sources=(),
        replicated_from=Source(member=0, slot=Slot.LIVE),
        reason=f"{missing}, and no copy step has every shard (both holders of a shard lost)",
    )


def _cover(world: int, by_rank: dict[int, Source]) -> tuple[Source, ...] | None:
    if all(r in by_rank for r in range(world)):
        return tuple(by_rank[r] for r in range(world))
    return None


def _first_gap(world: int, facts: Sequence[MemberFacts], holders: list[int]) -> int:
    have = {facts[i].live.rank for i in holders}
    return min(r for r in range(world) if r not in have)


def _from_copies(facts: Sequence[MemberFacts]) -> Decision | None:
    """The newest copy step (and layout) whose snapshots and neighbour copies cover every
    rank, preferring a rank's own snapshot to a neighbour's copy."""
    keys = {(f.copy_step, f.copy.gen) for f in facts if f.copy_step is not None and f.copy}
    for copy_step, gen in sorted(keys, reverse=True):
        with_key = [
            i
            for i, f in enumerate(facts)
            if f.copy_step == copy_step and f.copy and f.copy.gen == gen
        ]
        world = facts[with_key[0]].copy.world
        by_rank: dict[int, Source] = {}
        for i in reversed(with_key):  # the lowest member wins
            if facts[i].neighbour is not None and facts[i].neighbour not in by_rank:
                by_rank[facts[i].neighbour] = Source(member=i, slot=Slot.NEIGHBOUR)
        for i in reversed(with_key):
            by_rank[facts[i].copy.rank] = Source(member=i, slot=Slot.OWN)
        got = _cover(world, by_rank)
        if got is not None:
            owners = [s.member for s in got if s.slot == Slot.OWN]
            return Decision(
                path=Path.COPY,
                step=copy_step,
                world=world,
                sources=got,
                replicated_from=Source(member=min(owners), slot=Slot.OWN),
                reason=f"neighbour copies of generation {gen} at step {copy_step}",
            )
    return None


# -- the facts on the wire: one int64 row per member, all-gathered -------------------------
FIELDS = 10
_NONE = -1  # on the wire only: the decoded facts use None


def encode(f: MemberFacts) -> torch.Tensor:
    c = f.copy
    row = [
        f.step,
        f.live.gen,
        f.live.world,
        f.live.rank,
        f.copy_step,
        c.gen if c else None,
        c.world if c else None,
        c.rank if c else None,
        f.neighbour,
        1,  # a member that sent nothing (an all-zero row) is never mistaken for one
    ]
    return torch.tensor([_NONE if v is None else v for v in row], dtype=torch.int64)


def decode(row: torch.Tensor) -> MemberFacts:
    v = [int(x) for x in row.tolist()]
    if len(v) != FIELDS or v[9] != 1:
        raise ValueError(f"not a member's facts: {v}")
    opt = [None if x == _NONE else x for x in v]
    copy = Layout(gen=v[5], world=v[6], rank=v[7]) if opt[4] is not None else None
    return MemberFacts(
        step=opt[0],
        live=Layout(gen=v[1], world=v[2], rank=v[3]),
        copy_step=opt[4],
        copy=copy,
        neighbour=opt[8],
    )
