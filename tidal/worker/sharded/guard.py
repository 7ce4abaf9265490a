"""Collectives that never raise inside the training script's own code (``sharding="fsdp"``).

FSDP all-gathers each unit's parameters inside its forward, that is inside the user's
``trainer.model(x)``: a peer lost right then would raise out of the user's loop, where
nothing can catch it, and end the worker. So every FSDP unit of a generation communicates
through these (``set_custom_all_gather`` / ``set_custom_reduce_scatter``): the first failure
is recorded on the generation's ``Guard`` and from then on every collective of the step
returns zeros at once, without touching the broken group. The step computes garbage and
finishes; ``Step`` sees ``guard.failed`` at its end and the step is never committed: it is
redone in the next generation, like any step whose collective failed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only those.
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class Guard:
    """The first failed collective of a generation (None while every one succeeded)."""

    def __init__(self) -> None:
        self.failed: Exception | None = None

    def run(self, op, out: torch.Tensor) -> None:  # noqa: ANN001 - a callable of no arguments
        if self.failed is None:
            try:
                op()
                return
            except Exception as exc:  # noqa: BLE001 - any failure of the group
                self.failed = exc
        out.zero_()


class _Alloc:
    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class GuardedAllGather(_Alloc, AllGather):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        self.guard.run(
            lambda: _ALL_GATHER(output_tensor, input_tensor, group=group),
            output_tensor,
        )


class GuardedReduceScatter(_Alloc, ReduceScatter):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        self.guard.run(
            lambda: _REDUCE_SCATTER(output_tensor, input_tensor, op, group),
            output_tensor,
        )
