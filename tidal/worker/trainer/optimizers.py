"""More than one optimizer (a GAN's generator and discriminator): ``Optimizers``.

``Trainer(model, [opt_g, opt_d], ...)`` hands the Trainer several optimizers, each over its
own parameters (a parameter in two of them is refused). They are carried as one:

- ``step()`` steps each in order, ``zero_grad`` clears each; both only through the Trainer
  (each optimizer's own ``step()`` in the script is refused, ``update``'s guard, which is
  registered on each of them);
- ``state_dict()`` is the standard optimizer layout (``state`` by parameter number,
  ``param_groups`` with their parameter numbers), numbered across the optimizers in order,
  so healing, checkpoints and resumes carry every optimizer's state with the code that
  carries one; ``load_state_dict`` cuts it back at the same boundaries, and refuses a state
  whose groups do not fit.

Each optimizer keeps its own class, hyper-parameters and LR scheduler: a scheduler of one
of them is handed as ``lr_scheduler=`` (stepped once per committed step), the others'
stepped in an ``after_step`` hook and carried with ``state=``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class Optimizers:
    """Several optimizers carried as one (module doc)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        if not self.optimizers or not all(
            isinstance(o, torch.optim.Optimizer) for o in self.optimizers
        ):
            raise ValueError(
                "optimizer must be a torch.optim.Optimizer or a non-empty list of them, got "
                f"{[type(o).__name__ for o in self.optimizers]}"
            )
        seen: set[int] = set()
        for p in (p for o in self.optimizers for g in o.param_groups for p in g["params"]):
            if id(p) in seen:
                raise ValueError(
                    "a parameter is in two of the optimizers: give each optimizer its own "
                    "parameters (a generator's and a discriminator's)"
                )
            seen.add(id(p))

    @property
    def kind(self) -> str:
        """The classes, for the settings every member must share (``identity``)."""
        return f"Optimizers({', '.join(type(o).__name__ for o in self.optimizers)})"

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> None:
        for o in self.optimizers:
            o.register_step_pre_hook(hook)

    def _sizes(self) -> list[tuple[int, int]]:
        """(parameters, groups) of each optimizer."""
        return [
            (sum(len(g["params"]) for g in o.param_groups), len(o.param_groups))
            for o in self.optimizers
        ]

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for o, (n, _) in zip(self.optimizers, self._sizes(), strict=True):
            sd = o.state_dict()
            state.update({offset + int(pid): s for pid, s in sd["state"].items()})
            groups += [
                {**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]
            ]
            offset += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups, state = state_dict["param_groups"], state_dict["state"]
        if len(groups) != sum(k for _, k in self._sizes()):
            raise ValueError(
                f"the saved optimizer state has {len(groups)} parameter groups, these "
                f"optimizers {sum(k for _, k in self._sizes())}: pass the same optimizers"
            )
        offset = first = 0
        for o, (n, k) in zip(self.optimizers, self._sizes(), strict=True):
            mine = groups[first : first + k]
            o.load_state_dict(
                {
                    "state": {
                        int(pid) - offset: s
                        for pid, s in state.items()
                        if offset <= int(pid) < offset + n
                    },
                    "param_groups": [
                        {**g, "params": [i - offset for i in g["params"]]} for g in mine
                    ],
                }
            )
            offset, first = offset + n, first + k


def combine(optimizer: Any) -> Any:
    """The Trainer's ``optimizer`` argument as one object: an optimizer as it is, a list or
    tuple of them as ``Optimizers``."""
    if isinstance(optimizer, (list, tuple)):
        return Optimizers(optimizer) if len(optimizer) != 1 else optimizer[0]
    return optimizer
