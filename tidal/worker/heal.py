"""Healing: every member of a new generation adopts the state of the most advanced one.

The members all-gather their committed step; the lowest rank among those with the highest
step is the source and broadcasts model, optimizer, RNG and step to the others. Joiners
(no state yet) and laggards (a peer died mid all-reduce, leaving one survivor past the step
and another before it) take the same path, so a join and a failure share one code path.
When every member already holds the same step, nothing is sent: a scale-down costs no
transfer. The optimizer state travels as a ``torch.save`` blob loaded with
``weights_only=True``: tensors and plain containers only, never arbitrary pickles.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

NO_STATE = -1


@dataclass(frozen=True, kw_only=True)
class HealResult:
    source: int
    step: int
    sent: bool


def _broadcast_blob(blob: bytes | None, src: int) -> bytes:
    size = torch.tensor([len(blob) if blob is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src)
    if blob is not None:
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src)
    return data.numpy().tobytes()


LARGE = 1 << 18  # elements: a tensor this big travels alone, in place, with no copy


@torch.no_grad()
def _broadcast_tensors(tensors: list[torch.Tensor], src: int) -> None:
    """Large contiguous tensors are broadcast in place, one collective each; the small ones
    are flattened into one broadcast per dtype (a collective each would cost its latency)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() >= LARGE and t.is_contiguous():
            dist.broadcast(t.detach(), src)
        else:
            by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, src)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def heal(
    *, module: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int | None
) -> HealResult:
    """Make this member's state equal to the most advanced member's. ``step`` is this
    member's committed step, or None if it holds no trained state yet."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor([NO_STATE if step is None else step], dtype=torch.int64)
    steps = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(steps, mine)
    values = [int(t.item()) for t in steps]
    best = max(values)
    source = values.index(best)
    if best == NO_STATE:  # a fresh job: everybody adopts rank 0's initialisation
        best, source = 0, 0
    elif all(v == best for v in values):
        return HealResult(source=source, step=best, sent=False)
    _broadcast_tensors(list(module.parameters()) + list(module.buffers()), source)
    # The optimizer's structure travels as a small blob; its tensors travel flat, per
    # dtype, straight into tensors the receivers allocate from that structure.
    blob = None
    if rank == source:
        layout, tensors = _split_state(optimizer.state_dict())
        buf = io.BytesIO()
        torch.save(
            {"layout": layout, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()},
            buf,
        )
        blob = buf.getvalue()
    meta = torch.load(io.BytesIO(_broadcast_blob(blob, source)), weights_only=True)
    if rank != source:
        tensors = [
            torch.empty(shape, dtype=getattr(torch, dtype))
            for shape, dtype in meta["layout"]["tensors"]
        ]
    _broadcast_tensors(tensors, source)
    if rank != source:
        optimizer.load_state_dict(_join_state(meta["layout"], tensors))
        torch.set_rng_state(meta["torch_rng"])
        random.setstate(meta["python_rng"])
    return HealResult(source=source, step=best, sent=True)


def _split_state(state_dict: dict) -> tuple[dict, list[torch.Tensor]]:
    """An optimizer state dict as (its structure with tensor slots, the tensors in order)."""
    tensors: list[torch.Tensor] = []
    state: dict = {}
    for pid, entries in state_dict["state"].items():
        state[pid] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                state[pid][key] = {"tensor": len(tensors)}
                tensors.append(value.detach())
            else:
                state[pid][key] = {"value": value}
    layout = {
        "param_groups": state_dict["param_groups"],
        "state": state,
        "tensors": [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors],
    }
    return layout, tensors


def _join_state(layout: dict, tensors: list[torch.Tensor]) -> dict:
    state = {
        pid: {k: tensors[v["tensor"]] if "tensor" in v else v["value"] for k, v in entries.items()}
        for pid, entries in layout["state"].items()
    }
    return {"state": state, "param_groups": layout["param_groups"]}
