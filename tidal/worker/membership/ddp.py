"""DDP per generation: the wrapper, its all-reduce hook, and the control word.

Each generation wraps the module in a new ``DistributedDataParallel`` over that
generation's default group (``wrap``). Its gradients are all-reduced by SUM: the loss is
already scaled by each sample's share of the global batch, so the sum is the mean over the
global batch, exactly (DDP's own all-reduce divides by the world size, which is inexact
for three members and breaks elastic invariance in float64).

Agreement on a membership switch: each member puts ``switch=1`` in its control word when
it knows of a newer generation and ``stop=1`` when the job is being stopped, and the words
are summed in a small all-reduce started as the last micro-batch begins
(``ControlWord.start``), beside the forward and backward, and waited for with the gradients
(``settle``). Every member reads the same sums, so all switch (or stop) after the same step.

Not every step carries the word: that all-reduce cost 4% of the bench's throughput at two
workers on two cores (six pairs of 300-step runs with and without it, 1.02x to 1.06x in five;
2026-12-04), where the design asks that the agreement add no collective to each step. The
word's third float is rank 0's ``every`` (``control_every``: how many steps make
``CONTROL_PERIOD_S`` at its recent step time), and the next word rides that many steps
later; a generation's first step always carries one. All members hold the same sums, so all
agree on which steps carry a word: a planned change or a stop is noticed within about
``CONTROL_PERIOD_S`` plus a step, and failures are unaffected (a failed all-reduce of the
gradients is seen at once).

The word's fourth float is this member's item count for token-weighted losses
(``step.backward(loss, items=n)``): summed with the flags, it is the global batch's item
count, the divisor of the summed gradients (``update``). A job whose steps use ``items=``
carries a word on every step (``ElasticLoop.word_due``). The word is float64, so counts are
exact up to 2**53.

The gradients' hook is one ``ProcessGroup.allreduce`` per bucket with no other Python;
``before_allreduce`` (fault injection), the exposed-wait timing and the ``reduced`` count
belong to the last bucket, the one the step waits for. ``reduced`` is how a step knows its
gradients were all-reduced: a forward that bypassed the DDP wrapper (the script called the
module it gave the Trainer, not ``trainer.model``) runs no hook, and the members would
each apply their own gradients, silently (``step.GradientsNotReduced``).

A loop the script owns (``tidal.prepare``) calls ``loss.backward()`` itself: a failed
all-reduce must not raise there, in the script's own loop. With ``ControlWord.catching`` the
hook's future always completes with the bucket (whatever it holds) and the failure is kept
(``take_caught``): the step's end reads it (``Step.end_sync``) and the step is not applied.

On gloo every collective the step waits for is behind a future of the worker's ``Waits``
(``waits``), which the abort watch can fail: gloo itself cannot abort a collective. The
control word is summed into a fresh tensor each step, so a collective left blocked by an
abort never writes into a later step's word.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tidal.worker.waits import Waits

#: How often a control word rides, in seconds of training (module doc).
CONTROL_PERIOD_S = 0.2
#: ... and at most this many steps apart, however short the steps.
MAX_EVERY = 32


def control_every(step_s: float | None) -> int:
    """How many steps make ``CONTROL_PERIOD_S`` at ``step_s`` seconds a step, from 1 (every
    step: a step that long, or no step timed yet) to ``MAX_EVERY``."""
    if step_s is None or not step_s > 0:
        return 1
    return max(1, min(MAX_EVERY, int(CONTROL_PERIOD_S / step_s)))


class ControlWord:
    """Flags every member contributes to a step, summed across the group (module doc)."""

    SWITCH, STOP, EVERY, ITEMS = 0, 1, 2, 3

    def __init__(self, device: torch.device | None = None, waits: Waits | None = None) -> None:
        """``device``: where the gradients are (NCCL reduces device tensors only; the sums
        are read back once, in ``settle``, after the backward). ``waits``: on gloo, the
        worker's abortable waits (module doc); None on NCCL, whose collectives the watch
        aborts in the communicator and whose futures keep CUDA's stream order."""
        self.device = device
        self.send = torch.zeros(4, dtype=torch.float64, device=device)
        self.recv = self.send
        #: This member's flags for the step (``set``), and the group's sums once settled:
        #: plain floats, read without touching a device.
        self.flags = (False, False)
        self.sums = (0.0, 0.0, 0.0, 0.0)
        self.waits = waits
        #: Last buckets all-reduced since the word was made (``_sum_hook``): a step whose
        #: backward did not move it reduced no gradients (module doc).
        self.reduced = 0
        self.carries = False  # this step's word is set (``set``), not skipped
        #: The dtype the gradients travel in (``COMPRESSION``), None: their own.
        self.compress: torch.dtype | None = None
        self.group: dist.ProcessGroup | None = None  # the generation's (``wrap``)
        self.before_allreduce: Callable[[], None] = lambda: None
        # When the last bucket's all-reduce started and completed: the step's exposed
        # communication wait (earlier buckets overlap the backward pass).
        self.comm_started = 0.0
        self.comm_done = 0.0
        self._work: dist.Work | torch.futures.Future | None = None
        self._failed: Exception | None = None
        #: The gradients' hook keeps a failure instead of failing the backward (module doc).
        self.catching = False
        self._caught: Exception | None = None

    def set(self, *, switch: bool, stop: bool, every: int = 0, items: float = 0.0) -> None:
        """This member's word for the step; ``every``: rank 0's ``control_every`` (0 from the
        others, so the sum is rank 0's); ``items``: this member's item count (``count``
        adds to it until ``start``)."""
        self.flags = (switch, stop)
        self.sums = (0.0, 0.0, 0.0, 0.0)
        self.send = torch.tensor(
            [float(switch), float(stop), float(every), float(items)],
            dtype=torch.float64,
            device=self.device,
        )
        self.carries = True

    def skip(self) -> None:
        """This step carries no word: nothing to sum, nothing to wait for, no flag set."""
        self.flags = (False, False)
        self.sums = (0.0, 0.0, 0.0, 0.0)
        self._work = self._failed = None
        self.carries = False

    def count(self, items: float) -> None:
        """Put this member's item count for the step in the word, before ``start``."""
        self.send[self.ITEMS] = float(items)

    def begin_sum(self, items: float | None, *, rank: int) -> bool:
        """Start summing this step's word, from the last micro-batch's ``backward`` (its
        item count is known then), if the step carries one, beside the backward. A step that
        counts items always carries one: the first such step may fall where the cadence
        skipped the word, and every member, running the same script, sets one there alike
        (True: set here, with rank 0's cadence of 1)."""
        added = items is not None and not self.carries
        if added:
            self.set(switch=False, stop=False, every=1 if rank == 0 else 0)
        if self.carries:
            if items is not None:
                self.count(items)
            self.start()
        return added

    def start(self) -> None:
        """Start summing the word (asynchronously) over the generation's group, into a
        tensor of this step's own. A failure to start is raised by ``settle``, inside the
        step's guarded backward."""
        self.recv = self.send
        self._work = self._failed = None  # a step that failed before ``settle`` left them
        try:
            work = self.group.allreduce([self.recv])
            self._work = work if self.waits is None else self.waits.track(work.get_future())
        except Exception as exc:  # noqa: BLE001 - a broken group surfaces as any error
            self._failed = exc

    def settle(self) -> None:
        """Wait until the word's sums are in ``recv`` (they arrive during the backward)."""
        failed, work = self._failed, self._work
        self._failed = self._work = None
        if failed is not None:
            raise failed
        if work is not None:
            work.wait()
            self.sums = tuple(self.recv.tolist())  # one read back from a device
        elif self.device is not None and self.device.type == "cuda":
            # No word this step: the step's collectives are still waited for here, inside
            # the abort watch's window, as reading the word back would have.
            torch.cuda.current_stream(self.device).synchronize()

    def take_caught(self) -> Exception | None:
        """The first failure the gradients' hook kept since the last call (``catching``)."""
        caught, self._caught = self._caught, None
        return caught

    def kept(
        self, buf: torch.Tensor, reduce: Callable[[], torch.futures.Future]
    ) -> torch.futures.Future:
        """``reduce()``'s future, made to complete with ``buf`` instead of failing; the
        failure (raised by ``reduce`` or carried by its future) is kept (``catching``)."""
        try:
            fut = reduce()
        except Exception as exc:  # noqa: BLE001 - a broken group surfaces as any error
            self._caught = self._caught or exc.with_traceback(None)
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(buf)
            return done

        def keep(f: torch.futures.Future) -> torch.Tensor:
            try:
                value = f.value()
            except Exception as exc:  # noqa: BLE001 - the collective's own failure
                self._caught = self._caught or exc.with_traceback(None)
                return buf
            return value[0] if isinstance(value, list) else value

        return fut.then(keep)

    def release(self) -> None:
        """Let go of the generation's group (a member leaving it). Any reference kept here
        would keep the destroyed group's connections open: a peer blocked in an all-reduce
        this member never joined (it raised first) would then wait out the collective
        timeout instead of seeing the connection close."""
        self.group = self._work = self._failed = None

    @property
    def switch(self) -> bool:
        return self.sums[self.SWITCH] > 0

    @property
    def stop(self) -> bool:
        return self.sums[self.STOP] > 0

    @property
    def items(self) -> float:
        """The global batch's item count, once settled (``count``)."""
        return self.sums[self.ITEMS]

    @property
    def every(self) -> int:
        """Steps until the next word: rank 0's proposal as summed (at least 1)."""
        return max(1, int(self.sums[self.EVERY]))

    def _last_done(self, fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        self.comm_done = time.perf_counter()
        return fut.value()[0]

    def _mark_done(self, fut: torch.futures.Future) -> None:
        self.comm_done = time.perf_counter()


def _tensor(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return fut.value()[0]


def _sum_hook(control, bucket):  # noqa: ANN001 - DDP inspects these annotations: keep none
    """All-reduce one bucket by SUM (see the module's docstring)."""
    if control.catching:  # a loop the script owns (module doc)
        return control.kept(bucket.buffer(), lambda: _reduce(control, bucket))
    return _reduce(control, bucket)


def _reduce(control: ControlWord, bucket: dist.GradBucket) -> torch.futures.Future:
    """The bucket's all-reduce by SUM, as a future of the reduced tensor."""
    last = bucket.is_last()
    if last:
        control.before_allreduce()
        control.comm_started = time.perf_counter()
        control.reduced += 1
    buf = bucket.buffer()
    if control.compress is not None:  # ``Trainer(ddp_kwargs={"compression": ...})``
        return _compressed(control, buf, last)
    work = control.group.allreduce([buf])
    if control.waits is None:
        return work.get_future().then(control._last_done if last else _tensor)
    fut = control.waits.track(work.get_future())
    if last:
        fut.add_done_callback(control._mark_done)
    return fut


def _compressed(control: ControlWord, buf: torch.Tensor, last: bool) -> torch.futures.Future:
    """The bucket all-reduced in ``control.compress`` (half the bytes of float32), then
    written back into it: the rest of the step (the word, the abort watch, ``reduced``) is
    unchanged."""
    work = control.group.allreduce([buf.to(control.compress)])
    fut = work.get_future()
    if control.waits is not None:
        fut = control.waits.track(fut)

    def back(f: torch.futures.Future) -> torch.Tensor:
        value = f.value()
        buf.copy_(value[0] if isinstance(value, list) else value)
        if last:
            control.comm_done = time.perf_counter()
        return buf

    return fut.then(back)


#: The DDP arguments a script may set (``Trainer(ddp_kwargs=...)``): what DDP does with the
#: gradients it reduces. The rest are Tidal's: the group, the devices, the initial sync and
#: the buffers' broadcast (healed instead), and the reduction (the SUM hook).
DDP_KWARGS = frozenset(
    {"find_unused_parameters", "static_graph", "bucket_cap_mb", "gradient_as_bucket_view"}
)


#: ``ddp_kwargs={"compression": NAME}``, Tidal's one addition: the dtype the gradients are
#: all-reduced in (DDP's ``bf16_compress_hook`` and ``fp16_compress_hook``, inside Tidal's
#: own hook, which must stay: it carries the control word's companions). Not exact: the
#: sums are rounded to that dtype, so the result depends on the world size.
COMPRESSION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_kwargs(kwargs: dict | None) -> dict:
    """``ddp_kwargs`` validated: ``DDP_KWARGS`` and ``compression`` only (``ValueError``
    naming the others)."""
    kwargs = dict(kwargs or {})
    unknown = sorted(set(kwargs) - DDP_KWARGS - {"compression"})
    if unknown:
        raise ValueError(
            f"ddp_kwargs may set {sorted(DDP_KWARGS)} and 'compression', not {unknown}: Tidal "
            "sets the process group, devices, initial sync and buffer broadcast itself "
            "(healing replaces them)"
        )
    if kwargs.get("compression") not in (None, *COMPRESSION):
        raise ValueError(
            f"ddp_kwargs['compression'] must be one of {sorted(COMPRESSION)}, got "
            f"{kwargs['compression']!r} (a communication hook of your own would replace "
            "Tidal's, which the elastic step needs)"
        )
    return kwargs


def _ddp(module: torch.nn.Module, kwargs: dict | None = None) -> DistributedDataParallel:
    with warnings.catch_warnings():  # broadcast_buffers=False is the only way to skip the
        warnings.simplefilter("ignore", FutureWarning)  # buffers' sync at construction
        return DistributedDataParallel(
            module, init_sync=False, broadcast_buffers=False, **(kwargs or {})
        )


def wrap(
    module: torch.nn.Module, control: ControlWord, kwargs: dict | None = None
) -> DistributedDataParallel:
    """DDP over the current default group, re-made each generation, with the script's
    ``kwargs`` (``DDP_KWARGS``).

    ``init_sync=False``: the heal has already made every member's parameters equal. Unused
    parameters (``find_unused_parameters``) are reduced as zeros by the same SUM hook, so
    the control word rides the last bucket as always.
    """
    kwargs = dict(kwargs or {})
    name = kwargs.pop("compression", None)
    control.compress = COMPRESSION[name] if name is not None else None
    control.group = dist.group.WORLD
    ddp = _ddp(module, kwargs)
    ddp.register_comm_hook(control, _sum_hook)
    return ddp


def warm_up(module: torch.nn.Module) -> None:
    """Pay the one-time costs of gloo and DDP (lazy imports) before joining anyone.

    A 1-rank group on an in-memory store, a DDP wrapper around the real module (no initial
    broadcast, no forward), then everything torn down again.
    """
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _ddp(module)
    finally:
        dist.destroy_process_group()


def rebuild_buckets(wrapper: torch.nn.parallel.DistributedDataParallel) -> Callable[[], object]:
    """DDP's one-time bucket rebuild (a broadcast it would otherwise make inside the first
    forward after the first backward), as a call to make between steps."""
    return wrapper.reducer._rebuild_buckets
