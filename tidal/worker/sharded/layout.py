"""Where the rows of a dim-0-sharded tensor live at a world size, and what a resize moves.

FSDP2 (``fully_shard``) shards every parameter, and the optimizer state with it, on dim 0
(``Shard(0)``) with ``torch.chunk``'s layout: chunks of ``ceil(rows / world)`` rows, the
last ones shorter or empty (5 rows on 4 ranks: 2, 2, 1, 0; checked against
``fully_shard`` on gloo). Resharding in process (issue 16) moves, over the new generation's
group, exactly the rows each new rank lacks, from whichever member of the new group held
them in the old layout; a joiner receives only its shard. These are the pure rules for
that: the layout (``shard_range``) and the transfer plan (``plan``), pure; and ``reshard``,
which carries a plan out for one tensor over a process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


def shard_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` that ``rank`` of ``world`` holds (``torch.chunk``)."""
    if world < 1 or not 0 <= rank < world or rows < 0:
        raise ValueError(f"no shard {rank} of {world} for {rows} rows")
    size = -(-rows // world)  # ceil: torch.chunk's chunk size
    start = min(rows, rank * size)
    return start, min(rows, start + size)


def check_shardable(shapes: dict[str, tuple[int, ...]], max_world: int) -> None:
    """Refuse, in one line that says what to change, a model that sharding cannot serve at
    up to ``max_world`` members (``shapes``: each parameter's shape, by name). Sharding splits
    dim 0, so a scalar parameter has nothing to split (FSDP2 refuses it too, later and
    deeper); and past the largest parameter's dim 0 every parameter leaves some member an
    empty shard: the extra members would hold nothing, and save nothing, of any of them."""
    if not shapes:
        raise ValueError("the model has no parameters to shard")
    scalars = [name for name, shape in shapes.items() if len(shape) == 0]
    if scalars:
        raise ValueError(
            f"parameter {scalars[0]!r} is a scalar: sharding splits the first dimension; "
            "make it a 1-element tensor (torch.nn.Parameter(torch.tensor([x])))"
        )
    name, shape = max(shapes.items(), key=lambda kv: kv[1][0])
    if max_world > shape[0]:
        raise ValueError(
            f"{max_world} workers is more than the largest first dimension of any "
            f"parameter ({shape[0]}, {name!r}): with sharding, workers past {shape[0]} would "
            f"hold nothing; use --max-workers {shape[0]} or fewer, or sharding='ddp'"
        )


@dataclass(frozen=True)
class Move:
    """Rows ``[start, stop)`` (global indices) of old rank ``old``'s shard go from new rank
    ``src``, which holds that shard, to new rank ``dst``, which holds them in the new layout
    (``src == dst``: a local copy)."""

    src: int
    dst: int
    start: int
    stop: int
    old: int


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
                moves.append(Move(src=src, dst=dst, start=start, stop=stop, old=old))
    if lost:
        raise ShardsLost(sorted(lost))
    return moves


def reshard(
    like: torch.Tensor,
    held: dict[int, torch.Tensor],
    *,
    rows: int,
    old_world: int,
    new_world: int,
    holders: Sequence[int | None],
    rank: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This member's shard of the tensor at ``new_world``, made over ``group`` (where it is
    ``rank``) from the old shards the members hold: ``held`` maps an old rank to its shard
    (its rows of the old layout), for the old ranks whose ``holders`` entry is this member.
    ``like`` gives the row shape and dtype (a joiner, which holds nothing, knows them from
    its own model). Every member calls it with the same ``rows``, worlds and ``holders``;
    each receives only the rows it lacks, point to point, each move tagged by its place in
    the plan (which every member computes alike)."""
    moves = plan(rows, old_world, new_world, holders)
    start, stop = shard_range(rows, new_world, rank)
    out = torch.empty(stop - start, *like.shape[1:], dtype=like.dtype)
    pending = []
    for tag, m in enumerate(moves):
        if rank not in (m.src, m.dst):
            continue
        if m.src == rank:
            old_start = shard_range(rows, old_world, m.old)[0]
            part = held[m.old][m.start - old_start : m.stop - old_start]
            if m.dst == rank:
                out[m.start - start : m.stop - start] = part
            else:
                pending.append(dist.isend(part.contiguous(), m.dst, group=group, tag=tag))
        else:  # rows are dim 0, so this view of ``out`` is contiguous
            view = out[m.start - start : m.stop - start]
            pending.append(dist.irecv(view, m.src, group=group, tag=tag))
    for work in pending:
        work.wait()
    return out


def from_whole(
    whole: torch.Tensor | None,
    like: torch.Tensor,
    *,
    rows: int,
    new_world: int,
    rank: int,
    src: int,
    local: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This member's shard at ``new_world`` of a tensor some members hold whole: the
    members in ``local`` (``whole`` is theirs) cut their rows from it; ``src`` (one of
    them) sends every other member its rows, point to point. Every member calls it with
    the same ``src`` and ``local``."""
    start, stop = shard_range(rows, new_world, rank)
    if rank in local:
        assert whole is not None
        out = whole[start:stop].clone()
        if rank == src:
            works = []
            for dst in range(new_world):
                a, b = shard_range(rows, new_world, dst)
                if dst not in local and b > a:
                    works.append(dist.isend(whole[a:b].contiguous(), dst, group=group))
            for w in works:
                w.wait()
        return out
    out = torch.empty(stop - start, *like.shape[1:], dtype=like.dtype)
    if stop > start:
        dist.irecv(out, src, group=group).wait()
    return out
