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
  skeleton (by value) and keeps a copy of its tensors; ``rewind`` after a failed step puts
  back each object whose state moved: a module's changed tensors are copied back in place,
  another object is given its marked state (skeleton and copies) by ``load_state_dict``.
  So an EMA, running statistics or a counter tensor may be changed in place anywhere: in
  the step body (``ema.update_parameters(model)`` after the micro-batches) or in
  ``Trainer.after_step``.
- **The cost is one copy of what changed.** The copies are allocated at the first ``mark``
  (memory: one extra copy of every tracked tensor, e.g. a second EMA model); each later
  ``mark`` refreshes only the copies whose tensor was changed since it was copied (its
  version counter moved, or it was replaced), so a tensor the script changes every step is
  copied once a step and an untouched one never again. ``last_copied`` counts the tensors
  the latest ``mark`` copied.
- **Changes no version counter shows.** A BatchNorm's forward updates its running
  statistics inside its kernel, and an update through ``tensor.data`` bypasses autograd:
  neither moves a version counter. A submodule's buffers count as one (a BatchNorm's
  ``num_batches_tracked`` moves with an ``add_``). The marks after the first three steps,
  then every ``AUDIT_EVERY``-th, compare the tensors whose versions stood still with their
  copies; one that changed anyway is copied and restored at every step from then on. A
  failed step whose tensor changed that way since its copy was refreshed or audited at
  the step's mark is rewound too. What is left: such a change that starts later, to a
  tensor copied before the step's mark, in a step that fails before an audit finds it;
  it cannot be told from a change before the mark, and ``rewind`` refuses it, naming the
  tensor (update tracked tensors in place under ``torch.no_grad()``, not via ``.data``).
"""

from __future__ import annotations

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
    immutable leaves, so a skeleton is already a deep copy; a module's is None: its state is
    its tensors) and, through ``serial``, the copies that ``TrackedState`` took at this mark
    (only the latest mark can be rewound to)."""

    serial: int
    skeleton: dict[str, Any]


# Marks that compare unmoved tensors with their copies (the module doc's changes no version
# counter shows): those after the first steps, where a script's per-step pattern shows
# itself, then one in ``AUDIT_EVERY`` (a read of the untouched tensors, and on a GPU a
# synchronisation, amortised over that many steps).
AUDIT_MARKS = range(2, 5)
AUDIT_EVERY = 64


def audited(serial: int) -> bool:
    return serial in AUDIT_MARKS or serial % AUDIT_EVERY == 0


