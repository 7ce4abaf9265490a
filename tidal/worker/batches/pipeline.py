"""Input pipelines: from the sample ids a step consumes to this worker's collated micro-batches.

Which samples a step consumes is ``ElasticSampler``'s decision, a function of the step
alone; this module only fetches them. Three kinds of input (``classify``):

- **tensors**: a ``TensorDataset`` (or anything with ``.tensors``) and no ``collate_fn``: a
  micro-batch is an index into each tensor, no per-sample Python at all;
- **map-style**: ``__len__`` and ``__getitem__`` (any sample type), collated by
  ``collate_fn`` (default ``default_collate``), in this process or, with ``num_workers > 0``,
  by a ``torch.utils.data.DataLoader`` whose batch sampler yields this member's micro-batch
  index lists step after step (``_Plan``). Its workers prefetch ahead; prefetched batches are
  tagged with the (step, rank, world size) they were planned for, and when the next request
  is for anything else (a resize, a redone step, a heal that moved the step) the iterator is
  restarted at the requested step and what it prefetched is dropped, never trained on. A
  loader process that dies (killed by the OOM killer) is found by ``loader_loss`` and the
  loader restarted at the micro-batch it was at: the step goes on with the same samples;
- **stream**: an ``IterableDataset``, or any object with ``iter_from(position)``, read in its
  own global order (no shuffling, no epochs): step ``s`` consumes positions
  ``[s*G, (s+1)*G)``, each member its contiguous share. A member keeps one cursor and skips
  the positions its peers consume; it reopens the stream only to go back (a redone step, a
  resume): ``iter_from(position)`` if the stream has it (seek), else ``iter(stream)`` and a
  skip from 0. The stream must yield the same samples in the same order every time it is
  opened, in every process.

``LoaderOptions`` are DataLoader's arguments with DataLoader's meanings.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from tidal.worker.batches.loader_loss import LoaderLost, Watch, restart_after
from tidal.worker.batches.sampler import ElasticSampler

log = logging.getLogger(__name__)

TENSORS, MAP, STREAM = "tensors", "map", "stream"


@dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """DataLoader's loading settings, with DataLoader's meanings: the one place a
    ``Trainer``'s ``collate_fn`` ... ``worker_init_fn`` keywords (or a DataLoader passed as
    the data: ``unwrap``) are kept and checked. Which samples a step consumes never depends
    on them. Built once: each refusal a ``ValueError`` that says what to pass instead."""

    collate_fn: Callable[[list[Any]], Any] | None = None
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    worker_init_fn: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        n = self.num_workers
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(
                f"num_workers must be an integer >= 0 (0: load in this process), got {n!r}"
            )
        if n == 0 and (self.prefetch_factor is not None or self.persistent_workers):
            raise ValueError(
                "prefetch_factor and persistent_workers need num_workers > 0 (as in "
                "DataLoader): pass num_workers=N, or leave them out"
            )
        f = self.prefetch_factor
        if f is not None and (not isinstance(f, int) or isinstance(f, bool) or f < 1):
            raise ValueError(f"prefetch_factor must be an integer >= 1 (or None), got {f!r}")
        for name in ("pin_memory", "persistent_workers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("collate_fn", "worker_init_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"{name} must be callable (or None), got {getattr(self, name)!r}")


def classify(data: Any) -> str:
    """The kind of ``data`` (see the module doc); one clear ``ValueError`` if it is none."""
    if isinstance(data, IterableDataset) or callable(getattr(data, "iter_from", None)):
        return STREAM
    if callable(getattr(data, "__len__", None)) and callable(getattr(data, "__getitem__", None)):
        return TENSORS if getattr(data, "tensors", None) is not None else MAP
    raise ValueError(
        f"cannot train on a {type(data).__name__}: pass a map-style dataset (__len__ and "
        "__getitem__), a torch IterableDataset, or a stream with iter_from(position)"
    )


def check_loader(data: Any, *, global_batch_size: int, micro_batch_size: int | None) -> None:
    """Refuse a DataLoader whose batching Tidal would ignore without a word: a ``batch_size``
    that is neither the global batch nor the micro-batch (1, DataLoader's default, cannot be
    told from unset and passes), or a sampler of its own (a torchrun script's
    ``DistributedSampler``): Tidal's split of each global batch replaces both."""
    if not isinstance(data, DataLoader):
        return
    size = data.batch_size
    if size is not None and size != 1 and size not in (global_batch_size, micro_batch_size):
        raise ValueError(
            f"the DataLoader's batch_size={size} would be ignored: the Trainer cuts each "
            f"global batch of global_batch_size={global_batch_size} across the members; pass "
            f"micro_batch_size={size} to the Trainer to keep {size} samples per forward, or "
            f"make the DataLoader with batch_size={global_batch_size}"
        )
    kinds = (torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler)
    sampler = data.sampler if size is not None else data.batch_sampler
    if size is None and not isinstance(sampler, torch.utils.data.BatchSampler):
        raise ValueError(
            f"the DataLoader's batch_sampler ({type(sampler).__name__}) would be ignored: the "
            "Trainer decides every step's samples; pass the dataset, or a DataLoader without one"
        )
    inner = sampler.sampler if size is None else sampler
    if not isinstance(inner, kinds):
        raise ValueError(
            f"the DataLoader's sampler ({type(inner).__name__}) would be ignored: the Trainer "
            "decides which samples each member takes at every step (seeded, the same order "
            "at any world size); drop the sampler and pass the dataset or a plain DataLoader"
        )


