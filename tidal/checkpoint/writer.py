"""Asynchronous checkpoint writing: the training step pays only for the snapshot copy.

Serialisation, hashing, fsync and the rename run on a writer thread (the heavy parts,
safetensors' copy, sha256 and file I/O, release the GIL). At most one write is in flight:
a new checkpoint first waits for the previous write, so a slow disk delays training by at
most one write and never queues snapshots in memory.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tidal.checkpoint import store


class AsyncCheckpointer:
    def __init__(
        self, directory: Path, *, keep: int, on_written: Callable[[store.Written], None]
    ) -> None:
        if keep < 1:
            raise ValueError(f"--keep-checkpoints must be at least 1, got {keep}")
        self.directory = directory
        self.keep = keep
        self.on_written = on_written
        self._thread: threading.Thread | None = None
        self.last_stall_s = 0.0
        self.last_step: int | None = None

    def save(
        self, *, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict
    ) -> None:
        """Snapshot now, write in the background. Returns once the snapshot is taken."""
        start = time.monotonic()
        self.wait()
        snap = store.take_snapshot(step=step, module=module, optimizer=optimizer, meta=meta)
        self.last_stall_s = time.monotonic() - start
        self.last_step = step
        self._thread = threading.Thread(
            target=self._write, args=(snap,), name="tidal-checkpoint", daemon=False
        )
        self._thread.start()

    def _write(self, snap: store.Snapshot) -> None:
        try:
            written = store.write(snap, self.directory)
            store.prune(self.directory, self.keep)
        except Exception as exc:  # noqa: BLE001 - a failed write must not kill training
            print(
                f"tidal: checkpoint of step {snap.step} failed: {exc}", file=sys.stderr, flush=True
            )
            return
        self.on_written(written)

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
