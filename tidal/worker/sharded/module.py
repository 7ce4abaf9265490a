"""``sharding="fsdp"``: the model and optimizer sharded with FSDP2 over each generation.

FSDP2 (``fully_shard``) shards every parameter, and the optimizer state with it, on dim 0
across a fixed group; a generation's group lives only as long as the generation. So each
generation gets a fresh FSDP module, built from a *template* (the user's module, moved to
the meta device when the job starts: it holds the structure, never the numbers), allocated
with only this member's rows (``to_empty``), and filled with the rows the members moved to
it (``shard_heal``). The user's optimizer object stays the same (an LR scheduler and a
GradScaler keep their references): its ``param_groups`` are pointed at the new module's
parameters and its state re-keyed to them. The training loop calls ``trainer.model``,
which is the current generation's FSDP module.

Contracts:

- Gradients are summed across members (``set_gradient_divide_factor(1.0)`` and a plain
  SUM on the wire, ``set_force_sum_reduction_for_comms``, on every FSDP unit): each
  micro-batch's loss is already scaled by its share of the global batch, as with DDP. Micro-batches before the last accumulate without communication
  (``set_requires_gradient_sync(False)``).
- What a member holds (``Held``) is a set of row blocks of one layout, keyed by
  ``("p", name)`` for a parameter and ``("o", name, key)`` for an optimizer state tensor of
  that parameter's shape; everything else (buffers, the optimizer's scalar state and
  hyper-parameters, RNG, tracked state) is replicated and travels as one small blob.
- Keys are always visited in one order (``keys``), the same on every member, so every
  member issues the same sequence of point-to-point messages.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from tidal.tracked import Captured, TrackedState
from tidal.worker.sharded.guard import Guard, GuardedAllGather, GuardedReduceScatter
from tidal.worker.sharded.layout import check_shardable, shard_range
from tidal.worker.sharded.plan import Layout
from tidal.worker.state import blob

Key = tuple[str, ...]
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


@dataclass(kw_only=True)
class Held:
    """Row blocks of one layout at one step, and the replicated tensors that go with them."""

    layout: Layout
    rows: dict[Key, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    scalars: dict[str, dict[str, object]] = field(default_factory=dict)  # optimizer, per param


def units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules that get their own FSDP unit (all-gathered and freed one at a time):
    each child that has parameters, or, for a container child (``ModuleList``, ...), each
    of its children that has parameters (a transformer's blocks), then the root."""
    out = []
    for child in module.children():
        for unit in child.children() if isinstance(child, CONTAINERS) else [child]:
            if any(True for _ in unit.parameters()):
                out.append(unit)
    return out


