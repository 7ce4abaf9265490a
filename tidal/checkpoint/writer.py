"""Asynchronous checkpoint writing: the training step pays for almost nothing.

``save`` copies at once only what the next forward pass may change (buffers, RNG). A writer
thread then copies parameters and optimizer state, which nothing changes until the next
optimizer step, while that step's forward and backward run; then it writes the copies
straight to disk, hashing as it writes, fsyncs and renames (``store``: the copies, file I/O
and the hash release the GIL; the snapshot memory is reused from one checkpoint to the
next). The trainer calls ``quiesce`` before anything modifies the state (the optimizer
step, a heal): that is the only wait, and it lasts only as long as the copy outlives the
step's compute. At most one write is in flight: a new ``save`` first waits for the previous
write, so a slow disk delays training by at most one write and never queues snapshots in
memory (and the snapshot memory is free for the next one to reuse).

**Keeping ``keep``.** The checkpoints beyond the newest ``keep`` go when the next write
begins, not when the last one ends (``close`` prunes after the last write): at every moment
the newest ``keep`` complete checkpoints are on disk, and, between writes, one more (as
during a write, so the disk's peak is unchanged). A write then fills the page cache that the
deletion freed a moment before. Freed seconds earlier, those pages are handed back to the
host on a VM with free page reporting (virtio-balloon: Firecracker, many clouds), and
faulting them in again costs the guest ~7 CPU-s per GB; measured here, a 200 MB write took
1.5 CPU-s pruned after and 0.1 pruned before (``docs/decisions/prune-before-write.md``).

A write that fails does not stop training: ``on_failed(step, error)`` reports it (the worker
sends it to the coordinator, which records an event and decides the job's outcome).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tidal.checkpoint import store
from tidal.checkpoint.location import Location
from tidal.tracked import TrackedState

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    def __init__(
        self,
        directory: Path,
        *,
        keep: int,
        on_written: Callable[[store.Written], None],
        on_failed: Callable[[int, str], None] | None = None,
        during_write: Callable[[int], None] | None = None,
        fence: str | None = None,
    ) -> None:
        """``during_write(step)``: a test hook run inside each write (``store.write``).
        ``fence``: this worker's run (``checkpoint.fence``): a write after a newer run took
        the folder, or after the job ended, fails instead of landing."""
        if keep < 1:
            raise ValueError(f"--keep-checkpoints must be at least 1, got {keep}")
        self.directory = directory
        self.keep = keep
        self.on_written = on_written
        self.on_failed = on_failed
        self.during_write = during_write
        self.fence = fence
        self._thread: threading.Thread | None = None
        self._copied: threading.Event | None = None
        self._buffers = store.Buffers()  # snapshot memory, reused (one write at a time)
        self.last_stall_s = 0.0  # what the last checkpoint cost the training thread
        self.last_step: int | None = None

    def save(
        self,
        *,
        step: int,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        meta: dict,
        tracked: TrackedState | None = None,
    ) -> None:
        """Begin a checkpoint of the current state; returns before it is copied. The caller
        must ``quiesce`` before changing parameters or optimizer state."""
        start = time.monotonic()
        self.wait()
        pending = store.begin_snapshot(
            step=step, module=module, meta=meta, tracked=tracked, pool=self._buffers
        )
        copied = threading.Event()
        self._copied = copied
        self.last_step = step
        self._thread = threading.Thread(
            target=self._write, args=(pending, module, optimizer, copied), name="tidal-checkpoint"
        )
        self._thread.start()
        self.last_stall_s = time.monotonic() - start

    def quiesce(self) -> None:
        """Block until the snapshot in flight has copied what the caller is about to change."""
        if self._copied is not None:
            start = time.monotonic()
            self._copied.wait()
            self._copied = None
            self.last_stall_s += time.monotonic() - start

    def _write(
        self,
        pending: store.PendingSnapshot,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        copied: threading.Event,
    ) -> None:
        try:
            snap = pending.complete(module, optimizer)
        finally:
            copied.set()
        try:
            hook = self.during_write
            during = (lambda: hook(snap.step)) if hook is not None else None
            self._prune()  # before the write: its files reuse the pages this frees (module doc)
            written = store.write(snap, self.directory, during=during, fence=self.fence)
        except Exception as exc:  # noqa: BLE001 - a failed write must not kill training
            error = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
            log.warning("checkpoint of step %s failed: %s", snap.step, error)
            if self.on_failed is not None:
                self.on_failed(snap.step, error)
            return
        self.on_written(written)

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._copied = None

    def close(self) -> None:
        """Wait for the write in flight, then delete the checkpoints beyond the newest
        ``keep`` (what the next write would have deleted as it began: module doc)."""
        self.wait()
        if self.last_step is not None:  # one that wrote nothing leaves the folder alone
            self._prune()

    def _prune(self) -> None:
        prune_quietly(self.directory, self.keep, fence=self.fence)


def prune_quietly(directory: Location, keep: int, *, fence: str | None = None) -> None:
    """``store.prune`` to ``keep``; a failure is logged, never a write's failure nor the
    worker's end (what is left on disk stays readable, and the next write prunes again)."""
    try:
        store.prune(directory, keep, fence=fence)
    except Exception as exc:  # noqa: BLE001 - an unreachable store, a fence unreadable
        log.warning("pruning checkpoints beyond the newest %d failed: %s", keep, exc)
