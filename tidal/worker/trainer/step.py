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

A loop the script owns (``tidal.prepare``: ``driven``) calls no ``backward`` of ours: the
script's own ``loss.backward()`` runs between the last micro-batch's hand-out, where the
step's control word starts (``start_sum``), and its ``optimizer.step()``, which settles the
step (``end_sync``); ``outcome`` then records what became of it, once (``ElasticLoop.finish``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from tidal.devices import to_device

if TYPE_CHECKING:
    from tidal.worker.trainer.parts import Parts
    from tidal.worker.trainer.runtime import Trainer


class GradientsNotReduced(RuntimeError):
    """A step's backward ran, but its gradients were never all-reduced (module doc)."""


#: What became of a step (``Step.outcome``): applied; its collective failed (redone after
#: healing); left uncommitted by a member that leaves the job (``leaving``).
COMMITTED, FAILED, LEFT = "committed", "failed", "left"


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


class Step:
    """This worker's share of one global step."""

    def __init__(
        self, trainer: Trainer, index: int, indices: torch.Tensor, *, parts: Parts
    ) -> None:
        self.trainer = trainer
        self.index = index
        self.indices = indices
        self.parts = parts
        #: Why this member's share of the step failed (its collective), or None.
        self.failed: Exception | None = None
        self.started = time.perf_counter()  # when the step was handed to the loop
        self._items: float | None = None  # this member's item count so far (``items=``)
        self._backwards = 0
        self._n_micro = 0
        self._last = False  # the last micro-batch is in flight
        self._reduced = 0  # ``control.reduced`` as the last micro-batch's sum started
        #: The script's own loop drives this step (``driven``): its backward is the script's.
        self.driven = False
        #: ``COMMITTED``, ``FAILED`` or ``LEFT`` once decided (``ElasticLoop.finish``), and
        #: why a member left it uncommitted.
        self.outcome: str | None = None
        self.left_why: str | None = None
        #: The --schedule hold the commit announced (``Membership.hold_soon``).
        self.held: object = None

    @property
    def samples(self) -> int:
        return len(self.indices)

    @property
    def weight(self) -> float:
        """The micro-batch in flight's share of the global batch's samples: the weight of
        its per-sample mean loss."""
        return self._n_micro / self.parts.loader.global_batch_size

    @property
    def in_last(self) -> bool:
        """The step's last micro-batch has been handed to the loop."""
        return self._last

    def micro_batches(self) -> Iterator[Any]:
        """Collated micro-batches of this worker's share. Run forward and ``backward`` of
        each inside the loop: all but the last accumulate without communication."""
        parts = self.parts
        membership, loader = parts.membership, parts.loader
        pieces, batches = loader.micro_batches(
            self.index, self.indices, membership.rank, membership.world_size
        )
        fsdp = parts.sharded.live
        device, watch = parts.objects.device, parts.link.watch
        for i, (piece, batch) in enumerate(zip(pieces, batches, strict=True)):
            if self.failed is not None:
                return
            batch = to_device(batch, device, non_blocking=loader.non_blocking)
            self._n_micro = len(piece)
            if fsdp is not None:
                fsdp.micro_batch(last=i == len(pieces) - 1)
            ddp = membership.ddp
            if i < len(pieces) - 1:
                if ddp is None:
                    yield batch
                    continue
                with ddp.no_sync():
                    yield batch
            else:
                self._last = True
                parts.loop.before_sync(self)
                if watch is not None and membership.ddp is not None:
                    watch.open()  # through the control word's read (``backward``)
                if self.driven:  # the script's own backward comes next
                    self.start_sum()
                yield batch

    def backward(self, loss: torch.Tensor, *, items: Any = None) -> None:
        """Backward of a micro-batch's loss (module doc): without ``items``, ``loss`` is its
        per-sample mean, weighted by its share of the global batch; with ``items=n``,
        ``loss`` is the sum of its ``n`` items' losses."""
        if self.failed is not None:
            return
        parts = self.parts
        membership, update = parts.membership, parts.update
        if items is None:
            if self._items is not None:
                raise ValueError(
                    "step.backward: every micro-batch of a step needs items= once one has it "
                    "(the update divides the step's loss sum by its item count)"
                )
            weighted = loss * self.weight
        else:
            if self._items is None and self._backwards:
                raise ValueError(
                    "step.backward: items= on some micro-batches of a step but not on others; "
                    "pass it on every one (or on none)"
                )
            if parts.objects.sharding != "ddp":
                raise ValueError(
                    "step.backward(loss, items=n) is not supported with sharding='fsdp' yet: "
                    "use sharding='ddp', or a per-sample mean loss"
                )
            self._items = (self._items or 0.0) + item_count(items)
            weighted = loss
        self._backwards += 1
        update.backwards = (update.backwards or 0) + 1
        scaled = update.scale(weighted)
        last = self._last
        control = membership.control
        # A flag, never the wrapper itself: this frame outlives a failed step through the
        # exception's traceback, and a reference to the generation's DDP here would keep its
        # autograd hooks on the parameters into the next generation's backward.
        synced = last and membership.ddp is not None
        if synced:
            self.start_sum()
        try:
            scaled.backward()
            if synced:
                control.settle()
        except Exception as exc:  # noqa: BLE001 - a failed collective surfaces as any error
            if not synced:
                raise
            # Without its traceback: the frames it holds (this one among them) would form a
            # cycle through ``failed`` that only the cyclic collector frees.
            self.failed = exc.with_traceback(None)
        if last:
            self._after_sync(synced)
        elif (fsdp := parts.sharded.live) is not None and fsdp.guard.failed is not None:
            self.failed = fsdp.guard.failed  # FSDP's collectives never raise (``guard``)

    def start_sum(self) -> None:
        """The last micro-batch's backward is next: start summing the step's control word
        beside it (``ControlWord.begin_sum``), before any gradient bucket's all-reduce, and
        note the reduced-bucket count it must move."""
        membership = self.parts.membership
        if membership.ddp is None:
            return
        control = membership.control
        if control.begin_sum(self._items, rank=membership.rank):
            self.parts.loop.word_sent()  # the next word's step known from the sums
        self._reduced = control.reduced

    def end_sync(self) -> None:
        """A driven step's end (``optimizer.step()`` after the script's own backward of the
        last micro-batch): wait for the control word's sums, take any failure the
        gradients' hook caught (``ControlWord.catching``) as the step's, and check as
        ``backward`` does. Runs once, after the last micro-batch was handed out."""
        membership = self.parts.membership
        synced = membership.ddp is not None
        if synced:
            control = membership.control
            try:
                control.settle()
            except Exception as exc:  # noqa: BLE001 - a failed collective surfaces as any error
                self.failed = exc.with_traceback(None)
            caught = control.take_caught()
            if self.failed is None and caught is not None:
                self.failed = caught
        self._after_sync(synced)

    def _after_sync(self, synced: bool) -> None:
        """After the last micro-batch's backward (and its all-reduce, when ``synced``): the
        refusal of unreduced gradients, the item count, the abort watch's verdict."""
        parts = self.parts
        membership, update = parts.membership, parts.update
        control = membership.control
        if synced and self.failed is None and control.reduced == self._reduced:
            raise GradientsNotReduced(
                f"step {self.index}: the gradients were not all-reduced, so each worker would "
                "apply its own: call trainer.model(...) (or the model tidal.prepare "
                "returned), not the module you passed; if you do, a parameter took no part "
                "in the loss: pass "
                "ddp_kwargs={'find_unused_parameters': True}"
            )
        if self.failed is None and self._items is not None:
            parts.loop.counts_items()  # every later step carries a word (``word_due``)
            update.items = control.items if synced else self._items
        watch = parts.link.watch
        if watch is not None and (aborted := watch.close()) is not None:
            # The watch cut the step's all-reduce: its buffers hold whatever the abort left.
            self.failed = self.failed or RuntimeError(f"collective aborted: {aborted}")
        fsdp = parts.sharded.live
        if fsdp is not None:
            # FSDP's collectives never raise (``guard``): a failure is found here, and the
            # last micro-batch ends with the step's control all-reduce.
            if fsdp.guard.failed is None:
                parts.sharded.end_step()
            if fsdp.guard.failed is not None:
                self.failed = fsdp.guard.failed
