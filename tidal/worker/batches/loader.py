"""The loader: which samples each step consumes (``ElasticSampler``) and how they are fetched
(``pipeline.Pipeline``), as one part of a ``Trainer``.

Contracts:

- Step ``s`` consumes ``sampler.shard(s, rank, world_size)`` on each member: a function of
  the step alone, whatever the world size (``data``); the loading settings
  (``pipeline.LoaderOptions``) never change which samples those are.
- ``position(step)`` is where the data stands after ``step`` committed steps, with what
  fixes the order (``identity.data_order``): a checkpoint's meta, compared at resume.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.worker.batches import identity
from tidal.worker.batches.pipeline import STREAM, LoaderOptions, Pipeline, classify
from tidal.worker.batches.sampler import ElasticSampler


class Loader:
    """The sampler and the pipeline of one Trainer's data."""

    def __init__(
        self,
        dataset: Any,
        options: LoaderOptions,
        *,
        global_batch_size: int,
        micro_batch_size: int | None,
        seed: int,
        device: torch.device,
        shuffle: bool = True,
    ) -> None:
        self.sampler = ElasticSampler(
            dataset_size=None if classify(dataset) == STREAM else len(dataset),
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            seed=seed,
            shuffle=shuffle,
        )
        self.pipeline = Pipeline(dataset, self.sampler, options)
        #: Batches are copied to the GPU asynchronously from pinned memory.
        self.non_blocking = options.pin_memory and device.type == "cuda"

    @property
    def global_batch_size(self) -> int:
        return self.sampler.global_batch_size

    @property
    def collate(self) -> Any:
        """The collate function the micro-batches are made with."""
        return self.pipeline.collate

    def shard(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        """The sample ids this member consumes at ``step``."""
        return self.sampler.shard(step, rank, world_size)

    def micro_batches(
        self, index: int, indices: torch.Tensor, rank: int, world_size: int
    ) -> tuple[list[torch.Tensor], Any]:
        """Step ``index``'s share ``indices`` cut into micro-batches, and an iterator of
        their collated batches (fetched lazily, in order)."""
        pieces = self.sampler.micro_batches(indices)
        return pieces, self.pipeline.batches(index, rank, world_size, pieces)

    def data_order(self) -> dict[str, object]:
        return identity.data_order(self.sampler)

    def position(self, step: int) -> dict[str, object]:
        """Where the data stands after ``step`` committed steps (module doc)."""
        return {**vars(self.sampler.position(step)), "data_order": self.data_order()}

    def close(self) -> None:
        """Stop the loader's worker processes, if any."""
        self.pipeline.close()
