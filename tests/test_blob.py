"""The heal's blob (``tidal.worker.state.blob``): every value comes back with its type and its
bits, as tagged JSON, with raw bytes after it for tensors; anything else is refused, never
pickled."""

from __future__ import annotations

import math
import pickle
import random

import pytest
import torch

from tidal.worker.state import blob

ADAM_GROUPS = torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), 1e-3).state_dict()[
    "param_groups"
]


def same(a, b) -> bool:
    """Equal values of equal types all the way down (floats bit for bit, NaN included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or (a != a and b != b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(
            same(a[k], b[k]) and type(k) is type(j) for k, j in zip(a, b, strict=True)
        )
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize(
    "meta, kind",
    [
        ({"a": 1, "b": 2.5, "c": None, "d": "x", "e": True, "f": False}, blob.JSON),
        ({"betas": (0.9, 0.999), "nested": [(1, [2.0, (3,)])]}, blob.JSON),
        ({"state": {0: {"m": {"tensor": 0}}, 7: {"v": {"value": 3}}}}, blob.JSON),  # int keys
        ({"f": [math.inf, -math.inf, math.nan, -0.0, 5e-324, 0.1 + 0.2]}, blob.JSON),
        ({"big": 2**80, "neg": -(2**63)}, blob.JSON),
        ({"rng": torch.get_rng_state(), "none": torch.empty(0, dtype=torch.uint8)}, blob.JSON),
        ({"groups": ADAM_GROUPS}, blob.JSON),
        ({"py": random.getstate()}, blob.JSON),
        ({"lr": torch.tensor(0.1)}, blob.RAW),  # a float tensor: its bytes after the JSON
        ({"x": torch.Size([2, 3])}, blob.JSON),
        ({"mixed": {1: "a", "b": 2, (3, 4): None}}, blob.JSON),  # keys of several types
        ({"u8_2d": torch.zeros(2, 2, dtype=torch.uint8)}, blob.RAW),
        (
            {
                "buffers": {"w": torch.randn(3, 4, dtype=torch.float64), "e": torch.ones(0)},
                "odd": [torch.tensor([True, False]), torch.arange(6).reshape(2, 3).t()],
                "half": torch.randn(5).to(torch.bfloat16),
                "rng": torch.get_rng_state(),
            },
            blob.RAW,
        ),
    ],
)
def test_every_value_comes_back_with_its_type_and_bits(meta, kind):
    data = blob.encode(meta)
    assert data[:1] == kind
    assert same(blob.decode(data), meta)


def test_a_blob_holding_pickled_code_is_refused():
    """No format of a blob unpickles: a pickle under any first byte is refused by name,
    and so is a value no format carries (never pickled instead)."""
    for kind in (b"T", b"P", blob.RAW):
        with pytest.raises(ValueError, match="not a heal blob"):
            blob.decode(kind + pickle.dumps(print, protocol=2))
    with pytest.raises(ValueError, match="not a heal blob"):
        blob.decode(blob.JSON + b'{"zz": 1}')
    with pytest.raises(TypeError, match="not a builtin_function_or_method"):
        blob.encode({"f": print})


def test_a_decoded_tensor_owns_its_memory():
    data = blob.encode({"t": torch.arange(4.0)})
    got = blob.decode(data)["t"]
    got.add_(1)  # writable, and not a view of the bytes
    assert torch.equal(blob.decode(data)["t"], torch.arange(4.0))
