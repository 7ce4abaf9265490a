"""The heal's blob: what a receiver needs before the tensors (the optimizer's structure, the
RNG states, the tracked objects' JSON, the model's layout, a same-host offer), as bytes.

Plain values travel as tagged JSON: ``None``, ``bool``, ``int``, ``float``, ``str`` (their
exact types, never a subclass such as a NumPy scalar), lists, tuples (``{"t": [...]}``),
dicts with string keys (``{"d": {...}}``) or integer keys (``{"i": [[k, v], ...]}``), and
CPU ``uint8`` tensors, which RNG states are (``{"u8": base64}``). Each decodes to a value
of the same type and equal bits (a float's ``repr`` is exact, infinities and NaN
included), so nothing is rounded or retyped on the way. A blob holding anything else (a
learning rate held as a tensor, an optimizer state kept as a list of tensors) travels as
``torch.save`` bytes, loaded with ``weights_only=True`` (tensors and plain containers,
never arbitrary pickles), as every blob did before: ``torch.save`` and its loader cost
~0.3 and ~0.5 ms on an idle core for a typical blob, three times that on the busy cores of
a change, on the critical path of every heal (the source writes it, the joiners wait).
The first byte says which (``JSON`` or ``TORCH``).

Decoding never runs code from the bytes: JSON, base64, or the weights-only unpickler.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import torch

JSON, TORCH = b"J", b"T"


class _NotPlain(Exception):
    """A value tagged JSON does not carry exactly: the blob goes as ``torch.save``."""


def encode(meta: dict[str, Any]) -> bytes:
    """``meta`` as bytes ``decode`` returns equal (module doc)."""
    try:
        return JSON + json.dumps(_plain(meta), separators=(",", ":")).encode()
    except _NotPlain:
        buf = io.BytesIO()
        torch.save(meta, buf)
        return TORCH + buf.getvalue()


def decode(data: bytes) -> dict[str, Any]:
    """What ``encode`` was given; ``ValueError`` for bytes it did not write."""
    kind, body = data[:1], data[1:]
    if kind == JSON:
        return _value(json.loads(body))
    if kind == TORCH:
        return torch.load(io.BytesIO(body), weights_only=True)
    raise ValueError(f"not a heal blob (first byte {kind!r})")


def _plain(v: Any) -> Any:
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if t is list:
        return [_plain(x) for x in v]
    if t is tuple:
        return {"t": [_plain(x) for x in v]}
    if t is dict:
        keys = {type(k) for k in v}
        if keys <= {str}:
            return {"d": {k: _plain(x) for k, x in v.items()}}
        if keys == {int}:
            return {"i": [[k, _plain(x)] for k, x in v.items()]}
    if t is torch.Tensor and v.dtype == torch.uint8 and v.device.type == "cpu" and v.dim() == 1:
        return {"u8": base64.b64encode(v.contiguous().numpy().tobytes()).decode()}
    raise _NotPlain


def _value(v: Any) -> Any:
    if type(v) is list:
        return [_value(x) for x in v]
    if type(v) is not dict:
        return v
    ((tag, body),) = v.items()
    if tag == "t":
        return tuple(_value(x) for x in body)
    if tag == "d":
        return {k: _value(x) for k, x in body.items()}
    if tag == "i":
        return {k: _value(x) for k, x in body}
    if tag == "u8":
        raw = base64.b64decode(body)
        return (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
    raise ValueError(f"not a heal blob (tag {tag!r})")
