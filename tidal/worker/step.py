"""``Step``: this worker's share of one global step, as the training loop sees it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from tidal.devices import to_device

if TYPE_CHECKING:
    from tidal.worker.runtime import Trainer


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


class Step:
    """This worker's share of one global step."""

    def __init__(self, trainer: Trainer, index: int, indices: torch.Tensor) -> None:
        self.trainer = trainer
        self.index = index
        self.indices = indices
        self._failed: Exception | None = None
        self._n_micro = 0
        self._started = time.perf_counter()

    @property
    def samples(self) -> int:
        return len(self.indices)

    def micro_batches(self) -> Iterator[Any]:
        """Collated micro-batches of this worker's share. Run forward and ``backward`` of
        each inside the loop: all but the last accumulate without communication."""
        tr = self.trainer
        pieces = tr.sampler.micro_batches(self.indices)
        batches = tr._pipeline.batches(self.index, tr.rank, tr.world_size, pieces)
        fsdp = tr._fsdp if tr._fsdp is not None and tr._fsdp.module is not None else None
        for i, (piece, batch) in enumerate(zip(pieces, batches, strict=True)):
            if self._failed is not None:
                return
            batch = to_device(batch, tr.device, non_blocking=tr._non_blocking)
            self._n_micro = len(piece)
            if fsdp is not None:
                fsdp.micro_batch(last=i == len(pieces) - 1)
            if i < len(pieces) - 1 and tr._ddp is not None:
                with tr._ddp.no_sync():
                    yield batch
            else:
                self._last = True
                tr._before_sync(self)
                if tr._watch is not None and tr._ddp is not None:
                    tr._watch.open()  # through the control word's read (``backward``)
                yield batch

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-batch's mean loss, weighted by its share of the global batch."""
        if self._failed is not None:
            return
        share = self._n_micro / self.trainer.sampler.global_batch_size
        scaled = self.trainer._update.scale(loss * share)
        last = getattr(self, "_last", False)
        try:
            scaled.backward()
            if last and self.trainer._ddp is not None:
                self.trainer._control.settle()
        except Exception as exc:  # noqa: BLE001 - a failed collective surfaces as any error
            if self.trainer._ddp is None or not last:
                raise
            self._failed = exc
        watch = self.trainer._watch
        if last and watch is not None and (aborted := watch.close()) is not None:
            # The watch cut the step's all-reduce: its buffers hold whatever the abort left.
            self._failed = self._failed or RuntimeError(f"collective aborted: {aborted}")
        fsdp = self.trainer._fsdp
        if fsdp is not None and fsdp.module is not None:
            # FSDP's collectives never raise (``guard``): a failure is found here, and the
            # last micro-batch ends with the step's control all-reduce.
            if getattr(self, "_last", False) and fsdp.guard.failed is None:
                self.trainer._end_sharded_step()
            if fsdp.guard.failed is not None:
                self._failed = fsdp.guard.failed
