"""A worker's side of durable checkpoints: resume at start, save on schedule, flush at end.

Only rank 0 of the current generation writes (every member holds the same state); the
step it writes is a pure function of the step count (``--checkpoint-every``) or of rank 0's
clock (``--checkpoint-interval``). The write is asynchronous (``AsyncCheckpointer``); a
worker waits for its write in flight before it exits, and the job's last step (completion or
``tidal stop``) is always checkpointed.
"""

from __future__ import annotations

import time

import torch

from tidal.checkpoint import location, store
from tidal.checkpoint.writer import AsyncCheckpointer, prune_quietly
from tidal.protocol import CheckpointView, WorkerConfig
from tidal.tracked import TrackedState
from tidal.worker import probes
from tidal.worker.agent.client import Agent
from tidal.worker.batches import identity


class Durable:
    def __init__(self, cfg: WorkerConfig, agent: Agent) -> None:
        self.cfg = cfg
        self._last_time = time.monotonic()
        self.stall_pending = False  # a checkpoint began: its stall is still to be posted
        self._sharded_published = False  # this member published a sharded checkpoint
        self._writer: AsyncCheckpointer | None = None
        if cfg.checkpoint_dir is not None:
            self._writer = AsyncCheckpointer(
                location.of(cfg.checkpoint_dir),
                keep=cfg.keep_checkpoints,
                on_written=lambda w: agent.post_checkpoint(
                    CheckpointView(
                        step=w.step, path=w.path, bytes=w.bytes, seconds_to_write=w.seconds_to_write
                    )
                ),
                on_failed=agent.post_checkpoint_failure,
                during_write=lambda step: probes.point("checkpoint", step),
                fence=cfg.checkpoint_fence,
            )

    def resume(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        tracked: TrackedState | None = None,
        *,
        data_order: dict[str, object],
    ) -> int | None:
        """Load the checkpoint the coordinator chose, if any; returns its step. One found
        damaged (a checksum or structure ``verify`` refuses) is marked bad
        (``layout.mark_bad``), so the next resume skips it; one that does not fit this script
        (``CheckpointMismatch``: another model, optimizer or tracked state) or was written with
        another ``data_order`` (``identity.check_resume``) is refused and kept as it is."""
        if self.cfg.resume_from is None:
            return None
        path = location.of(self.cfg.resume_from)
        try:
            meta = store.load(path, module, optimizer, tracked=tracked)
        except store.CheckpointError as exc:
            if store.marks_bad(exc):
                store.mark_bad(path, str(exc))
            raise
        identity.check_resume(str(path), meta.get("data_order"), data_order)
        store.restore_rng(meta)
        return int(meta["step"])

    def due(self, step: int) -> bool:
        every, interval = self.cfg.checkpoint_every, self.cfg.checkpoint_interval_s
        return (every is not None and step % every == 0) or (
            interval is not None and time.monotonic() - self._last_time >= interval
        )

    def save(
        self,
        *,
        step: int,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        meta: dict,
        tracked: TrackedState | None = None,
    ) -> None:
        """Begin a checkpoint of ``step`` (unless it is the one last written); its stall is
        posted after the next commit (``take_stall``)."""
        self.stall_pending = True
        if self._writer is None or self._writer.last_step == step:
            return
        self._last_time = time.monotonic()
        self._writer.save(step=step, module=module, optimizer=optimizer, meta=meta, tracked=tracked)

    def mark_saved(self, *, published: bool) -> None:
        """A checkpoint was written by other means (``sharding="fsdp"``): the interval
        restarts. ``published``: this member renamed it into place (rank 0), so it prunes
        at ``close``."""
        self._last_time = time.monotonic()
        self._sharded_published = self._sharded_published or published

    def quiesce(self) -> None:
        """Call before changing parameters or optimizer state (a snapshot may be copying)."""
        if self._writer is not None:
            self._writer.quiesce()

    @property
    def last_stall_s(self) -> float:
        return self._writer.last_stall_s if self._writer is not None else 0.0

    def take_stall(self) -> float:
        """The last checkpoint's stall of the training, to post once."""
        self.stall_pending = False
        return self.last_stall_s

    def close(self) -> None:
        """At the worker's end: wait for the write in flight, then prune to
        ``--keep-checkpoints`` (a write prunes as it begins: ``writer``'s module doc); sharded
        checkpoints too, by the member that published one (``mark_saved``)."""
        if self._writer is not None:
            self._writer.close()
        if self._sharded_published and self.cfg.checkpoint_dir is not None:
            prune_quietly(
                location.of(self.cfg.checkpoint_dir),
                self.cfg.keep_checkpoints,
                fence=self.cfg.checkpoint_fence,
            )
