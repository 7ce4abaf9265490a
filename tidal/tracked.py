"""Tracked state: the named objects a training loop carries besides the model and optimizer.

An LR scheduler, a GradScaler, an EMA model, a user's own counters: anything with
``state_dict()`` and ``load_state_dict()`` (DCP's ``Stateful`` protocol). Tidal heals them to
joiners and laggards with the model, writes them into every checkpoint, loads them on
``tidal resume``, and rewinds them when a step fails. Contracts:

- **No pickle.** A state dict is split into a JSON skeleton (``None``, bools, ints, strings,
  floats, lists, tuples, dicts) and its tensors, which travel and are stored raw
  (safetensors on disk). Anything else in a state dict is refused when the Trainer is made
  (``TrackedState.check``), naming the object and the path to the value, not at the first
  checkpoint hours later.
- **A failed step leaves no trace.** ``mark`` before each step records every object's
  skeleton (by value) and its tensors' version counters; ``rewind`` after a failed step
  loads the marked skeleton back into each object whose state moved. Tensors are not copied
  each step (an EMA model would double the step's memory traffic): a tracked tensor changed
  in place during a step that failed cannot be rewound, and is refused loudly. Change
  tracked tensors only after the optimizer step (``Trainer.after_step``), where a step is
  already committed.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# Keys of the JSON skeleton's tagged values; a user dict with a key starting "__" is written
# in the tagged pair form, so it is never mistaken for one of them.
_TENSOR, _TUPLE, _FLOAT, _PAIRS = "__tensor__", "__tuple__", "__float__", "__pairs__"


class Stateful(Protocol):
    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> Any: ...


class UnsupportedState(TypeError):
    """A state dict holds a value that cannot be carried without pickle."""


def flatten(value: Any, tensors: list[torch.Tensor], path: str = "") -> Any:
    """``value`` as a JSON-able skeleton; its tensors are appended to ``tensors`` (not copied)
    and replaced by their index."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {_FLOAT: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return flatten(value.item(), tensors, path)  # a numpy scalar: its Python value
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {_TENSOR: len(tensors) - 1}
    if isinstance(value, list):
        return [flatten(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TUPLE: [flatten(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: flatten(v, tensors, f"{path}[{k!r}]") for k, v in value.items()}
        return {
            _PAIRS: [
                [flatten(k, tensors, f"{path}<key>"), flatten(v, tensors, f"{path}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    raise UnsupportedState(
        f"{path or 'the state'} is a {type(value).__name__}, which cannot be saved without "
        "pickle: a state_dict may hold tensors, numbers, strings, None, and lists, tuples "
        "and dicts of them"
    )


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of ``flatten``."""
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return tensors[skeleton[_TENSOR]]
        if _TUPLE in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton[_TUPLE])
        if _FLOAT in skeleton:
            return float(skeleton[_FLOAT])
        if _PAIRS in skeleton:
            return {unflatten(k, tensors): unflatten(v, tensors) for k, v in skeleton[_PAIRS]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    return skeleton


@dataclass(frozen=True)
class Captured:
    """Every tracked object's state: ``skeleton[name]`` refers to ``tensors`` by index."""

    skeleton: dict[str, Any]
    tensors: list[torch.Tensor]

    def layout(self) -> list[tuple[list[int], str]]:
        """Shapes and dtypes of the tensors: what a receiver allocates."""
        return [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in self.tensors]

    def to_json(self) -> str:
        return json.dumps({"skeleton": self.skeleton, "tensors": self.layout()}, sort_keys=True)


@dataclass(frozen=True)
class Mark:
    """What ``rewind`` restores: skeletons by value (``flatten`` builds new containers around
    immutable leaves, so a skeleton is already a deep copy), tensors by version counter. A
    module's whole state is its tensors: only their versions are kept (cheap on the hot path:
    no ``state_dict()`` of an EMA model every step)."""

    skeleton: dict[str, Any]
    versions: dict[str, list[int]]


def _module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return list(itertools.chain(module.parameters(), module.buffers()))


class TrackedState:
    """The named ``Stateful`` objects of a Trainer, in a fixed order."""

    def __init__(self, objects: Mapping[str, Stateful]) -> None:
        for name, obj in objects.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ValueError(f"tracked state names must be non-empty strings, got {name!r}")
            missing = [
                m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))
            ]
            if missing:
                raise ValueError(
                    f"tracked state {name!r} ({type(obj).__name__}) has no "
                    f"{' or '.join(missing)}(): pass objects with state_dict() and "
                    "load_state_dict() (a scheduler, a GradScaler, a module, your own class)"
                )
        self.objects = dict(objects)
        # A module's tensors, listed once: walking its submodules every step costs ~4 us a
        # tensor, reading a version counter ~0.3 us. ``load_state_dict`` copies into them.
        self._module_tensors = {
            name: _module_tensors(obj)
            for name, obj in self.objects.items()
            if isinstance(obj, torch.nn.Module)
        }

    def __bool__(self) -> bool:
        return bool(self.objects)

    @property
    def names(self) -> list[str]:
        return list(self.objects)

    def capture(self) -> Captured:
        """Every object's current state (tensors by reference: copy them before they change)."""
        tensors: list[torch.Tensor] = []
        skeleton = {}
        for name, obj in self.objects.items():
            try:
                skeleton[name] = flatten(obj.state_dict(), tensors, name)
            except UnsupportedState as exc:
                raise UnsupportedState(f"tracked state {exc}") from None
        return Captured(skeleton=skeleton, tensors=tensors)

    def check(self) -> None:
        """Refuse now, not at the first checkpoint, what cannot be carried."""
        self.capture()

    def restore(self, skeleton: Mapping[str, Any], tensors: list[torch.Tensor]) -> None:
        """Load a captured state (from a peer or a checkpoint) into the objects. Refuses a
        state whose names are not this Trainer's: loading part of it would diverge."""
        if sorted(skeleton) != sorted(self.objects):
            raise ValueError(
                f"the saved tracked state holds {sorted(skeleton)} but this Trainer tracks "
                f"{sorted(self.objects)}: pass the same state= (and lr_scheduler=, "
                "grad_scaler=) as the run that saved it"
            )
        for name, obj in self.objects.items():
            obj.load_state_dict(unflatten(skeleton[name], tensors))

    def mark(self) -> Mark:
        skeleton: dict[str, Any] = {}
        versions: dict[str, list[int]] = {}
        for name, obj in self.objects.items():
            if name in self._module_tensors:
                skeleton[name] = None
                versions[name] = [t._version for t in self._module_tensors[name]]
                continue
            tensors: list[torch.Tensor] = []
            skeleton[name] = flatten(obj.state_dict(), tensors, name)
            versions[name] = [t._version for t in tensors]
        return Mark(skeleton=skeleton, versions=versions)

    def rewind(self, mark: Mark) -> list[str]:
        """Undo what a failed step did to the objects; returns the names rewound. Raises
        ``RuntimeError`` if a tracked tensor was changed in place (see the module doc)."""
        rewound = []
        for name, obj in self.objects.items():
            tensors: list[torch.Tensor] = []
            if name in self._module_tensors:
                now, versions = None, [t._version for t in self._module_tensors[name]]
            else:
                now = flatten(obj.state_dict(), tensors, name)
                versions = [t._version for t in tensors]
            if versions != mark.versions[name]:
                raise RuntimeError(
                    f"tracked state {name!r} changed a tensor in place during a step that "
                    "failed and must be redone; it cannot be rewound. Change tracked tensors "
                    "after the optimizer step (trainer.after_step), not inside the step"
                )
            if now != mark.skeleton[name]:
                obj.load_state_dict(unflatten(mark.skeleton[name], tensors))
                rewound.append(name)
        return rewound