class ShardedModel:
    """The sharded model across generations: the template, the user's optimizer, and what
    this member holds between generations."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        named = list(module.named_parameters())
        check_shardable({n: tuple(p.shape) for n, p in named}, max_world=1)
        self.names = [n for n, _ in named]
        self.shapes = {n: tuple(p.shape) for n, p in named}
        self.dtypes = {n: p.dtype for n, p in named}
        name_of = {id(p): n for n, p in named}
        try:
            self.group_names = [
                [name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups
            ]
        except KeyError:
            raise ValueError(
                "the optimizer holds a tensor that is not a parameter of the model: build it "
                "from model.parameters()"
            ) from None
        rows: dict[Key, torch.Tensor] = {}
        scalars: dict[str, dict[str, object]] = {}
        for n, p in named:
            rows[("p", n)] = p.detach()
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) and v.dim():
                    rows[("o", n, k)] = v.detach()
                else:
                    scalars.setdefault(n, {})[k] = v
        buffers = {n: b.detach() for n, b in module.named_buffers()}
        self._held: Held | None = Held(
            layout=Layout(gen=0, world=1, rank=0), rows=rows, buffers=buffers, scalars=scalars
        )
        optimizer.state.clear()
        module.to("meta")  # the template: the numbers now live in ``_held`` (no copy made)
        self.template = module
        self.module: torch.nn.Module | None = None
        self.layout = self._held.layout

    def check_world(self, max_world: int) -> None:
        check_shardable(self.shapes, max_world)

    # -- what this member holds ----------------------------------------------------------
    def held(self) -> Held:
        if self.module is None:
            assert self._held is not None
            return self._held
        params = dict(self.module.named_parameters())
        rows: dict[Key, torch.Tensor] = {}
        scalars: dict[str, dict[str, object]] = {}
        for n in self.names:
            rows[("p", n)] = params[n]._local_tensor
            for k, v in self.optimizer.state.get(params[n], {}).items():
                if isinstance(v, DTensor):
                    if tuple(v.shape) != self.shapes[n]:
                        raise ValueError(
                            f"the optimizer's state {k!r} of {n!r} has shape {tuple(v.shape)}, "
                            f"not its parameter's {self.shapes[n]}: sharding='fsdp' carries "
                            "optimizer state shaped like its parameter (Adam, SGD, ...) only"
                        )
                    rows[("o", n, k)] = v._local_tensor
                else:
                    scalars.setdefault(n, {})[k] = v
        buffers = {n: b.detach() for n, b in self.module.named_buffers()}
        return Held(layout=self.layout, rows=rows, buffers=buffers, scalars=scalars)

    def keys(self, present: Iterable[Key]) -> list[Key]:
        """``present`` in the one order every member uses: by parameter, params first."""
        order = {n: i for i, n in enumerate(self.names)}
        return sorted(present, key=lambda k: (order[k[1]], k[0] != "p", k[2:]))

    def full_shape(self, key: Key) -> tuple[int, ...]:
        return self.shapes[key[1]]

    def model_layout(self) -> list[list[str]]:
        """[name, shape, dtype] of each parameter (``heal.model_layout``'s form)."""
        return [
            [n, str(list(self.shapes[n])), str(self.dtypes[n]).removeprefix("torch.")]
            for n in self.names
        ]

    # -- the replicated part -------------------------------------------------------------
    def replicated_blob(self, held: Held, tracked: TrackedState | None) -> bytes:
        """Everything but the row blocks, as a heal blob (``blob``: JSON and raw tensor
        bytes, no pickle); copies, so it may be kept."""
        captured = tracked.capture() if tracked else Captured(skeleton={}, tensors=[])
        keys = self.keys(held.rows)
        return blob.encode(
            {
                "keys": [list(k) for k in keys],
                "model": self.model_layout(),
                "dtypes": [str(held.rows[k].dtype).removeprefix("torch.") for k in keys],
                "buffers": held.buffers,
                "scalars": held.scalars,
                "param_groups": [
                    {k: v for k, v in g.items() if k != "params"}
                    for g in self.optimizer.param_groups
                ],
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
                "tracked": captured.to_json(),
                "tracked_tensors": captured.tensors,
            }
        )

    # -- a generation's module ------------------------------------------------------------
    def build(
        self,
        *,
        layout: Layout,
        rows: dict[Key, torch.Tensor],
        replicated: dict,
        guard: Guard,
        group: dist.ProcessGroup | None = None,
        device: str = "cpu",
    ) -> torch.nn.Module:
        """A fresh FSDP module over ``group`` (the default group if None) holding ``rows``
        (this member's rows of every key in ``layout``), with the replicated state of
        ``replicated`` (a loaded ``replicated_blob``); the optimizer is re-pointed at it. Every
        unit communicates through ``guard`` (``tidal.worker.sharded.guard``)."""
        self.module = None
        self._held = None
        group = group if group is not None else dist.group.WORLD
        mesh = DeviceMesh.from_group(group, device)
        m = copy.deepcopy(self.template)
        for unit in units(m):
            fully_shard(unit, mesh=mesh)
        fully_shard(m, mesh=mesh)
        m.to_empty(device=device)
        for sub in m.modules():
            if isinstance(sub, FSDPModule):
                sub.set_gradient_divide_factor(1.0)  # summed: losses carry their share
                # A plain SUM on the wire: with a divide factor, FSDP2 reduces float32 and
                # bf16 with PREMUL_SUM, which gloo refuses (float64 it sums anyway).
                sub.set_force_sum_reduction_for_comms(True)
                sub.set_custom_all_gather(GuardedAllGather(guard))
                sub.set_custom_reduce_scatter(GuardedReduceScatter(guard))
        params = dict(m.named_parameters())
        with torch.no_grad():
            for n, p in params.items():
                p._local_tensor.copy_(rows[("p", n)])
            for n, b in m.named_buffers():
                b.copy_(replicated["buffers"][n])
        opt = self.optimizer
        for g, names, saved in zip(
            opt.param_groups, self.group_names, replicated["param_groups"], strict=True
        ):
            g.update(saved)
            g["params"] = [params[n] for n in names]
        opt.state.clear()
        for key, t in rows.items():
            if key[0] == "o":
                state = torch.zeros_like(params[key[1]])
                state._local_tensor.copy_(t)
                opt.state[params[key[1]]][key[2]] = state
        for n, entries in replicated["scalars"].items():
            for k, v in entries.items():
                opt.state[params[n]][k] = v.clone() if isinstance(v, torch.Tensor) else v
        self.module, self.layout = m, layout
        return m

    def install(self, held: Held) -> None:
        """Hold ``held`` instead of anything held now (a roll-back to a checkpoint)."""
        self.module = None
        self.optimizer.state.clear()
        self._held, self.layout = held, held.layout

    def release(self) -> None:
        """Keep what is held, without the module (its group is gone)."""
        if self.module is not None:
            self._held = self.held()
            self.module = None
            self.optimizer.state.clear()

    # -- collectives over the current group -------------------------------------------------
    def gather_full(self, gen: int) -> None:
        """Give every member the whole state (a planned change: members leaving must not take
        the only copy of their rows with them). Row blocks are padded to the chunk size,
        all-gathered, and trimmed; afterwards this member holds layout ``(gen, 1, 0)``."""
        held = self.held()
        world, rank = dist.get_world_size(), dist.get_rank()
        full: dict[Key, torch.Tensor] = {}
        for key in self.keys(held.rows):
            full[key] = _all_gather_rows(held.rows[key], self.full_shape(key)[0], world, rank)
        self.module = None
        self.optimizer.state.clear()
        self._held = Held(
            layout=Layout(gen=gen, world=1, rank=0),
            rows=full,
            buffers={n: b.clone() for n, b in held.buffers.items()},
            scalars=held.scalars,
        )
        self.layout = self._held.layout

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded parameters and buffers on rank 0 of the current group (a collective:
        every member calls it); None elsewhere."""
        held = self.held()
        world, rank = dist.get_world_size(), dist.get_rank()
        out = {}
        for n in self.names:
            out[n] = _all_gather_rows(held.rows[("p", n)], self.shapes[n][0], world, rank)
        if rank != 0:
            return None
        out.update({n: b.clone() for n, b in held.buffers.items()})
        return out


def _all_gather_rows(local: torch.Tensor, rows: int, world: int, rank: int) -> torch.Tensor:
    if world == 1:
        return local.detach().clone()
    size = -(-rows // world)
    mine = torch.zeros((size, *local.shape[1:]), dtype=local.dtype)
    start, stop = shard_range(rows, world, rank)
    mine[: stop - start] = local
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return torch.cat(parts)[:rows].clone()
