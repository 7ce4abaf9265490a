"""Neighbour copies: each member keeps its ring neighbour's shard in memory (issue 16).

With sharding, a member's death destroys the only live copy of its rows. So every
``every`` committed steps, and at the start of every generation, each member of a
generation snapshots its own rows with the replicated state (``own``, ``blob``) and sends
its rows to rank ``r + 1`` while it receives rank ``r - 1``'s (``theirs``). A lost member's
rows then survive in its successor's memory, and every survivor can roll back to the copy
step from its own snapshot (``shard_plan.decide``: path ``COPY``): at most ``every`` steps
are redone (plus the copy in flight). When both holders of a shard are lost, only a
durable checkpoint has it.

**Never blocking a step.** The training thread only copies its own rows (a memory copy of
one shard) at the step boundary; the exchange runs on a thread, over a process group of
its own (``bind``: made with each generation, so it never interleaves with the training's
collectives), while the next steps train. A copy counts (``copies``) once its exchange has
completed; until then, and if it fails, the previous whole copy stays. Buffers are never
overwritten in place, so a failure half-way never leaves a torn copy. The next copy step,
and leaving the generation, wait for an exchange still in flight (``wait``): the thread
must be done before its group is destroyed.

A lone member keeps no copy (it would die with the member): memory is the live shards
alone, and a joiner lost before the generation's first copy completes costs a roll-back to
a durable checkpoint.

The copy is taken by every member at the same steps (a pure function of the step count
and of the generation's start), so all members take part in the same exchange. Memory: two
more shards per member (its own snapshot and its neighbour's), and during an exchange the
previous pair too.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tidal.tracked import TrackedState
from tidal.worker.sharded.layout import shard_range
from tidal.worker.sharded.module import Key, ShardedModel
from tidal.worker.sharded.plan import Layout

log = logging.getLogger(__name__)

#: Steps between two neighbour copies: the steps a failure redoes at most.
DEFAULT_EVERY = 10


@dataclass(kw_only=True)
class Copies:
    step: int
    layout: Layout  # of ``own``; ``theirs`` is rank ``neighbour`` of the same layout
    own: dict[Key, torch.Tensor]
    blob: bytes  # the replicated state at ``step`` (``ShardedModel.replicated_blob``)
    neighbour: int | None
    theirs: dict[Key, torch.Tensor]


class Ring:
    def __init__(self, every: int = DEFAULT_EVERY) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"the neighbour copy interval must be a positive int, got {every!r}")
        self.every = every
        self.copies: Copies | None = None  # the newest whole copy
        self.group: dist.ProcessGroup | None = None
        self.snapshot_s = 0.0  # the last copy's cost to the training thread
        self.exchange_s = 0.0  # the last exchange's duration, on its thread
        self.error: str | None = None  # why the last exchange failed, if it did
        self.failures = 0  # exchanges that failed (the old copy stayed)
        self._thread: threading.Thread | None = None

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def bind(self, group: dist.ProcessGroup | None) -> None:
        """The process group of this generation's exchanges (None: none, e.g. alone). The
        previous one is freed on a thread (a gloo group's destructor joins its threads:
        ~20 ms the next generation need not wait for)."""
        self.wait()
        old, self.group = [self.group], group
        # Not a daemon: the interpreter joins it (a process exiting while a gloo destructor
        # runs aborts).
        threading.Thread(target=old.clear, name="tidal-free-copy-group").start()

    def refresh(self, sm: ShardedModel, step: int, tracked: TrackedState | None) -> None:
        """Take this member's part of the copy at ``step``: snapshot now, exchange on a
        thread (module contract)."""
        self.wait()
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1:  # alone: a copy in this member's memory dies with it; none is kept
            self.copies = None
            return
        t0 = time.perf_counter()
        held = sm.held()
        keys = sm.keys(held.rows)
        own = {k: held.rows[k].detach().clone() for k in keys}
        copy = Copies(
            step=step,
            layout=held.layout,
            own=own,
            blob=sm.replicated_blob(held, tracked),
            neighbour=None,
            theirs={},
        )
        self.snapshot_s = time.perf_counter() - t0
        if self.group is None:
            self.copies = copy
            return
        copy.neighbour = (rank - 1) % world
        sizes = {k: shard_range(sm.full_shape(k)[0], world, copy.neighbour) for k in keys}
        self._thread = threading.Thread(
            target=self._exchange,
            args=(copy, sizes, (rank + 1) % world, self.group),
            name="tidal-neighbour-copy",
            daemon=True,
        )
        self._thread.start()

    def _exchange(self, copy: Copies, sizes: dict, nxt: int, group: dist.ProcessGroup) -> None:
        t0 = time.perf_counter()
        try:
            works = []
            for k, (a, b) in sizes.items():
                mine = copy.own[k]
                buf = copy.theirs[k] = torch.empty((b - a, *mine.shape[1:]), dtype=mine.dtype)
                if mine.shape[0]:  # the group is a bare backend (group.side_group)
                    works.append(group.send([mine], nxt, 0))
                if b > a:
                    works.append(group.recv([buf], copy.neighbour, 0))
            for w in works:
                w.wait()
        except Exception as exc:  # noqa: BLE001 - the generation's failure is seen elsewhere
            self.error = " ".join(f"{type(exc).__name__}: {exc}".split())
            self.failures += 1
            log.warning(
                "neighbour copy of step %s failed (the copy of step %s stays): %s",
                copy.step,
                self.copies.step if self.copies else None,
                self.error,
            )
            return
        self.exchange_s = time.perf_counter() - t0
        self.copies = copy  # whole: it counts from now on

    def wait(self) -> None:
        """Until the exchange in flight, if any, has completed or failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
