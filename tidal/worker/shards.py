"""Where the rows of a dim-0-sharded tensor live at a world size, and what a resize moves.

FSDP2 (``fully_shard``) shards every parameter, and the optimizer state with it, on dim 0
(``Shard(0)``) with ``torch.chunk``'s layout: chunks of ``ceil(rows / world)`` rows, the
last ones shorter or empty (5 rows on 4 ranks: 2, 2, 1, 0; checked against
``fully_shard`` on gloo). Resharding in process (issue 16) moves, over the new generation's
group, exactly the rows each new rank lacks, from whichever member of the new group held
them in the old layout; a joiner receives only its shard. These are the pure rules for
that: the layout (``shard_range``) and the transfer plan (``plan``). They move nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def shard_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` that ``rank`` of ``world`` holds (``torch.chunk``)."""
    if world < 1 or not 0 <= rank < world or rows < 0:
        raise ValueError(f"no shard {rank} of {world} for {rows} rows")
    size = -(-rows // world)  # ceil: torch.chunk's chunk size
    start = min(rows, rank * size)
    return start, min(rows, start + size)


@dataclass(frozen=True)
class Move:
    """Rows ``[start, stop)`` (global indices) go from new rank ``src``, which held them in
    the old layout, to new rank ``dst``, which holds them in the new one (``src == dst``: a
    local copy)."""

    src: int
    dst: int
    start: int
    stop: int


class ShardsLost(RuntimeError):
    """Rows that no member of the new group held: they must come from a copy (a
    neighbour's, or a checkpoint)."""

    def __init__(self, rows: list[tuple[int, int]]) -> None:
        super().__init__(f"no member holds rows {rows}")
        self.rows = rows


def plan(rows: int, old_world: int, new_world: int, holders: Sequence[int | None]) -> list[Move]:
    """The moves that take a tensor of ``rows`` rows from the layout at ``old_world`` to the
    layout at ``new_world``. ``holders[i]`` is the new rank of the member that held old
    rank ``i``'s shard, or None if it is gone. Raises ``ShardsLost`` naming the rows nobody
    holds. Moves are ordered by destination, then by row."""
    if len(holders) != old_world:
        raise ValueError(f"{len(holders)} holders for {old_world} old ranks")
    moves: list[Move] = []
    lost: list[tuple[int, int]] = []
    for dst in range(new_world):
        want = shard_range(rows, new_world, dst)
        for old, src in enumerate(holders):
            have = shard_range(rows, old_world, old)
            start, stop = max(want[0], have[0]), min(want[1], have[1])
            if start >= stop:
                continue
            if src is None:
                lost.append((start, stop))
            else:
                moves.append(Move(src=src, dst=dst, start=start, stop=stop))
    if lost:
        raise ShardsLost(sorted(lost))
    return moves
