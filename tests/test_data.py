"""ElasticSampler: which samples each step consumes, and how they are split across ranks."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.batches.sampler import DataPosition, ElasticSampler


def make(n: int = 103, g: int = 8, micro: int | None = None, seed: int = 0) -> ElasticSampler:
    return ElasticSampler(dataset_size=n, global_batch_size=g, micro_batch_size=micro, seed=seed)


def union_of_shards(s: ElasticSampler, step: int, world_size: int) -> torch.Tensor:
    return torch.cat([s.shard(step, r, world_size) for r in range(world_size)])


def test_every_sample_of_the_used_prefix_consumed_once_across_resizes() -> None:
    s = make(n=103, g=8)
    assert s.steps_per_epoch == 12  # 7 samples left over
    sizes = [2, 2, 2, 3, 3, 3, 1, 1, 4, 4, 4, 4]  # a resize every few steps
    for epoch in range(2):
        seen: list[int] = []
        for i, ws in enumerate(sizes):
            step = epoch * s.steps_per_epoch + i
            assert s.position(step) == DataPosition(epoch=epoch, index=i)
            seen += union_of_shards(s, step, ws).tolist()
        assert len(seen) == len(set(seen)) == 12 * 8
        used = s.permutation(epoch)[: 12 * 8]
        assert sorted(seen) == sorted(used.tolist())
        assert seen == used.tolist()  # in global order, too


def test_global_batch_is_independent_of_world_size() -> None:
    s = make(n=50, g=10)
    for step in range(3 * s.steps_per_epoch):
        expected = s.global_batch(step)
        assert len(expected) == 10
        for ws in range(1, 6):
            assert torch.equal(union_of_shards(s, step, ws), expected), (step, ws)


def test_permutation_deterministic_per_seed_and_epoch() -> None:
    a, b = make(n=200, seed=3), make(n=200, seed=3)
    for epoch in (0, 1, 5):
        pa = a.permutation(epoch)
        assert sorted(pa.tolist()) == list(range(200))
        assert torch.equal(pa, b.permutation(epoch))
    # The cache of one epoch's permutation must not leak into another's.
    e0, e1 = a.permutation(0).clone(), a.permutation(1).clone()
    assert not torch.equal(e0, e1)
    assert torch.equal(a.permutation(0), e0)
    assert torch.equal(make(n=200, seed=3).permutation(1), e1)
    assert not torch.equal(make(n=200, seed=4).permutation(0), e0)
    # Steps of the next epoch draw from the next epoch's permutation.
    assert torch.equal(a.global_batch(a.steps_per_epoch), e1[:8])
    assert torch.equal(a.global_batch(0), e0[:8])


@pytest.mark.parametrize("g", [1, 7, 8, 13, 64])
def test_shard_sizes_differ_by_at_most_one(g: int) -> None:
    s = make(n=200, g=g)
    for ws in range(1, g + 1):
        sizes = [len(s.shard(0, r, ws)) for r in range(ws)]
        assert sum(sizes) == g
        assert max(sizes) - min(sizes) <= 1
        assert min(sizes) >= 1


@pytest.mark.parametrize("micro", [1, 3, 4, 16, None])
def test_micro_batches_cut_and_concatenate_back(micro: int | None) -> None:
    s = make(n=100, g=16, micro=micro)
    shard = s.shard(2, 1, 3)
    pieces = s.micro_batches(shard)
    limit = micro or len(shard)
    assert all(1 <= len(p) <= limit for p in pieces)
    assert len(pieces) == -(-len(shard) // limit)
    assert torch.equal(torch.cat(pieces), shard)


def test_world_size_larger_than_global_batch_is_refused() -> None:
    s = make(n=100, g=4)
    s.check_world_size(4)
    assert len(s.shard(0, 3, 4)) == 1
    with pytest.raises(ValueError, match="global_batch_size"):
        s.check_world_size(5)
    with pytest.raises(ValueError, match="global_batch_size"):
        s.shard(0, 0, 5)


@pytest.mark.parametrize(
    ("n", "g", "micro", "word"),
    [
        (100, 0, None, "global_batch_size"),
        (100, -1, None, "global_batch_size"),
        (100, 8, 0, "micro_batch_size"),
        (7, 8, None, "global_batch_size"),
    ],
)
def test_invalid_arguments_raise(n: int, g: int, micro: int | None, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        make(n=n, g=g, micro=micro)


def test_dataset_exactly_one_batch() -> None:
    s = make(n=8, g=8)
    assert s.steps_per_epoch == 1
    assert sorted(s.global_batch(0).tolist()) == list(range(8))
    assert not torch.equal(s.global_batch(0), s.global_batch(1))  # a new epoch, a new order
