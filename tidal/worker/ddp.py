"""DDP per generation: the wrapper, its all-reduce hook, and the control word.

Each generation wraps the module in a new ``DistributedDataParallel`` over that
generation's default group (``wrap``). Its gradients are all-reduced by SUM: the loss is
already scaled by each sample's share of the global batch, so the sum is the mean over the
global batch, exactly (DDP's own all-reduce divides by the world size, which is inexact
for three members and breaks elastic invariance in float64).

Agreement on a membership switch rides a collective every step does anyway: each member
puts ``switch=1`` in its control word when it knows of a newer generation and ``stop=1``
when the job is being stopped, and the words are summed in a 2-float all-reduce started as
the last micro-batch begins (``ControlWord.start``), beside the forward and backward, and
waited for with the gradients (``settle``). Every member reads the same sums, so all switch
(or stop) after the same step. The gradients' hook is one ``ProcessGroup.allreduce`` per
bucket with no other Python; ``before_allreduce`` (fault injection) and the exposed-wait
timing belong to the last bucket, the one the step waits for.

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


class ControlWord:
    """Flags every member contributes to each step, summed across the group."""

    SWITCH, STOP = 0, 1

    def __init__(self, device: torch.device | None = None, waits: Waits | None = None) -> None:
        """``device``: where the gradients are (NCCL reduces device tensors only; reading a
        flag on a GPU synchronises with the step's collectives, after the backward).
        ``waits``: on gloo, the worker's abortable waits (module doc); None on NCCL, whose
        collectives the watch aborts in the communicator and whose futures keep CUDA's
        stream order."""
        self.send = torch.zeros(2, device=device)
        self.recv = torch.zeros(2, device=device)
        self.waits = waits
        self.group: dist.ProcessGroup | None = None  # the generation's (``wrap``)
        self.before_allreduce: Callable[[], None] = lambda: None
        # When the last bucket's all-reduce started and completed: the step's exposed
        # communication wait (earlier buckets overlap the backward pass).
        self.comm_started = 0.0
        self.comm_done = 0.0
        self._work: dist.Work | torch.futures.Future | None = None
        self._failed: Exception | None = None

    def set(self, *, switch: bool, stop: bool) -> None:
        self.send[self.SWITCH], self.send[self.STOP] = float(switch), float(stop)
        self.recv.zero_()

    def start(self) -> None:
        """Start summing the word (asynchronously) over the generation's group. A failure to
        start is raised by ``settle``, inside the step's guarded backward."""
        self.recv = self.send.clone()
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
        if self.recv.is_cuda:
            self.recv.cpu()

    def release(self) -> None:
        """Let go of the generation's group (a member leaving it). Any reference kept here
        would keep the destroyed group's connections open: a peer blocked in an all-reduce
        this member never joined (it raised first) would then wait out the collective
        timeout instead of seeing the connection close."""
        self.group = self._work = self._failed = None

    @property
    def switch(self) -> bool:
        return bool(self.recv[self.SWITCH] > 0)

    @property
    def stop(self) -> bool:
        return bool(self.recv[self.STOP] > 0)

    def _last_done(self, fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        self.comm_done = time.perf_counter()
        return fut.value()[0]

    def _mark_done(self, fut: torch.futures.Future) -> None:
        self.comm_done = time.perf_counter()


def _tensor(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return fut.value()[0]


def _sum_hook(control, bucket):  # noqa: ANN001 - DDP inspects these annotations: keep none
    """All-reduce one bucket by SUM (see the module's docstring)."""
    last = bucket.is_last()
    if last:
        control.before_allreduce()
        control.comm_started = time.perf_counter()
    work = control.group.allreduce([bucket.buffer()])
    if control.waits is None:
        return work.get_future().then(control._last_done if last else _tensor)
    fut = control.waits.track(work.get_future())
    if last:
        fut.add_done_callback(control._mark_done)
    return fut


def _ddp(module: torch.nn.Module) -> DistributedDataParallel:
    with warnings.catch_warnings():  # broadcast_buffers=False is the only way to skip the
        warnings.simplefilter("ignore", FutureWarning)  # buffers' sync at construction
        return DistributedDataParallel(module, init_sync=False, broadcast_buffers=False)


def wrap(module: torch.nn.Module, control: ControlWord) -> DistributedDataParallel:
    """DDP over the current default group, re-made each generation.

    ``init_sync=False``: the heal has already made every member's parameters equal.
    """
    control.group = dist.group.WORLD
    ddp = _ddp(module)
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
