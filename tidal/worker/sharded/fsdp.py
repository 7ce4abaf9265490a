"""The Trainer's side of ``sharding="fsdp"``: one object that holds the sharded model across
generations and does, at each step boundary, what DDP's wrapper and comm hook do for
``sharding="ddp"``.

- **Forming** (``form``): heal the shards over the new group (``shard_heal``), build the
  generation's FSDP module, refresh the neighbour copies (``ring``).
- **A step's end** (``end_step``): after the last micro-batch's backward (whose
  reduce-scatter summed the gradients), one all-reduce of five floats carries the control
  word (``switch``, ``stop``, ``shrink``, ``checkpoint``: rank 0's clock decides a
  ``--checkpoint-interval``, and every member must take part) and the squared norm of this
  member's gradient shard (the clipping norm is the root of the sum). FSDP's own collectives run inside the
  user's forward and backward, so they cannot carry a word the way DDP's hook does; this
  is the one collective a step adds (~0.5 ms for 40 bytes on gloo here).
- **A planned switch** (``before_switch``): when any member knows that the next generation
  drops a member (``shrink``), the whole state is gathered onto every member first, so no
  leaver takes the only copy of its rows; a switch that only adds members gathers nothing.

Every collective of a step goes through the generation's ``Guard``: a failure never raises
inside the user's code; the step is then not committed and is redone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from tidal.tracked import TrackedState
from tidal.worker.sharded.guard import Guard
from tidal.worker.sharded.heal import ShardHealResult, heal_sharded
from tidal.worker.sharded.module import ShardedModel
from tidal.worker.sharded.ring import Ring

SWITCH, STOP, SHRINK, CHECKPOINT, NORM = range(5)


class Fsdp:
    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, ring: Ring):
        self.sharded = ShardedModel(module, optimizer)
        self.ring = ring
        self.guard = Guard()
        self.members: list[int] = []
        self.word = torch.zeros(5, dtype=torch.float64)
        self.grad_norm: float | None = None

    @property
    def module(self) -> torch.nn.Module | None:
        return self.sharded.module

    def form(
        self,
        *,
        members: Sequence[int],
        gen: int,
        step: int | None,
        committed_step: int,
        tracked: TrackedState | None,
        side_group: Callable[[], dist.ProcessGroup],
    ) -> ShardHealResult:
        """Heal the shards over the new default group, build the generation's module, and
        make the group the neighbour copies travel on (``side_group``: connected within the
        same short window as the default group, so a peer lost meanwhile costs that window,
        not the collective timeout)."""
        self.ring.bind(None)
        self.guard = Guard()
        result = heal_sharded(
            self.sharded,
            self.ring,
            step=step,
            committed_step=committed_step,
            gen=gen,
            tracked=tracked,
            guard=self.guard,
        )
        self.members = list(members)
        if len(members) > 1:
            self.ring.bind(side_group())
        return result

    def refresh_copies(self, step: int, tracked: TrackedState | None) -> None:
        self.ring.refresh(self.sharded, step, tracked)

    def leave(self) -> None:
        """Before the generation's groups are destroyed: the copy in flight ends first."""
        self.ring.bind(None)
        self.sharded.release()

    def micro_batch(self, last: bool) -> None:
        """Before a micro-batch's forward: only the last one reduce-scatters."""
        self.module.set_requires_gradient_sync(last)

    def end_step(
        self,
        *,
        switch: bool,
        stop: bool,
        shrink: bool,
        checkpoint: bool,
        clip: bool,
        before: Callable[[], None] = lambda: None,
    ) -> None:
        """The step's control all-reduce (module contract); afterwards ``guard.failed`` says
        whether the step failed, ``flags`` what the members agreed, ``grad_norm`` the norm of
        the whole gradient (when ``clip``). ``before`` runs inside the guarded collective
        (a test's fault point): what it raises fails the step as the all-reduce would."""
        w = self.word
        w.zero_()
        w[SWITCH], w[STOP], w[SHRINK] = float(switch), float(stop), float(shrink)
        w[CHECKPOINT] = float(checkpoint)
        if clip:
            w[NORM] = _local_norm_sq(self.sharded.optimizer)

        def reduce() -> None:
            before()
            dist.all_reduce(w)

        self.guard.run(reduce, w)
        self.grad_norm = math.sqrt(float(w[NORM])) if clip else None

    def flags(self) -> tuple[bool, bool, bool, bool]:
        """What the members agreed: switch, stop, shrink, checkpoint (rank 0's decision)."""
        w = self.word
        return tuple(bool(w[i] > 0) for i in (SWITCH, STOP, SHRINK, CHECKPOINT))

    def shrinks(self, newest: Sequence[int] | None) -> bool:
        """True if a next generation of ``newest`` members (None: this member is leaving or
        does not know) drops any of the current members."""
        return newest is None or not set(self.members) <= set(newest)

    def before_switch(self, gen: int) -> None:
        self.sharded.gather_full(gen)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.sharded.full_state_dict()


def _local_norm_sq(optimizer: torch.optim.Optimizer) -> float:
    total = 0.0
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.grad is not None:
                local = getattr(p.grad, "_local_tensor", p.grad)
                total += float(local.detach().double().pow(2).sum())
    return total


def warm_up() -> None:
    """Pay FSDP's one-time costs before joining anyone (a first generation's module took
    ~250 ms more to build than the next one, and its first step longer): a 1-rank group on
    an in-memory store, a small module built the way ``ShardedModel`` builds one, one
    forward, backward and Adam step on it, all torn down."""
    from tidal.worker.sharded.module import ShardedModel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        optimizer = torch.optim.Adam(module.parameters())
        sharded = ShardedModel(module, optimizer)
        held = sharded.held()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        built = sharded.build(
            layout=held.layout,
            rows=held.rows,
            replicated={"buffers": held.buffers, "scalars": {}, "param_groups": groups},
            guard=Guard(),
        )
        built(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    finally:
        dist.destroy_process_group()
