"""Elastic data: which samples each step consumes, and this worker's share of them.

Contract: step ``s`` (0-based, counted over the whole job) consumes the ``global_batch_size``
samples at positions ``[i * G, (i + 1) * G)`` of epoch ``e``'s permutation, where
``e, i = divmod(s, steps_per_epoch)``. That depends on the step alone, never on the world
size, so a resize between two steps changes who computes a sample, not which samples a step
sees: every sample of an epoch's used prefix is consumed exactly once whatever the resizes.
The ``n mod G`` samples left over at an epoch's end are not used in that epoch (the next
epoch's permutation differs), the ``drop_last`` of DistributedSampler: every step then has
exactly ``G`` samples and the update is the same mean whatever the world size.

With ``shuffle=False`` every epoch's order is the dataset's own (``0, 1, ..., n - 1``), as a
DataLoader's without ``shuffle`` (``tidal.prepare`` of such a loader).

A stream (``dataset_size=None``: it has no length) is read in its own order, without epochs:
step ``s`` consumes positions ``[s * G, (s + 1) * G)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class DataPosition:
    """Where the job stands in its data: ``index`` steps done in epoch ``epoch``."""

    epoch: int
    index: int


class ElasticSampler:
    """Deterministic global batches split across however many members there are now."""

    def __init__(
        self,
        *,
        dataset_size: int | None,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be at least 1, got {global_batch_size}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(
                f"micro_batch_size must be at least 1 (or None for one micro-batch per step), "
                f"got {micro_batch_size}"
            )
        if dataset_size is not None and dataset_size < global_batch_size:
            raise ValueError(
                f"the dataset has {dataset_size} samples, fewer than global_batch_size="
                f"{global_batch_size}: lower the global batch size"
            )
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.shuffle = shuffle
        # A stream's one "epoch" never ends.
        self.steps_per_epoch = dataset_size // global_batch_size if dataset_size else None
        self._perm_epoch: int | None = None  # the epoch ``_perm`` is of
        self._perm = torch.empty(0, dtype=torch.long)

    def position(self, step: int) -> DataPosition:
        if self.steps_per_epoch is None:
            return DataPosition(epoch=0, index=step)
        epoch, index = divmod(step, self.steps_per_epoch)
        return DataPosition(epoch=epoch, index=index)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch``: a pure function of (seed, epoch); the dataset's
        own order without ``shuffle``."""
        if epoch != self._perm_epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.dataset_size, generator=gen)
            else:
                self._perm = torch.arange(self.dataset_size)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, step: int) -> torch.Tensor:
        """Dataset indices (stream positions) of every sample step ``step`` consumes, in
        global order."""
        if self.dataset_size is None:
            g = self.global_batch_size
            return torch.arange(step * g, (step + 1) * g)
        pos = self.position(step)
        start = pos.index * self.global_batch_size
        return self.permutation(pos.epoch)[start : start + self.global_batch_size]

    def check_world_size(self, world_size: int) -> None:
        if world_size > self.global_batch_size:
            raise ValueError(
                f"world size {world_size} is larger than global_batch_size="
                f"{self.global_batch_size}: some workers would get no sample; lower "
                f"--max-workers or raise the global batch size"
            )

    def shard(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        """This rank's contiguous share of step ``step``: sizes differ by at most one."""
        self.check_world_size(world_size)
        batch = self.global_batch(step)
        g = self.global_batch_size
        return batch[rank * g // world_size : (rank + 1) * g // world_size]

    def micro_batches(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """``indices`` cut into pieces of at most ``micro_batch_size``."""
        size = self.micro_batch_size or len(indices)
        return list(torch.split(indices, size))