def unwrap(data: Any, options: LoaderOptions) -> tuple[Any, LoaderOptions]:
    """A DataLoader stands for its dataset and its loading settings (Ray Train's
    ``prepare_data_loader`` habit); its sampler and batch size are replaced by Tidal's split
    of the global batch. Explicit Trainer arguments win over the loader's."""
    if not isinstance(data, DataLoader):
        return data, options
    default = LoaderOptions()
    own = data.collate_fn if data.collate_fn is not default_collate else None
    take = {
        "collate_fn": own,
        "num_workers": data.num_workers,
        "pin_memory": data.pin_memory,
        "prefetch_factor": data.prefetch_factor if data.num_workers > 0 else None,
        "persistent_workers": data.persistent_workers,
        "worker_init_fn": data.worker_init_fn,
    }
    merged = {
        k: getattr(options, k) if getattr(options, k) != getattr(default, k) else v
        for k, v in take.items()
    }
    return data.dataset, LoaderOptions(**merged)


class _Plan:
    """The DataLoader's batch sampler: this member's micro-batches from micro-batch
    ``skip`` of step ``start`` on."""

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler
        self.start = self.rank = self.skip = 0
        self.world = 1

    def __iter__(self) -> Iterator[list[int]]:
        start, rank, world, skip = self.start, self.rank, self.world, self.skip  # this pass
        for step in itertools.count(start):
            pieces = self.sampler.micro_batches(self.sampler.shard(step, rank, world))
            for piece in pieces[skip if step == start else 0 :]:
                yield piece.tolist()