def _fits(copy: torch.Tensor, t: torch.Tensor) -> bool:
    return copy.shape == t.shape and copy.dtype == t.dtype and copy.device == t.device


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN."""
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(torch.where(a.isnan(), b.isnan(), a == b).all())


class _Copies:
    """One object's tensors as of the latest mark, by position: a copy of each, and what
    says whether the tensor moved since: its address and version counter when copied.

    The tensor copied from is held (a ``detach()``: the same memory, kept alive), so no
    other tensor can appear at its address: a tensor at the same address is the same
    memory (a ``state_dict`` may hand out a new ``detach()`` of it at each call), and one
    the script replaced (``module.buf = ...``, ``p.data = ...``) shows a new address.

    ``groups``: positions that move together, so one that moved means all did: a
    submodule's buffers (a BatchNorm's forward updates ``running_mean`` and ``running_var``
    inside its kernel, which moves no version counter, and ``num_batches_tracked`` with an
    ``add_``, which does)."""

    def __init__(self, groups: list[list[int]] | None = None) -> None:
        self.groups = groups or []
        self.copies: list[torch.Tensor] = []
        self.held: list[torch.Tensor] = []
        self.ptrs: list[int] = []
        self.versions: list[int] = []
        self.taken: list[int] = []  # the mark at which each copy was last refreshed
        self.unversioned: set[int] = set()  # changed with no version bump: copied every mark

    def note(self, i: int, t: torch.Tensor) -> None:
        """``t`` (position ``i``) equals its copy now."""
        self.held[i], self.ptrs[i], self.versions[i] = t.detach(), t.data_ptr(), t._version

    def moved(self, tensors: list[torch.Tensor]) -> list[bool]:
        """Which of ``tensors`` changed since copied, as far as addresses, version counters
        and ``groups`` tell."""
        versions, ptrs, unversioned = self.versions, self.ptrs, self.unversioned
        moved = [
            t._version != versions[i] or t.data_ptr() != ptrs[i] or i in unversioned
            for i, t in enumerate(tensors)
        ]
        for group in self.groups:
            if any(moved[i] for i in group):
                for i in group:
                    moved[i] = True
        return moved

    def refresh(self, tensors: list[torch.Tensor], serial: int, audit: bool) -> int:
        """Make the copies those of ``tensors`` at mark ``serial``, copying only what moved
        (and, when ``audit``, what differs from its copy); the count copied."""
        if len(tensors) != len(self.copies):  # first mark, or the object's layout changed
            self.copies = [t.detach().clone() for t in tensors]
            self.held = [t.detach() for t in tensors]
            self.ptrs = [t.data_ptr() for t in tensors]
            self.versions = [t._version for t in tensors]
            self.taken = [serial] * len(tensors)
            self.unversioned.clear()
            return len(tensors)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        copies, ptrs, versions, taken = self.copies, self.ptrs, self.versions, self.taken
        for i, (t, moved) in enumerate(zip(tensors, self.moved(tensors), strict=True)):
            if moved:
                if t.data_ptr() != ptrs[i]:  # replaced: hold the new memory
                    if not _fits(copies[i], t):
                        copies[i] = torch.empty_like(t, requires_grad=False)
                    self.held[i], ptrs[i] = t.detach(), t.data_ptr()
            elif audit and not _equal(copies[i], t):
                self.unversioned.add(i)
            else:
                continue
            versions[i], taken[i] = t._version, serial
            dst.append(copies[i])
            src.append(t)  # under no_grad: nothing recorded
        if dst:
            torch._foreach_copy_(dst, src)
        return len(dst)

    def since(
        self, name: str, tensors: list[torch.Tensor], serial: int, labels: list[str] | None = None
    ) -> list[int]:
        """The positions that moved since mark ``serial`` (the latest): what a rewind puts
        back. One whose version stood still but differs from its copy moved too when the
        copy is known to be that mark's (taken or audited then; it is copied at every mark
        from now on); else it cannot be put back (it may have changed before the mark):
        raises ``RuntimeError``."""
        out = []
        for i, (t, moved) in enumerate(zip(tensors, self.moved(tensors), strict=True)):
            if moved:
                out.append(i)
            elif not _equal(self.copies[i], t):
                if self.taken[i] != serial and not audited(serial):
                    what = labels[i] if labels else f"its tensor {i}"
                    raise RuntimeError(
                        f"tracked state {name!r}: {what} changed without its version counter "
                        "moving (an update through .data?) and a step failed since; it "
                        "cannot be rewound. Update tracked tensors in place under "
                        "torch.no_grad(), not through .data"
                    )
                self.unversioned.add(i)
                out.append(i)
        return out


def _slots(module: torch.nn.Module) -> tuple[list[tuple[dict, str, str]], list[list[int]]]:
    """Where each of a module's tensors lives (each tensor once): the ``_parameters`` or
    ``_buffers`` dict of its submodule, its key and its dotted name; and the groups of
    positions that are one submodule's buffers (``_Copies``). Reading a slot costs ~0.1 us
    a tensor, walking the submodules ~4 us; a slot also shows a replaced tensor."""
    seen: set[int] = set()
    slots: list[tuple[dict, str, str]] = []
    groups: list[list[int]] = []
    for prefix, sub in module.named_modules():
        for table in (sub._parameters, sub._buffers):
            at = len(slots)
            for key, t in table.items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    slots.append((table, key, f"{prefix}.{key}" if prefix else key))
            if table is sub._buffers and len(slots) - at > 1:
                groups.append(list(range(at, len(slots))))
    return slots, groups


def _has_extra_state(module: torch.nn.Module) -> bool:
    base = torch.nn.Module.get_extra_state
    return any(type(m).get_extra_state is not base for m in module.modules())


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
        # A module's tensors by slot, listed once (a module with extra state goes the
        # general way: ``state_dict`` at each mark); every object's copies (``mark``).
        self._slots: dict[str, list[tuple[dict, str, str]]] = {}
        self._copies = {}
        for name, obj in self.objects.items():
            groups = None
            if isinstance(obj, torch.nn.Module) and not _has_extra_state(obj):
                self._slots[name], groups = _slots(obj)
            self._copies[name] = _Copies(groups)
        self._serial = 0
        self.last_copied = 0  # tensors the latest ``mark`` copied

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
        """Record what ``rewind`` restores (before each step); see the module doc."""
        self._serial += 1
        audit = audited(self._serial)
        skeleton: dict[str, Any] = {}
        copied = 0
        with torch.no_grad():
            for name, obj in self.objects.items():
                if name in self._slots:
                    skeleton[name] = None
                    tensors = [table[key] for table, key, _ in self._slots[name]]
                else:
                    tensors = []
                    skeleton[name] = flatten(obj.state_dict(), tensors, name)
                copied += self._copies[name].refresh(tensors, self._serial, audit)
        self.last_copied = copied
        return Mark(serial=self._serial, skeleton=skeleton)

    def rewind(self, mark: Mark) -> list[str]:
        """Undo what a failed step did to the objects since ``mark`` (the latest); returns
        the names rewound. Raises ``RuntimeError`` for a change it cannot undo (the module
        doc: a change through ``.data`` found only now)."""
        if mark.serial != self._serial:
            raise ValueError(f"rewind to mark {mark.serial}, but the latest is {self._serial}")
        rewound = []
        with torch.no_grad():
            for name, obj in self.objects.items():
                copies = self._copies[name]
                if name in self._slots:
                    slots = self._slots[name]
                    live = [table[key] for table, key, _ in slots]
                    labels = [label for *_, label in slots]
                    moved = copies.since(name, live, mark.serial, labels)
                    for i in moved:
                        live[i].copy_(copies.copies[i])
                        copies.note(i, live[i])  # equal to its copy again
                    if moved:
                        rewound.append(name)
                    continue
                tensors: list[torch.Tensor] = []
                now = flatten(obj.state_dict(), tensors, name)
                same_layout = len(tensors) == len(copies.copies)
                moved = copies.since(name, tensors, mark.serial) if same_layout else [-1]
                if moved or now != mark.skeleton[name]:
                    # Clones: an object may keep what it is given, and the copies are ours.
                    held = [c.clone() for c in copies.copies]
                    obj.load_state_dict(unflatten(mark.skeleton[name], held))
                    rewound.append(name)
        return rewound
