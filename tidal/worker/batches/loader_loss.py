"""A DataLoader worker process that dies (the OOM killer's usual victim) costs a refetch,
not the job.

What torch does: the first multi-process iterator made in the main thread installs a
SIGCHLD handler that raises ``RuntimeError("DataLoader worker (pid N) is killed by signal:
Killed.")`` in the main thread *wherever it is*: inside the gradient all-reduce (where it
reads as a failed collective and the generation re-forms), in the script's forward, in the
optimizer. The iterator itself finds a dead worker only when a batch does not come within
5 s (``RuntimeError("DataLoader worker (pid(s) N) exited unexpectedly")`` from ``next``),
and a ``persistent_workers`` loader hands out the same broken iterator again.

What Tidal does (``Pipeline``): each prefetching iterator it makes is watched (``Watch``).
``guard`` wraps the process's SIGCHLD handler once: a death of a watched loader's process
is recorded on its ``Watch`` instead of raised, except while the training thread waits in
that loader's ``next`` (``Watch.next``), where it is raised there at once as ``LoaderLost``.
Any other error of the handler (another loader's worker, one not watched) is raised as
torch raises it. A loss recorded while the thread trained is raised by the next ``next``.
The pipeline then drops the iterator (and, for ``persistent_workers``, the loader) and
starts a new one at the micro-batch it was at: nothing it had handed out is fetched again
and nothing is skipped. ``restart_after`` decides whether to (a bounded number of losses
per step: a worker that dies on the same sample every time fails the job with one line).

An error the dataset raises in a loader process is not a loss: torch re-raises it in the
training process as the dataset's own exception, and it fails the step as before.
"""

from __future__ import annotations

import multiprocessing.connection
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

#: Losses of a loader process one step survives; the next one fails the job.
LOSSES_PER_STEP = 3

#: How long a failed receive waits for a loader process to be seen dead (module doc).
DYING_S = 5.0

_PIDS = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\)")


class LoaderLost(RuntimeError):
    """A watched DataLoader's worker process died (``reason``: torch's line about it)."""


def lost_pids(message: str) -> set[int]:
    """The worker pids a torch ``RuntimeError`` about a dead DataLoader worker names (none
    for any other message, a dataset's own error re-raised by torch included)."""
    m = _PIDS.search(message)
    return {int(p) for p in m.group(1).replace(" ", "").split(",") if p} if m else set()


def restart_after(losses: int, *, limit: int = LOSSES_PER_STEP) -> bool:
    """Whether a step whose loader has lost a worker process ``losses`` times (the one just
    found included) restarts its loader (True) or fails (False): up to ``limit`` times."""
    if losses < 1:
        raise ValueError(f"losses counts the loss just found: at least 1, got {losses}")
    return losses <= limit


class Watch:
    """The death watch of one pipeline's current iterator (module doc)."""

    def __init__(self) -> None:
        self.pids: frozenset[int] = frozenset()
        self.workers: list[Any] = []  # the iterator's ``multiprocessing`` processes
        self.lost: str | None = None  # torch's line, for a loss not raised yet
        self.waiting = False  # the training thread is inside ``next``

    def start(self, iterator: Any) -> None:
        """Watch ``iterator``'s worker processes (after ``iter(loader)``)."""
        self.stop()
        self.workers = list(getattr(iterator, "_workers", ()))
        self.pids = frozenset(w.pid for w in self.workers if w.pid)
        with _lock:
            for pid in self.pids:
                _watched[pid] = self
        guard()

    def stop(self) -> None:
        """Forget the current iterator's processes (it was shut down) and any loss."""
        with _lock:
            for pid in self.pids:
                if _watched.get(pid) is self:
                    del _watched[pid]
        self.pids, self.workers, self.lost = frozenset(), [], None

    def dead(self, wait_s: float = 0.0) -> list[int]:
        """The pids of the iterator's processes that died (a clean exit is no death),
        waiting up to ``wait_s`` for one to end. A process's sentinel is ready as soon as
        it has closed its files, a little before it can be waited for (its other threads
        are still exiting): so the exit codes are polled until the deadline."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [w.pid for w in self.workers if w.exitcode not in (None, 0)]
            left = deadline - time.monotonic()
            if dead or left <= 0 or not self.workers:
                return dead
            sentinels = [w.sentinel for w in self.workers]
            if multiprocessing.connection.wait(sentinels, min(left, 0.1)):
                time.sleep(0.001)

    def next(self, iterator: Iterator[Any]) -> Any:
        """``next(iterator)``, or ``LoaderLost`` if one of its processes died (before or
        during the wait, or with a batch on its way). A ``LoaderLost`` never loses a
        batch: one that had arrived when it is raised was not returned, and is fetched
        again by the restarted loader."""
        if self.lost is not None:
            raise LoaderLost(self.lost)
        self.waiting = True
        try:
            return next(iterator)
        except LoaderLost:
            raise
        except RuntimeError as exc:
            if lost_pids(str(exc)) & self.pids:
                raise LoaderLost(_line(exc)) from None
            if self.lost is None and not (dead := self.dead()):
                raise  # the dataset's own error, or another loader's
            # A dead process's batch broke the pin-memory thread ("Pin memory thread
            # exited unexpectedly"): the loss, not that, is the cause.
            raise LoaderLost(self.lost or f"DataLoader worker (pid {dead[0]}) died") from None
        except (OSError, EOFError) as exc:
            # A batch whose tensors a process shared before it died cannot be received
            # (its file descriptors went with it): a loss if a process is dead, or dies
            # soon (its sockets close before it is seen to exit).
            if self.lost is None and not (dead := self.dead(wait_s=DYING_S)):
                raise
            raise LoaderLost(
                self.lost
                or f"DataLoader worker (pid {dead[0]}) died with a batch in flight "
                f"({type(exc).__name__})"
            ) from None
        finally:
            self.waiting = False


_watched: dict[int, Watch] = {}
_lock = threading.Lock()


def _line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _around(previous: Callable[[int, Any], Any]) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        try:
            previous(signum, frame)
        except RuntimeError as exc:
            owner = next((_watched[p] for p in lost_pids(str(exc)) if p in _watched), None)
            if owner is None:
                raise
            owner.lost = _line(exc)
            if owner.waiting:
                raise LoaderLost(owner.lost) from None

    handler.tidal_guard = True  # type: ignore[attr-defined]
    return handler


def guard() -> bool:
    """Wrap the process's SIGCHLD handler (torch's, once it installed it) so that a watched
    loader's loss is recorded instead of raised (module doc); True if the handler in place
    is the guard. Does nothing off the main thread (no handler can be set there, and torch
    sets none: its iterators find dead workers in ``next`` alone) or when the handler is
    not a Python function (no DataLoader installed one: nothing raises asynchronously)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGCHLD)
    if getattr(current, "tidal_guard", False):
        return True
    if not callable(current):
        return False
    signal.signal(signal.SIGCHLD, _around(current))
    return True
