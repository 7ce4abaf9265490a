"""``Step``: this worker's share of one global step, as the training loop sees it.

Two ways to weigh a micro-batch's loss, one per step (every micro-batch of a step alike):

- ``step.backward(loss)``: ``loss`` is the micro-batch's per-sample MEAN; it is weighted by
  the micro-batch's share of the global batch's samples, so the update is the mean over the
  global batch's samples at any world size and split.
- ``step.backward(loss, items=n)``: ``loss`` is the micro-batch's SUM of per-item losses
  (tokens, labelled positions: anything counted) and ``n`` its item count. The gradients of
  the sums are all-reduced and divided by the global batch's item count, summed across the
  members on the step's control word (``ddp``): the update is the global loss sum over the
  global item count, exactly, whatever the split. A per-micro-batch token mean weighted by
  samples would give an update that depends on the split, so on the world size.

A step whose gradients were not all-reduced is refused at once (``GradientsNotReduced``),
and each member would otherwise apply its own gradients: the forward called the module
given to the Trainer instead of ``trainer.model``, or a parameter took no part in the loss
without ``ddp_kwargs={"find_unused_parameters": True}`` (DDP then never reduces the bucket
that holds it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from tidal.devices import to_device

if TYPE_CHECKING:
    from tidal.worker.runtime import Trainer


class GradientsNotReduced(RuntimeError):
    """A step's backward ran, but its gradients were never all-reduced (module doc)."""


def item_count(items: Any) -> float:
    """``items`` (an int, a float holding a whole number, or a one-element tensor) as a
    float; ``ValueError`` for anything else or a negative count."""
    if isinstance(items, torch.Tensor):
        if items.numel() != 1:
            raise ValueError(f"items= must be one number, got a tensor of shape {items.shape}")
        items = items.item()
    if isinstance(items, bool) or not isinstance(items, (int, float)):
        raise ValueError(f"items= must be a count (an int), got {type(items).__name__}")
    n = float(items)
    if not math.isfinite(n) or n < 0 or n != int(n):
        raise ValueError(f"items= must be a whole number >= 0, got {items!r}")
    return n


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
        self._items: float | None = None  # this member's item count so far (``items=``)
        self._backwards = 0
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

    def backward(self, loss: torch.Tensor, *, items: Any = None) -> None:
        """Backward of a micro-batch's loss (module doc): without ``items``, ``loss`` is its
        per-sample mean, weighted by its share of the global batch; with ``items=n``,
        ``loss`` is the sum of its ``n`` items' losses."""
        if self._failed is not None:
            return
        tr = self.trainer
        if items is None:
            if self._items is not None:
                raise ValueError(
                    "step.backward: every micro-batch of a step needs items= once one has it "
                    "(the update divides the step's loss sum by its item count)"
                )
            weighted = loss * (self._n_micro / tr.sampler.global_batch_size)
        else:
            if self._items is None and self._backwards:
                raise ValueError(
                    "step.backward: items= on some micro-batches of a step but not on others; "
                    "pass it on every one (or on none)"
                )
            if tr._sharding != "ddp":
                raise ValueError(
                    "step.backward(loss, items=n) is not supported with sharding='fsdp' yet: "
                    "use sharding='ddp', or a per-sample mean loss"
                )
            self._items = (self._items or 0.0) + item_count(items)
            weighted = loss
        self._backwards += 1
        tr._update.backwards = (tr._update.backwards or 0) + 1
        scaled = tr._update.scale(weighted)
        last = getattr(self, "_last", False)
        # A flag, never the wrapper itself: this frame outlives a failed step through the
        # exception's traceback, and a reference to the generation's DDP here would keep its
        # autograd hooks on the parameters into the next generation's backward.
        synced = last and tr._ddp is not None
        if synced:
            if tr._control.begin_sum(self._items, rank=tr.rank):
                tr._next_word = None  # known from the sums, once the step is committed
            reduced = tr._control.reduced
        try:
            scaled.backward()
            if synced:
                tr._control.settle()
        except Exception as exc:  # noqa: BLE001 - a failed collective surfaces as any error
            if not synced:
                raise
            # Without its traceback: the frames it holds (this one among them) would form a
            # cycle through ``_failed`` that only the cyclic collector frees.
            self._failed = exc.with_traceback(None)
        if synced and self._failed is None and tr._control.reduced == reduced:
            raise GradientsNotReduced(
                f"step {self.index}: the gradients were not all-reduced, so each worker would "
                "apply its own: call trainer.model(...) in the loop, not the module passed to "
                "the Trainer; if you do, a parameter took no part in the loss: pass "
                "ddp_kwargs={'find_unused_parameters': True}"
            )
        if last and self._failed is None and self._items is not None:
            tr._items_mode = True  # every later step carries a word (``_word_due``)
            tr._update.items = tr._control.items if synced else self._items
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
