"""Data made on the fly: index datasets and per-sample seeds.

Some workloads have no stored samples: a reinforcement-learning update rolls out episodes, a
generator draws examples. Tidal still hands each worker its share of a global batch (the
elastic data contract of ``ElasticSampler``); what a sample *is* then comes from its index.
For the result not to depend on which worker made a sample, everything random about it must
be a function of the sample alone, never of the worker's RNG state or of its place in a
micro-batch::

    trainer = tidal.Trainer(policy, optimizer, tidal.IndexDataset(1024), global_batch_size=16)
    for step in trainer.run(max_steps=100):
        for episodes in step.micro_batches():          # int64 tensor of sample indices
            seeds = tidal.sample_seeds(step, episodes)  # one seed per sample, worker-free
            ...                                         # env.reset(seed=s), Generator(s)

A sample is identified by (seed, epoch, index): within an epoch every index is used at most
once, and the next epoch's use of the same index is a different sample.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch
from torch.utils.data import Dataset

from tidal.worker.batches.sampler import ElasticSampler

_SEED_BITS = 63  # fits torch.Generator.manual_seed, numpy and gymnasium alike


class _Trains(Protocol):
    @property
    def sampler(self) -> ElasticSampler: ...


class Step(Protocol):
    """What these helpers read of a ``tidal.Step``: its index, and its trainer's sampler
    (which places the data: ``ElasticSampler.position``)."""

    @property
    def index(self) -> int: ...

    @property
    def trainer(self) -> _Trains: ...


class IndexDataset(Dataset):
    """``n`` samples, each its own index: a micro-batch is an int64 tensor of indices.

    For samples made on the fly (episodes, generated data) from ``sample_seed``.
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"an IndexDataset needs at least one sample, got n={n}")
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not -self.n <= index < self.n:
            raise IndexError(f"index {index} out of range for an IndexDataset of {self.n}")
        return index % self.n


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for sample ``index`` of epoch ``epoch`` of a job seeded ``seed``.

    A hash, so seeds of neighbouring samples are unrelated, and the same in every process,
    Python version and platform (unlike ``hash``).
    """
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def step_epoch(step: Step) -> int:
    """The epoch of the job's data that ``step`` consumes."""
    return step.trainer.sampler.position(step.index).epoch


def sample_seeds(step: Step, indices: torch.Tensor, seed: int | None = None) -> list[int]:
    """``sample_seed`` of each of ``indices`` (dataset indices of a micro-batch of ``step``);
    ``seed`` defaults to the ``Trainer``'s."""
    if seed is None:
        seed = step.trainer.sampler.seed
    epoch = step_epoch(step)
    return [sample_seed(seed, epoch, int(i)) for i in indices.reshape(-1).tolist()]
