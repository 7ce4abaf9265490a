"""The heal's blob (``tidal.worker.blob``): every value comes back with its type and its
bits, as tagged JSON where it can and as weights-only ``torch.save`` bytes where it cannot."""

from __future__ import annotations

import math
import pickle
import random

import pytest
import torch

from tidal.worker import blob

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
        ({"lr": torch.tensor(0.1)}, blob.TORCH),  # a float tensor: not plain
        ({"x": torch.Size([2, 3])}, blob.TORCH),  # a tuple's subclass: its type would be lost
        ({"mixed": {1: "a", "b": 2}}, blob.TORCH),  # keys of two types
        ({"u8_2d": torch.zeros(2, 2, dtype=torch.uint8)}, blob.TORCH),
    ],
)
def test_every_value_comes_back_with_its_type_and_bits(meta, kind):
    data = blob.encode(meta)
    assert data[:1] == kind
    assert same(blob.decode(data), meta)


def test_a_blob_holding_pickled_code_is_refused():
    """The fallback is loaded weights-only: a pickle of anything callable is refused, and
    bytes that neither format wrote are refused by name."""
    evil = blob.TORCH + pickle.dumps(print, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        blob.decode(evil)
    with pytest.raises(ValueError, match="not a heal blob"):
        blob.decode(b"P" + pickle.dumps({}))
    with pytest.raises(ValueError, match="not a heal blob"):
        blob.decode(blob.JSON + b'{"zz": 1}')
