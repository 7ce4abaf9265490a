"""Waits on gloo collectives that the abort watch can cut.

gloo cannot abort a collective (torch 2.13: ``ProcessGroupGloo.abort`` and ``shutdown``
return at once and leave a blocked collective blocked; measured), and one race leaves a
survivor blocked for the whole collective timeout after a peer's death: a send written to
the dead peer's socket before gloo's event loop has read its close fails with EPIPE and is
queued for a retry, and the pair's failure then fails every pending operation but that
queued send (gloo's ``tcp::Pair::signalException`` walks ``tx_`` for bound buffers only),
so its ``waitSend`` waits out the timeout (CI, stop 29: one survivor of a SIGKILL blocked
120 s in "waiting for send operation to complete" while the other had moved on).

So on gloo the training thread never waits on a collective directly. Each collective it
waits on inside a watched window (the step's buckets and control word, the heal's
messages) is behind a future this worker owns (``track``), completed by the collective's
own future, or failed by ``abort`` when the watch gives up on the window (``watch``). The
training thread then returns, fails the step and leaves the group; the collective that
could not be cut stays inside gloo until its own timeout (the group is parked, not freed:
``group.destroy_group``), and its connections are shut down (``conns``) so that nothing
it still holds writes into this worker's memory.

Contract: a future from ``track`` completes exactly once, with the collective's first
tensor or its error, or with ``Aborted``; after ``abort`` every new ``track`` fails at once
until ``reset`` (the group it would run on is broken); ``reset`` runs when the worker has
left that group.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist


class Aborted(RuntimeError):
    """The abort watch gave up on the collective this future stood for."""


class Waits:
    """The futures the training thread may be waiting on (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: set[torch.futures.Future] = set()
        self._aborted: str | None = None

    @property
    def aborted(self) -> bool:
        """Whether a wait was cut since the last ``reset``: the group's collectives may still
        be inside gloo."""
        return self._aborted is not None

    def track(self, fut: torch.futures.Future) -> torch.futures.Future:
        """A future of ``fut``'s first tensor (a collective's), that ``abort`` can fail."""
        mine: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._aborted is not None:
                mine.set_exception(Aborted(self._aborted))
                return mine
            self._pending.add(mine)
        fut.add_done_callback(lambda done: self._settle(mine, done))
        return mine

    def wait_all(self, works: list[dist.Work]) -> None:
        """Wait for each of ``works`` in order, unless aborted; raises the first failure.

        gloo's point-to-point works have no future (``getFuture not implemented``), so a
        daemon thread waits them and completes one future: a thread per call, for the
        heal's few waits per generation, never a step's. An aborted call leaves that thread
        inside gloo until the collective's own timeout."""
        done: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                for work in works:
                    work.wait()
            except Exception as exc:  # noqa: BLE001 - the collective's own failure
                done.set_exception(exc)
                return
            done.set_result([])

        threading.Thread(target=run, name="tidal-wait", daemon=True).start()
        self.track(done).wait()

    def abort(self, reason: str = "the abort watch gave up on a collective") -> None:
        """Fail every pending future, and every later one until ``reset``."""
        with self._lock:
            pending, self._pending = self._pending, set()
            self._aborted = reason
        for mine in pending:
            mine.set_exception(Aborted(reason))

    def reset(self) -> None:
        with self._lock:
            self._pending.clear()
            self._aborted = None

    def _settle(self, mine: torch.futures.Future, done: torch.futures.Future) -> None:
        with self._lock:
            if mine not in self._pending:  # aborted first: the result comes too late
                return
            self._pending.discard(mine)
        try:
            value = done.value()
        except Exception as exc:  # noqa: BLE001 - the collective's own failure
            mine.set_exception(exc)
            return
        mine.set_result(value[0] if value else None)
