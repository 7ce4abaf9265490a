"""The heal's blob: what a receiver needs before the tensors (the optimizer's structure, the
RNG states, the tracked objects' JSON, the model's layout, a same-host offer), as bytes; and
the sharded heal's replicated part (``sharded.replicated_blob``), tensors included.

No pickle, ever. Plain values travel as tagged JSON: ``None``, ``bool``, ``int``,
``float``, ``str`` (their exact types, never a subclass such as a NumPy scalar), lists,
tuples (``{"t": [...]}``), dicts with string keys (``{"d": {...}}``), integer keys
(``{"i": [[k, v], ...]}``) or keys of other plain types (``{"p": [[k, v], ...]}``),
``torch.Size`` (``{"s": [...]}``) and CPU ``uint8`` vectors, which RNG states are
(``{"u8": base64}``). Each decodes to a value of the same type and equal bits (a float's
``repr`` is exact, infinities and NaN included). A blob holding any other tensor (a learning
rate held as a tensor, buffers, a sharded heal's tracked state) is written as ``RAW``: the
same JSON, each tensor a reference ``{"x": [dtype, shape, offset, nbytes]}`` into the raw
bytes that follow it, its bits as they are in memory (decoded on the CPU: the receiver
copies them where they belong). Anything else is refused with ``TypeError`` naming it:
never carried by a format that runs code when it is read.

The first byte says which (``JSON`` or ``RAW``); a ``RAW`` blob's next eight bytes are its
JSON's length (little-endian). Decoding never runs code from the bytes: JSON, base64, raw
tensor bytes.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import torch

JSON, RAW = b"J", b"R"
_LEN = struct.Struct("<Q")


class _Tail:
    """The tensors of a ``RAW`` blob as they are encoded: their bytes, in order."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, t: torch.Tensor) -> list:
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        ref = [str(t.dtype).removeprefix("torch."), list(t.shape), self.size, len(data)]
        self.parts.append(data)
        self.size += len(data)
        return ref


def encode(meta: dict[str, Any]) -> bytes:
    """``meta`` as bytes ``decode`` returns equal (module doc); ``TypeError`` for a value no
    format carries."""
    tail = _Tail()
    head = json.dumps(_plain(meta, tail), separators=(",", ":")).encode()
    if not tail.parts:
        return JSON + head
    return b"".join([RAW, _LEN.pack(len(head)), head, *tail.parts])


def decode(data: bytes) -> dict[str, Any]:
    """What ``encode`` was given; ``ValueError`` for bytes it did not write."""
    kind = data[:1]
    if kind == JSON:
        return _value(json.loads(data[1:]), None)
    if kind == RAW and len(data) >= 1 + _LEN.size:
        (n,) = _LEN.unpack_from(data, 1)
        start = 1 + _LEN.size
        try:
            head = json.loads(bytes(data[start : start + n]))
        except ValueError:
            raise ValueError("not a heal blob (its JSON does not parse)") from None
        return _value(head, memoryview(data)[start + n :])
    raise ValueError(f"not a heal blob (first byte {kind!r})")


def _plain(v: Any, tail: _Tail) -> Any:
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if t is list:
        return [_plain(x, tail) for x in v]
    if t is tuple:
        return {"t": [_plain(x, tail) for x in v]}
    if t is torch.Size:
        return {"s": list(v)}
    if t is dict:
        keys = {type(k) for k in v}
        if keys <= {str}:
            return {"d": {k: _plain(x, tail) for k, x in v.items()}}
        if keys == {int}:
            return {"i": [[k, _plain(x, tail)] for k, x in v.items()]}
        return {"p": [[_plain(k, tail), _plain(x, tail)] for k, x in v.items()]}
    if t is torch.Tensor and v.dtype == torch.uint8 and v.device.type == "cpu" and v.dim() == 1:
        return {"u8": base64.b64encode(v.contiguous().numpy().tobytes()).decode()}
    if t is torch.Tensor:
        return {"x": tail.add(v)}
    raise TypeError(
        f"a heal blob carries plain values and tensors only, not a {t.__name__} (no pickle)"
    )


def _tensor(ref: list, body: memoryview | None) -> torch.Tensor:
    if body is None:
        raise ValueError("not a heal blob (a tensor reference without raw bytes)")
    dtype_name, shape, offset, nbytes = ref
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype) or offset + nbytes > len(body):
        raise ValueError(f"not a heal blob (tensor {ref!r})")
    raw = (
        torch.frombuffer(bytearray(body[offset : offset + nbytes]), dtype=torch.uint8)
        if nbytes
        else torch.empty(0, dtype=torch.uint8)
    )
    return raw.view(dtype).reshape(shape)


def _value(v: Any, body: memoryview | None) -> Any:
    if type(v) is list:
        return [_value(x, body) for x in v]
    if type(v) is not dict:
        return v
    ((tag, inner),) = v.items()
    if tag == "t":
        return tuple(_value(x, body) for x in inner)
    if tag == "s":
        return torch.Size(inner)
    if tag == "d":
        return {k: _value(x, body) for k, x in inner.items()}
    if tag in ("i", "p"):
        return {_value(k, body): _value(x, body) for k, x in inner}
    if tag == "x":
        return _tensor(inner, body)
    if tag == "u8":
        raw = base64.b64decode(inner)
        return (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
    raise ValueError(f"not a heal blob (tag {tag!r})")
