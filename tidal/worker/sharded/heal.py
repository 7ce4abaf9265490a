"""Healing a sharded generation: carry out ``shard_plan.decide`` over the new group.

Every member of the new generation all-gathers its facts (``shard_plan.encode``), makes the
same decision from them, then:

1. the member named ``replicated_from`` sends the replicated state (buffers, optimizer
   scalars and hyper-parameters, RNG, tracked state, and the list of row keys with their
   dtypes) to every other member, as one blob; every member loads it (for a roll-back the
   sender loads its own snapshot's);
2. for each key, in the one order, every member receives exactly the rows of its new shard
   that it lacks, point to point, from the member the decision names for the old rank that
   held them (``shards.reshard``); a joiner receives only its shard;
3. the generation's FSDP module is built around those rows (``ShardedModel.build``). The
   caller then refreshes the neighbour copies in the new layout (``Ring.refresh``), once it
   has taken the step this decided.

Nothing is changed before every transfer has completed, so a failure half-way leaves each
member holding what it held before, for the next generation to try again.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tidal.tracked import TrackedState
from tidal.worker.sharded import plan
from tidal.worker.sharded.guard import Guard
from tidal.worker.sharded.layout import from_whole, reshard
from tidal.worker.sharded.module import Key, ShardedModel
from tidal.worker.sharded.ring import Ring
from tidal.worker.state import blob as blob_format
from tidal.worker.state.heal import StateLost, check_model, send_blob


def _whole_holders(decision: plan.Decision, facts: list[plan.MemberFacts]) -> list[int]:
    """The members holding the decided layout whole, live, at the decided step (empty
    unless the layout is a whole one: world 1)."""
    if decision.world != 1 or decision.sources[0].slot != plan.Slot.LIVE:
        return []
    layout = facts[decision.sources[0].member].live
    return [r for r, f in enumerate(facts) if f.step == decision.step and f.live == layout]


@dataclass(frozen=True, kw_only=True)
class ShardHealResult:
    path: plan.Path
    step: int
    redone: int  # steps this member had committed past ``step``
    source: int
    reason: str


def facts(sm: ShardedModel, ring: Ring, step: int | None) -> plan.MemberFacts:
    c = ring.copies
    return plan.MemberFacts(
        step=step,
        live=sm.layout,
        copy_step=c.step if c else None,
        copy=c.layout if c else None,
        neighbour=c.neighbour if c else None,
    )


def heal_sharded(
    sm: ShardedModel,
    ring: Ring,
    *,
    step: int | None,
    committed_step: int,
    gen: int,
    tracked: TrackedState | None,
    guard: Guard,
) -> ShardHealResult:
    """Assemble this member's shard of the state for generation ``gen`` over the current
    default group (module contract). ``step``: this member's committed step, None if it
    never trained. Raises ``StateLost`` when no way covers every row."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = plan.encode(facts(sm, ring, step))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    decision = plan.decide([plan.decode(r) for r in gathered], committed_step)
    if decision.path == plan.Path.LOST:
        best = max((f.step for f in map(plan.decode, gathered) if f.step is not None), default=-1)
        raise StateLost(best, committed_step)
    held = sm.held()

    def slot(s: plan.Source) -> dict[Key, torch.Tensor]:
        if s.slot == plan.Slot.LIVE:
            return held.rows
        assert ring.copies is not None
        return ring.copies.own if s.slot == plan.Slot.OWN else ring.copies.theirs

    src = decision.replicated_from
    blob = None
    if rank == src.member:
        blob = ring.copies.blob if src.slot == plan.Slot.OWN else sm.replicated_blob(held, tracked)
    blob = send_blob(blob, src.member, [r for r in range(world) if r != src.member])
    meta = blob_format.decode(blob)
    check_model(sm.model_layout(), meta["model"])  # before anything moves (ModelMismatch)
    holders = [s.member for s in decision.sources]
    # Members that hold the whole state at the decided step (after the gather before a
    # planned shrink, a resume, a roll-back) cut their own rows from it: nothing is sent
    # to them.
    local = _whole_holders(decision, [plan.decode(r) for r in gathered])
    rows: dict[Key, torch.Tensor] = {}
    for key, dtype in zip(map(tuple, meta["keys"]), meta["dtypes"], strict=True):
        shape = sm.full_shape(key)
        if local:
            rows[key] = from_whole(
                held.rows[key] if rank in local else None,
                torch.empty((0, *shape[1:]), dtype=getattr(torch, dtype)),
                rows=shape[0],
                new_world=world,
                rank=rank,
                src=holders[0],
                local=local,
            )
            continue
        mine_held = {
            old: slot(s)[key] for old, s in enumerate(decision.sources) if s.member == rank
        }
        rows[key] = reshard(
            torch.empty((0, *shape[1:]), dtype=getattr(torch, dtype)),
            mine_held,
            rows=shape[0],
            old_world=decision.world,
            new_world=world,
            holders=holders,
            rank=rank,
        )
    torch.set_rng_state(meta["torch_rng"])
    random.setstate(meta["python_rng"])
    shipped = json.loads(meta["tracked"])
    if tracked is not None or shipped["skeleton"]:
        (tracked or TrackedState({})).restore(shipped["skeleton"], list(meta["tracked_tensors"]))
    sm.build(
        layout=plan.Layout(gen=gen, world=world, rank=rank), rows=rows, replicated=meta, guard=guard
    )
    return ShardHealResult(
        path=decision.path,
        step=decision.step,
        redone=decision.redone(step),
        source=src.member,
        reason=decision.reason,
    )
