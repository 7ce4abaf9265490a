"""Normalisation layers that would make an elastic job's result depend on its membership.

A BatchNorm layer in training mode normalises each forward pass with the statistics of the
micro-batch it sees. Under Tidal a member's micro-batches are cut from its share of the
global batch, and the shares change with the number of members: one worker normalises
over all 32 samples of a step, each of two over its 16. So the gradients, and with them
every update, depend on how many workers trained each step, the one thing elastic
invariance promises they do not (DESIGN.md section 4); and each member's running statistics
follow only its own shares, so the members' models differ. Nothing fails: the job runs to
``succeeded`` with a result that depends on its membership history.

So under ``tidal run`` a worker refuses such a layer, loudly, unless the script accepted it
(``Trainer(allow_batch_norm=True)``: per-member statistics as under DDP, the result then
depends on the world size, and the running statistics each member keeps are its own, those
of the heal's source travelling to a joiner). Refused: every ``_BatchNorm`` (BatchNorm1d/2d/3d,
their lazy forms, SyncBatchNorm, whose collective would also hang members with fewer
micro-batches) in training mode, and an InstanceNorm that tracks running statistics in
training mode (it normalises each sample alone, but its running statistics follow the
member's micro-batches). Not refused: any of them in eval mode (a frozen BatchNorm
normalises with its running statistics, the same on every member), GroupNorm, LayerNorm,
RMSNorm (each sample alone).

Checked twice: when the ``Trainer`` is made (the common case, one line before any worker
joins) and by a forward pre-hook on each such layer (a script that calls ``model.train()``
in its loop after freezing them at construction)."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm


class BatchNormRefused(ValueError):
    """A layer would normalise with each member's micro-batch statistics (module doc)."""


def uses_batch_statistics(module: torch.nn.Module) -> bool:
    """Whether ``module``, as it is now, makes the result depend on the members' shares."""
    if not module.training:
        return False
    if isinstance(module, _BatchNorm):
        return True
    return isinstance(module, _InstanceNorm) and module.track_running_stats


def watched(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The layers that could use batch statistics in some mode, by name."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) or (isinstance(m, _InstanceNorm) and m.track_running_stats)
    ]


def refusal(names: list[str]) -> str:
    """The one line that names the layers and the ways out."""
    shown = ", ".join(repr(n) for n in names[:3]) + (
        f" and {len(names) - 3} more" if len(names) > 3 else ""
    )
    return (
        f"{shown} normalise{'s' if len(names) == 1 else ''} with each member's micro-batch "
        "statistics in training mode, so the updates would depend on the number of workers "
        "(elastic invariance): use GroupNorm or LayerNorm, freeze them (.eval()), or pass "
        "Trainer(allow_batch_norm=True) to accept per-member statistics as under DDP"
    )


def check(model: torch.nn.Module) -> None:
    """Refuse now if a layer of ``model`` uses batch statistics (``BatchNormRefused``)."""
    names = [n for n, m in watched(model) if uses_batch_statistics(m)]
    if names:
        raise BatchNormRefused(refusal(names))


def guard(model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """A forward pre-hook on each watched layer that refuses a forward in training mode."""

    def make(name: str):
        def hook(module: torch.nn.Module, args: object) -> None:
            if uses_batch_statistics(module):
                raise BatchNormRefused(refusal([name]))

        return hook

    return [m.register_forward_pre_hook(make(n)) for n, m in watched(model)]
