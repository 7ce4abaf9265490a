"""Neighbour copies: each member keeps its ring neighbour's shard in memory (issue 16).

With sharding, a member's death destroys the only live copy of its rows. So every
``every`` committed steps, and at the start of every generation, each member of a
generation snapshots its own rows with the replicated state (``own``, ``blob``) and sends
its rows to rank ``r + 1`` while it receives rank ``r - 1``'s (``theirs``). A lost member's
rows then survive in its successor's memory, and every survivor can roll back to the copy
step from its own snapshot (``shard_plan.decide``: path ``COPY``): at most ``every`` steps
are redone. When both holders of a shard are lost, only a durable checkpoint has it.

The copy is taken between steps, over the generation's group, by every member at the same
step (a pure function of the step count and of the generation's start), so all members
take part in the same exchange. Memory: two more shards per member (its own snapshot and
its neighbour's), and during an exchange the previous pair too: a new copy replaces the old
one only once it is whole (buffers are never overwritten in place, so a failure half-way
leaves the old copy intact, never a torn one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tidal.tracked import TrackedState
from tidal.worker.shard_plan import Layout
from tidal.worker.sharded import Key, ShardedModel
from tidal.worker.shards import shard_range

#: Steps between two neighbour copies: the steps a failure redoes at most.
DEFAULT_EVERY = 10


@dataclass(kw_only=True)
class Copies:
    step: int
    layout: Layout  # of ``own``; ``theirs`` is rank ``neighbour`` of the same layout
    own: dict[Key, torch.Tensor]
    blob: bytes  # the replicated state at ``step`` (``ShardedModel.replicated_blob``)
    neighbour: int | None
    theirs: dict[Key, torch.Tensor]


class Ring:
    def __init__(self, every: int = DEFAULT_EVERY) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"the neighbour copy interval must be a positive int, got {every!r}")
        self.every = every
        self.copies: Copies | None = None
        self.seconds = 0.0  # the last refresh's duration

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def refresh(self, sm: ShardedModel, step: int, tracked: TrackedState | None) -> None:
        """Take this member's part of the copy at ``step`` (a collective of the group)."""
        t0 = time.perf_counter()
        held = sm.held()
        world, rank = dist.get_world_size(), dist.get_rank()
        keys = sm.keys(held.rows)
        own = {k: held.rows[k].detach().clone() for k in keys}
        blob = sm.replicated_blob(held, tracked)
        theirs: dict[Key, torch.Tensor] = {}
        neighbour = None
        if world > 1:
            nxt, neighbour = (rank + 1) % world, (rank - 1) % world
            works = []
            for k in keys:
                rows = sm.full_shape(k)[0]
                a, b = shard_range(rows, world, neighbour)
                t = held.rows[k]
                buf = theirs[k] = torch.empty((b - a, *t.shape[1:]), dtype=t.dtype)
                if own[k].shape[0]:
                    works.append(dist.isend(own[k], nxt))
                if b > a:
                    works.append(dist.irecv(buf, neighbour))
            for w in works:
                w.wait()
        self.copies = Copies(
            step=step, layout=held.layout, own=own, blob=blob, neighbour=neighbour, theirs=theirs
        )
        self.seconds = time.perf_counter() - t0
