"""What a committed step does to the state: the optimizer step and what hangs on it.

Runs once per committed step, after this member's gradient all-reduce completed, so every
member sees the same synchronised gradients and makes the same decisions:

1. with a GradScaler: unscale the gradients (which also finds inf/NaN in them);
2. with ``clip_grad_norm``: clip the optimizer's parameters' gradients to that total norm;
3. the optimizer step (``scaler.step``: skipped on every member alike when a gradient is not
   finite), then ``scaler.update()``;
4. the LR scheduler's ``step()``, once per committed step (skipped optimizer steps
   included, as in PyTorch's AMP recipe);
5. the ``after_step`` hooks (EMA updates belong here), with the index of the step.

Nothing here runs for a step whose collective failed: that step is redone, so nothing is
applied twice. A 1-worker run applies the same sequence, so the mathematics do not depend
on the world size.

The optimizer is stepped here only. A script ported from a plain loop that still calls
``optimizer.step()`` itself would step each member with its own unsynchronised gradients
(between micro-batches) or step twice, and nothing would fail; so a step pre-hook on the
optimizer refuses any step this module did not start (``OptimizerStepRefused``). The LR
scheduler likewise: one the script steps itself (once per micro-batch, whose count differs
between members) would give the members different learning rates; its ``last_epoch`` moved
between the step's start (``begin``) and ``apply`` is refused (``SchedulerStepRefused``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

RESERVED = ("lr_scheduler", "grad_scaler")  # names the Trainer's own tracked objects take


class OptimizerStepRefused(RuntimeError):
    """The script stepped the optimizer itself (module doc)."""


class SchedulerStepRefused(RuntimeError):
    """The script stepped the LR scheduler itself (module doc)."""


class _OnlyHere:
    """The optimizer's step pre-hook: refuses a step unless ``Update.apply`` is making it.
    A copy of the optimizer (``copy.deepcopy``, the landing's twin) carries no hooks: an
    optimizer's pickled state is its defaults, state and groups."""

    def __init__(self) -> None:
        self.stepping = False

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.stepping:
            raise OptimizerStepRefused(
                "the script called optimizer.step(): under Tidal the Trainer steps the "
                "optimizer once per committed step, after the gradients are synchronised; "
                "remove the call (and its zero_grad()), and call step.backward(loss) only"
            )

    @classmethod
    def on(cls, optimizer: torch.optim.Optimizer) -> _OnlyHere:
        """The optimizer's guard, registered once however many Trainers share it."""
        guard = getattr(optimizer, "_tidal_only_here", None)
        if guard is None:
            guard = cls()
            optimizer.register_step_pre_hook(guard)
            optimizer._tidal_only_here = guard
        return guard


@dataclass(kw_only=True)
class Update:
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any | None = None
    grad_scaler: torch.amp.GradScaler | None = None
    clip_grad_norm: float | None = None
    hooks: list[Callable[[int], None]] = field(default_factory=list)
    _only_here: _OnlyHere = field(init=False, repr=False)
    _epoch_at_begin: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        c = self.clip_grad_norm
        if c is not None and not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
            raise ValueError(f"clip_grad_norm must be a positive finite number, got {c!r}")
        s = self.grad_scaler
        if s is not None and not all(
            callable(getattr(s, m, None)) for m in ("scale", "unscale_", "step", "update")
        ):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got {type(s).__name__}")
        if self.lr_scheduler is not None and not callable(getattr(self.lr_scheduler, "step", None)):
            raise ValueError(
                f"lr_scheduler must have a step() method, got {type(self.lr_scheduler).__name__}"
            )

        self._only_here = _OnlyHere.on(self.optimizer)  # once the settings are valid

    def tracked(self, state: Mapping[str, Any] | None) -> dict[str, Any]:
        """The objects a Trainer tracks: the scheduler, the scaler and the user's ``state``."""
        state = dict(state or {})
        clash = [n for n in RESERVED if n in state]
        if clash:
            raise ValueError(
                f"state= may not use the names {clash}: pass those objects as "
                "lr_scheduler= and grad_scaler="
            )
        own = {"lr_scheduler": self.lr_scheduler, "grad_scaler": self.grad_scaler}
        return {**{k: v for k, v in own.items() if v is not None}, **state}

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss

    def begin(self) -> None:
        """A step's body is about to run: note where the scheduler stands."""
        self._epoch_at_begin = getattr(self.lr_scheduler, "last_epoch", None)

    def apply(self, index: int, *, grad_norm: float | None = None) -> None:
        """Apply committed step ``index``: see the module contract. ``grad_norm``: the norm
        of the whole gradient when this member holds only a shard of it (``sharding="fsdp"``
        computes it with the step's control all-reduce); None: computed here."""
        opt, scaler = self.optimizer, self.grad_scaler
        moved = getattr(self.lr_scheduler, "last_epoch", None)
        begun, self._epoch_at_begin = self._epoch_at_begin, None
        if begun is not None and moved != begun:
            raise SchedulerStepRefused(
                f"the script stepped the lr_scheduler during step {index} (its last_epoch went "
                f"from {begun} to {moved}): the Trainer steps it once per "
                "committed step; remove the script's lr_scheduler.step()"
            )
        if scaler is not None:
            scaler.unscale_(opt)
        if self.clip_grad_norm is not None:
            params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            if grad_norm is None:
                torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
            else:  # clip_grad_norm_'s coefficient, on each member's shard
                coef = min(1.0, self.clip_grad_norm / (grad_norm + 1e-6))
                for p in params:
                    getattr(p.grad, "_local_tensor", p.grad).mul_(coef)
        self._only_here.stepping = True
        try:
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        finally:
            self._only_here.stepping = False
        opt.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        for hook in self.hooks:
            hook(index)
