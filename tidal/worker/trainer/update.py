"""What a committed step does to the state: the optimizer step and what hangs on it.

Runs once per committed step, after this member's gradient all-reduce completed, so every
member sees the same synchronised gradients and makes the same decisions:

1. with a GradScaler: unscale the gradients (which also finds inf/NaN in them); when the
   step's losses are item sums (``step.backward(loss, items=n)``), divide the summed
   gradients by the global batch's item count (``items``; a count of 0 leaves them 0);
2. note the gradients' total norm (``grad_norm``); with ``clip_grad_norm``, clip the
   optimizer's parameters' gradients to that total norm;
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
Likewise the GradScaler's own methods called by the script (``_ScalerGuard``), a step with
gradients that no ``step.backward`` made (``BackwardBypassed``: a bare ``loss.backward()``
is not weighted by the micro-batch's share), and a scheduler whose ``step`` needs a metric
(``ReduceLROnPlateau``, refused when the Trainer is made): each refused at the first step
it would change, in one line naming the fix.
"""

from __future__ import annotations

import inspect
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


class ScalerCallRefused(RuntimeError):
    """The script called the Trainer's GradScaler itself (``_ScalerGuard``)."""


class BackwardBypassed(RuntimeError):
    """A step has gradients but ``step.backward`` was never called in it."""


class _ScalerGuard:
    """The Trainer owns its GradScaler: ``step.backward`` scales each loss, ``Update.apply``
    unscales, steps and updates. A script ported from a plain AMP loop that still calls
    ``scaler.scale(loss)`` would scale twice, silently (the scale cancels in ``unscale_`` only
    once); ``unscale_`` or ``update`` would move the scale on one member. So the instance's
    public methods refuse any call, at the first, and the Trainer calls the originals kept
    here. Installed once per scaler, however many Trainers share it."""

    GUARDED = ("scale", "unscale_", "step", "update")

    def __init__(self, scaler: Any) -> None:
        self.original = {m: getattr(scaler, m) for m in self.GUARDED}
        for m in self.GUARDED:
            setattr(scaler, m, self._refuse(m))

    @staticmethod
    def _refuse(method: str) -> Callable[..., Any]:
        fix = {
            "scale": "call step.backward(loss) with the unscaled loss",
            "unscale_": "pass clip_grad_norm= to the Trainer instead of clipping yourself",
            "step": "remove it: the Trainer steps the optimizer",
            "update": "remove it: the Trainer updates the scale once per committed step",
        }[method]

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ScalerCallRefused(
                f"the script called grad_scaler.{method}(): the Trainer owns the GradScaler "
                f"(it scales each loss in step.backward and unscales, steps and updates once "
                f"per committed step); {fix}"
            )

        return refuse

    @classmethod
    def on(cls, scaler: Any) -> _ScalerGuard:
        guard = getattr(scaler, "_tidal_guard", None)
        if guard is None:
            guard = cls(scaler)
            scaler._tidal_guard = guard
        return guard


def _needs_argument(step: Callable[..., Any]) -> bool:
    """Whether ``step`` cannot be called without arguments (``ReduceLROnPlateau.step(metrics)``)."""
    try:
        params = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        for p in params
    )


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
    #: ``step.backward`` calls in the step in flight (a step with gradients and none was
    #: computed by a bare ``loss.backward()``: ``BackwardBypassed``).
    backwards: int | None = field(default=None, init=False, repr=False)
    #: The global batch's item count when the step's losses are item sums
    #: (``step.backward(loss, items=n)``): the summed gradients are divided by it.
    items: float | None = field(default=None, init=False, repr=False)
    #: The last committed step's gradient norm before clipping (after unscaling, of the
    #: synchronised gradients, so the same on every member): a float or a 0-dim tensor
    #: (read on demand: no device sync per step), None before the first step.
    grad_norm: float | torch.Tensor | None = field(default=None, init=False, repr=False)
    #: Without clipping, the norm costs a pass over the gradients: measured from the first
    #: time the script reads it (``Trainer.grad_norm``), not on every job's hot path.
    measure_norm: bool = field(default=False, init=False, repr=False)
    #: Committed steps: the next step's index (``commit``; a heal, resume or roll-back
    #: sets it with ``restore``).
    step: int = field(default=0, init=False)
    #: This member holds the job's state at ``step`` (False before its first heal, resume
    #: or step, and after a heal cut while it received: ``forget``).
    has_state: bool = field(default=False, init=False)
    _only_here: _OnlyHere = field(init=False, repr=False)
    _scaler: dict[str, Callable[..., Any]] | None = field(default=None, init=False, repr=False)
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
        sched = self.lr_scheduler
        if sched is not None and not callable(getattr(sched, "step", None)):
            raise ValueError(f"lr_scheduler must have a step() method, got {type(sched).__name__}")
        if sched is not None and _needs_argument(sched.step):
            raise ValueError(
                f"lr_scheduler {type(sched).__name__}.step() needs an argument (a metric): the "
                "Trainer steps lr_scheduler= once per committed step with none. Pass a "
                "schedule of the step count (LambdaLR, CosineAnnealingLR, ...), or keep it out "
                "of lr_scheduler= and step it yourself with a value every member shares "
                "(trainer.evaluate's means), carried by state={'plateau': it}"
            )
        self._only_here = _OnlyHere.on(self.optimizer)  # once the settings are valid
        self._scaler = _ScalerGuard.on(s).original if s is not None else None

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
        return self._scaler["scale"](loss) if self._scaler is not None else loss

    def begin(self) -> None:
        """A step's body is about to run: note where the scheduler stands."""
        self._epoch_at_begin = getattr(self.lr_scheduler, "last_epoch", None)
        self.backwards, self.items = 0, None

    def commit(self, *, grad_norm: float | None = None) -> None:
        """Apply the step in flight (``apply``) and count it committed."""
        self.apply(self.step, grad_norm=grad_norm)
        self.step += 1
        self.has_state = True

    def restore(self, step: int) -> None:
        """This member now holds the job's state at committed step ``step`` (healed,
        resumed, rolled back)."""
        self.step, self.has_state = step, True

    def forget(self) -> None:
        """What this member holds is no source for anyone (a heal cut mid-transfer)."""
        self.has_state = False

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
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if self.backwards == 0 and params:
            raise BackwardBypassed(
                f"step {index} has gradients but step.backward() was never called: the "
                "script called loss.backward() itself, so the loss was not weighted by its "
                "share of the global batch; call step.backward(loss) for each micro-batch"
            )
        items, self.items, self.backwards = self.items, None, None
        if scaler is not None:
            self._scaler["unscale_"](opt)
        if items is not None:  # the steps' losses are item sums: the global mean
            for p in params:
                p.grad.div_(max(items, 1.0))
        if grad_norm is not None:  # a sharded step's, from its control all-reduce
            self.grad_norm = grad_norm
        elif self.clip_grad_norm is not None:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        elif self.measure_norm:  # a pass over the gradients: only once the script asked
            self.grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.clip_grad_norm is not None and grad_norm is not None:
            # clip_grad_norm_'s coefficient, on each member's shard
            coef = min(1.0, self.clip_grad_norm / (grad_norm + 1e-6))
            for p in params:
                getattr(p.grad, "_local_tensor", p.grad).mul_(coef)
        self._only_here.stepping = True
        try:
            if scaler is not None:
                self._scaler["step"](opt)
                self._scaler["update"]()
            else:
                opt.step()
        finally:
            self._only_here.stepping = False
        opt.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        for hook in self.hooks:
            hook(index)
