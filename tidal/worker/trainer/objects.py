"""The user's objects, as a ``Trainer`` holds them: checked once, placed on the device.

Contracts:

- Everything the constructor can refuse is refused here, before the worker joins anyone,
  each with one ``ValueError`` saying what to pass instead: an unknown ``sharding``, FSDP on
  a GPU or with several optimizers or a ``GradScaler``, a model FSDP cannot shard, tracked
  state on another device, BatchNorm in training mode under ``tidal run`` (``norms``).
- The model and the optimizer's state are moved to ``device`` in place
  (``devices.place_module``): the optimizer keeps its parameters' identity.
- ``tracked`` holds every object carried with the model and optimizer: the scheduler, the
  scaler and the user's ``state=`` (``tracked``); what cannot be carried is refused now.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tidal import devices
from tidal.tracked import TrackedState
from tidal.worker.membership import ddp
from tidal.worker.trainer import norms, optimizers

#: The values of ``Trainer(sharding=...)``.
SHARDINGS = ("ddp", "fsdp")


@dataclass(frozen=True, kw_only=True)
class Objects:
    """The model, optimizer and data the script handed over, and where they train."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer  # several are carried as one (``optimizers``)
    dataset: Any
    lr_scheduler: Any | None
    grad_scaler: torch.amp.GradScaler | None
    tracked: TrackedState
    device: torch.device
    sharding: str
    ddp_kwargs: dict[str, Any]


def check_sharding(
    sharding: str,
    *,
    device: torch.device,
    optimizer: torch.optim.Optimizer,
    grad_scaler: Any,
    model: torch.nn.Module,
) -> None:
    """Refuse a ``sharding`` that cannot train these objects (module doc)."""
    if sharding == "fsdp" and device.type != "cpu":
        raise ValueError(
            "sharding='fsdp' trains on the CPU only so far (its resharding and neighbour "
            "copies move host tensors over gloo): pass device='cpu', or sharding='ddp'"
        )
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if sharding == "fsdp" and isinstance(optimizer, optimizers.Optimizers):
        raise ValueError("sharding='fsdp' takes one optimizer so far: use sharding='ddp'")
    if sharding == "fsdp" and grad_scaler is not None:
        raise ValueError(
            "grad_scaler= is not supported with sharding='fsdp' yet (its inf/NaN check "
            "would see only this member's shard): use bf16, or sharding='ddp'"
        )
    if sharding == "fsdp":  # refused now, not when the job first forms a group
        from tidal.worker.sharded.layout import check_shardable

        check_shardable({n: tuple(p.shape) for n, p in model.named_parameters()}, 1)


def place(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
    *,
    elastic: bool,
    allow_batch_norm: bool,
    device: str | torch.device | None,
    sharding: str,
    grad_scaler: Any,
    state: Mapping[str, Any] | None,
    ddp_kwargs: dict[str, Any] | None,
) -> tuple[torch.optim.Optimizer, torch.device, dict[str, Any]]:
    """Check the objects and move them to their device (module doc): the optimizer (a list
    combined into one), the device, and DDP's checked keywords. ``elastic``: under
    ``tidal run``."""
    kwargs = ddp.check_kwargs(ddp_kwargs)
    optimizer = optimizers.combine(optimizer)
    if elastic and not allow_batch_norm:
        norms.check(model)  # now, in one line, before this worker joins anyone
        norms.guard(model)  # and at any later forward in training mode
    where = devices.resolve_device(device, cuda_available=torch.cuda.is_available())
    check_sharding(
        sharding, device=where, optimizer=optimizer, grad_scaler=grad_scaler, model=model
    )
    devices.place_module(model, optimizer, where)
    devices.check_tracked_devices(dict(state or {}), where)
    return optimizer, where, kwargs
