"""``trainer.evaluate``'s rules (``tidal.worker.trainer.evaluation``), table-tested, and its result
alone against the plain mean over every sample. Split across members and with a member
killed mid-evaluation: ``test_script_forms_e2e.py``."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

import tidal
from tidal.worker.trainer.evaluation import batch_result, batches, combine, owner, take_over


@pytest.mark.parametrize(
    ("n", "size", "expected"),
    [
        (10, 4, [(0, 4), (4, 8), (8, 10)]),
        (8, 4, [(0, 4), (4, 8)]),
        (3, 5, [(0, 3)]),
        (0, 2, []),
    ],
)
def test_batches_cover_the_dataset_in_order(n, size, expected):
    assert [(r.start, r.stop) for r in batches(n, size)] == expected


@pytest.mark.parametrize("size", [0, -1, 2.0, True, None])
def test_a_batch_size_that_is_not_a_positive_integer_is_refused(size):
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        batches(10, size)


@pytest.mark.parametrize(
    ("missing", "members", "dropped", "world", "taken"),
    [
        ([1, 4], [7, 8, 9], {8}, 3, [1, 4]),  # rank 1 (worker 8) owns 1 and 4: dropped
        ([1, 2, 4], [7, 8, 9], {8}, 3, [1, 4]),  # 2 is worker 9's: alive, awaited
        ([1, 2], [7, 8, 9], set(), 3, []),  # nobody dropped: wait
        ([0, 1, 2, 3], [5, 6], {5, 6}, 2, [0, 1, 2, 3]),  # everyone else gone
    ],
)
def test_a_reader_takes_over_the_batches_of_dropped_owners(missing, members, dropped, world, taken):
    assert [owner(b, world) for b in range(4)] == [b % world for b in range(4)]
    assert take_over(missing, members, dropped, world_size=world) == taken


@pytest.mark.parametrize(
    ("out", "n", "sums"),
    [
        ({"loss": 0.5}, 4, {"loss": 2.0}),
        ({"loss": torch.tensor(0.25)}, 4, {"loss": 1.0}),
        ({"loss": torch.tensor([1.0, 2.0, 3.0])}, 3, {"loss": 6.0}),  # per sample: mean * n
        ({"a": 1, "b": torch.tensor(2.0)}, 2, {"a": 2.0, "b": 4.0}),
    ],
)
def test_batch_results_are_sums(out, n, sums):
    assert batch_result(out, n) == (n, sums)


@pytest.mark.parametrize("out", [{}, [1.0], {"x": "1"}, {"x": torch.ones(2, 2)}, {"x": True}, 0.5])
def test_a_result_that_is_not_a_dict_of_means_is_refused(out):
    with pytest.raises(ValueError, match="evaluate"):
        batch_result(out, 3)


def test_combine_adds_in_batch_order():
    results = [(4, {"m": 2.0}), (4, {"m": 1e16}), (2, {"m": -1e16})]
    assert combine(results) == {"m": ((2.0 + 1e16) + -1e16) / 10}
    assert math.isnan(combine([(0, {"m": 0.0})])["m"])


def test_evaluate_alone_is_the_mean_over_every_sample():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(23, 3).double(), torch.randn(23, 1).double()
    trainer = tidal.Trainer(model, opt, TensorDataset(x, y), global_batch_size=4)

    def fn(batch):
        xb, yb = batch
        return {"se": ((model(xb) - yb) ** 2).squeeze(1), "bias": model.bias.detach()[0]}

    got = trainer.evaluate(fn, TensorDataset(x, y), batch_size=5)
    with torch.no_grad():
        expected = ((model(x) - y) ** 2).mean().item()
    assert got["se"] == pytest.approx(expected, rel=1e-14)
    assert got["bias"] == pytest.approx(model.bias.item(), rel=1e-14)
    for size in (1, 7, 23, 50):  # any batching: the same means, to rounding
        other = trainer.evaluate(fn, TensorDataset(x, y), batch_size=size)
        assert other["se"] == pytest.approx(expected, rel=1e-13)
