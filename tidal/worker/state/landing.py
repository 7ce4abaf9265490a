"""Landing space for a heal: memory the received optimizer state lands in, touched before
the transfer.

A joiner receives the optimizer's state (for SGD with momentum as many bytes as the model,
for Adam twice that) into tensors it must allocate first. Fresh memory costs the kernel a
page fault and a zeroed page per 4 KiB on its first touch, which would happen inside the
transfer while every other member waits (about 30 ms per 100 MB on this machine kind).
``prepare`` pays for it before the worker tells the coordinator it is ready: it steps a
deep copy of the optimizer once, over copies of the parameters with zero gradients, and
keeps the state tensors that step made. Nothing the job carries is touched: not the
optimizer, the model, its gradients, the RNG, nor any step hook (the copy's raw ``step``
runs, without the hooks an LR scheduler or the user registered).

A ``Landing`` hands out those tensors (and a laggard's own optimizer tensors) by shape and
dtype; any slot without a match is allocated as before. Every tensor handed out is then
overwritten whole by the transfer, so what it held before never matters.
"""

from __future__ import annotations

import copy

import torch


def state_tensors(state_dict: dict) -> list[torch.Tensor]:
    """The tensors of an optimizer state dict, in the order ``heal`` ships them."""
    return [
        value.detach()
        for entries in state_dict["state"].values()
        for value in entries.values()
        if isinstance(value, torch.Tensor)
    ]


def prepare(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state tensors one step of ``optimizer`` makes, allocated and written now; empty
    when the optimizer already holds state (it is its own landing then), when its parameters
    are not all on the CPU (device memory comes from the caching allocator without the page
    faults a landing saves; a second copy of the state could exhaust the device), or when it
    cannot be stepped this way (an optimizer that needs a closure, or that cannot be copied)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.device.type != "cpu" for p in params):
        return []  # has its own; or on a GPU (see above)
    rng = torch.get_rng_state()
    try:
        twin = copy.deepcopy(optimizer)
        for group in twin.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        step = type(twin).step
        if getattr(step, "hooked", False):  # torch's wrapper that runs the step hooks
            step = step.__wrapped__
        step(twin)
        return [t for t in state_tensors(twin.state_dict()) if t.device.type == "cpu"]
    except Exception:  # noqa: BLE001 - only a missed optimisation: the heal allocates
        return []
    finally:
        torch.set_rng_state(rng)


class Landing:
    """Tensors to receive into, taken by (shape, dtype); each is handed out once."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            self._free.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def take(self, shape: list[int], dtype: str) -> torch.Tensor:
        """A tensor of that shape and dtype (a ``torch`` dtype's name): a landing one when
        one is free, else a fresh allocation."""
        dt = getattr(torch, dtype)
        free = self._free.get((tuple(shape), dt))
        return free.pop() if free else torch.empty(shape, dtype=dt)