class _Cursor:
    """A member's read position in a stream (see the module doc)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.it: Iterator[Any] | None = None
        self.pos = 0

    def take(self, start: int, count: int) -> list[Any]:
        if self.it is None or start < self.pos:
            seek = getattr(self.stream, "iter_from", None)
            self.it = iter(seek(start)) if callable(seek) else iter(self.stream)
            self.pos = start if callable(seek) else 0
        try:
            while self.pos < start:
                next(self.it)
                self.pos += 1
            out = [next(self.it) for _ in range(count)]
        except StopIteration:
            self.it = None
            raise ValueError(
                f"the stream ended before position {start + count}: a stream must not end "
                "before the job's last step (raise max_steps' data, or lower max_steps)"
            ) from None
        self.pos += count
        return out


class Pipeline:
    def __init__(self, data: Any, sampler: ElasticSampler, options: LoaderOptions) -> None:
        self.kind = classify(data)
        if self.kind == TENSORS and options.collate_fn is not None:
            self.kind = MAP  # the user's collate sees the samples
        if self.kind == STREAM and options.num_workers > 0:
            raise ValueError(
                "num_workers > 0 needs a map-style dataset: a stream is read in order by "
                "the training process (wrap its decoding in the stream, or index it)"
            )
        self.data, self.sampler, self.options = data, sampler, options
        self.collate = options.collate_fn or default_collate
        self._loader: DataLoader | None = None
        self._plan = _Plan(sampler)
        self._iter: Iterator[Any] | None = None
        self._at: tuple[int, int, int] | None = None  # what ``_iter`` yields next
        self._cursor = _Cursor(data) if self.kind == STREAM else None
        self.restarts = 0  # prefetching iterators dropped (a resize, a redone step)
        self.losses = 0  # loader processes that died, each survived by a restart
        self._watch = Watch()

    def batches(
        self, step: int, rank: int, world: int, pieces: list[torch.Tensor]
    ) -> Iterator[Any]:
        """This member's collated micro-batches of ``step`` (``pieces``: their sample ids)."""
        if self.kind == TENSORS:
            for piece in pieces:
                yield tuple(t[piece] for t in self.data.tensors)
        elif self.kind == STREAM:
            for piece in pieces:
                yield self.collate(self._cursor.take(int(piece[0]), len(piece)))
        elif self.options.num_workers == 0:
            for piece in pieces:
                yield self.collate([self.data[int(i)] for i in piece])
        else:
            yield from self._prefetched(step, rank, world, len(pieces))

    def _prefetched(self, step: int, rank: int, world: int, count: int) -> Iterator[Any]:
        if self._iter is None or self._at != (step, rank, world):
            self._restart(step, rank, world)
        self._at = None  # until this step's batches are all taken
        taken = losses = 0
        while taken < count:
            try:
                batch = self._watch.next(self._iter)
            except LoaderLost as exc:
                reason = str(exc)  # the exception (and the old iterator) is let go here
            else:
                taken += 1
                yield batch
                continue
            losses += 1
            self.losses += 1
            if not restart_after(losses):
                raise RuntimeError(
                    f"a DataLoader worker process died {losses} times in step {step} "
                    f"({reason}): giving up; if the loader's processes run out of memory, "
                    "lower num_workers or prefetch_factor"
                )
            log.warning(
                "tidal: %s in step %d; its loader restarts at micro-batch %d of %d "
                "(loss %d of this step)",
                reason,
                step,
                taken,
                count,
                losses,
            )
            self._restart(step, rank, world, skip=taken, fresh=True)
        self._at = (step + 1, rank, world)

    def _restart(
        self, step: int, rank: int, world: int, *, skip: int = 0, fresh: bool = False
    ) -> None:
        """Start the loader's iterator at micro-batch ``skip`` of ``step``; a new loader
        (new processes, even with ``persistent_workers``) if ``fresh`` or a process of the
        old one died."""
        if self._iter is not None:
            self.restarts += 1
        lost = fresh or self._watch.lost is not None or bool(self._watch.dead())
        self._plan.start, self._plan.rank, self._plan.world = step, rank, world
        self._plan.skip = skip
        if lost:
            self._drop()
        if self._loader is None:
            o = self.options
            self._loader = DataLoader(
                self.data,
                batch_sampler=self._plan,
                collate_fn=self.collate,
                num_workers=o.num_workers,
                pin_memory=o.pin_memory,
                prefetch_factor=o.prefetch_factor,
                persistent_workers=o.persistent_workers,
                worker_init_fn=o.worker_init_fn,
            )
        self._iter = None  # a non-persistent iterator's workers stop with it
        self._iter = iter(self._loader)  # persistent workers: reset, stale batches drained
        self._watch.start(self._iter)

    def _drop(self) -> None:
        """Shut the current iterator's processes down now (not when the garbage collector
        gets to it) and forget the loader."""
        it, self._iter, self._loader = self._iter, None, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        self._watch.stop()

    def close(self) -> None:
        """Stop the loader's worker processes (at the end of ``Trainer.run``)."""
        self._drop()
