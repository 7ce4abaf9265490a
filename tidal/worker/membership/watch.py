"""Bounding a collective whose peer died: the abort watch.

An NCCL collective whose peer died does not return: its kernel waits on the GPU for data
that never comes, and the host thread blocks at the next synchronisation; torch's own
watchdog would either wait the group's timeout and then tear the process down, or do
nothing (a worker on NCCL tells it to do nothing, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``).
A gloo collective whose peer died usually raises by itself (the peer's sockets close), but
one race leaves it blocked until the collective timeout (``waits``). So every worker runs
this watch:

- the training thread opens a **window** around each blocking stretch of communication (a
  step's last micro-batch through its control-word read; a heal) and closes it after;
- a thread polls ``abort_reason`` (pure, table-tested) with what the worker knows: how long
  the window has been open, the recent step time, and whether the coordinator has announced
  a newer generation that drops a current member (it does so when it sees a member lost);
- on a reason it aborts: NCCL's communicators (``_abort_process_group``), or on gloo the
  worker's waits and the group's connections (``waits``, ``conns``); the blocked thread
  returns, and ``close`` reports the window **aborted**, so the step is treated as failed
  (whatever the aborted collective left in the buffers is never applied), the member leaves
  the group (already gone) and joins the next generation.

A planned shrink also announces a generation without a member, but that member is alive and
finishes the step, so its collective completes within the grace; only a window open longer
than the grace (a multiple of the recent step time, at least ``GRACE_FLOOR_S``) is cut. So
is a window open that long once the job is being stopped (a member that stopped the job
from its script has left: ``stopping``).

A peer busy in the script between its collectives (an evaluation, a save, an upload) makes
the others wait in their next collective for as long as it takes. While the coordinator's
answer says that peer is alive (it heartbeats) and busy outside Tidal's collectives
(``busy``), the window is not cut at the collective timeout: a member is never failed for
its peer's evaluation. A peer that stops heartbeating (SIGSTOP, a dead machine) drops out of
that list within the heartbeat timeout, is killed and dropped by the coordinator, and the
window is cut as before. The watch also keeps when this member last left a window
(``script_s``): what its own heartbeats say of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: The shortest wait the watch ever cuts after a member was dropped: a healthy collective
#: of the steps Tidal trains finishes well within it.
GRACE_FLOOR_S = 1.0
#: ... or this many recent step times, if longer (a long step's last backward is inside the
#: window).
GRACE_STEPS = 4.0
POLL_S = 0.05


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What the watch knows at one poll. ``open_s``: how long the window has been open (None:
    closed); ``step_s``: the recent step time (None: none yet); ``dropped``: the coordinator
    announced a newer generation without a member of this one; ``timeout_s``: the job's
    collective timeout; ``busy``: a peer of this generation is known alive and busy in the
    script, outside the collectives (``busy``); ``stopped``: the job is being stopped."""

    open_s: float | None
    step_s: float | None
    dropped: bool
    timeout_s: float
    busy: bool = False
    stopped: bool = False


def grace_s(step_s: float | None) -> float:
    return max(GRACE_FLOOR_S, GRACE_STEPS * step_s) if step_s else GRACE_FLOOR_S


def abort_reason(facts: Facts) -> str | None:
    """Why to abort the communicators now, in words; None to let the collective go on."""
    if facts.open_s is None:
        return None
    if facts.dropped and facts.open_s >= grace_s(facts.step_s):
        return f"a member of the group was dropped while a collective waited {facts.open_s:.1f} s"
    if facts.stopped and facts.open_s >= grace_s(facts.step_s):
        return f"the job is stopping and a collective waited {facts.open_s:.1f} s"
    if facts.open_s >= facts.timeout_s and not facts.busy:
        return f"a collective waited {facts.open_s:.1f} s, the collective timeout"
    return None


class AbortWatch:
    """The executor of ``abort_reason`` for one worker (see the module doc). ``facts`` is
    called on the watch thread with the window's open time; ``abort`` aborts the
    communicators. Contract: ``close`` returns the reason if the window was aborted (the
    caller must then fail what ran in it), None otherwise; an abort never runs outside a
    window (the lock orders them)."""

    def __init__(self, facts: Callable[[float | None], Facts], abort: Callable[[], None]) -> None:
        self._facts, self._abort = facts, abort
        self._lock = threading.Lock()
        self._opened: float | None = None
        self._left: float | None = None  # when the last window closed unaborted (``script_s``)
        self._noted = False  # this window's wait for a busy peer was logged
        self._aborted: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidal-abort-watch", daemon=True)
        self._thread.start()

    def open(self) -> None:
        with self._lock:
            if self._opened is None:
                self._opened, self._left, self._noted = time.monotonic(), None, False

    def close(self) -> str | None:
        with self._lock:
            self._opened = None
            reason, self._aborted = self._aborted, None
            self._left = time.monotonic() if reason is None else None
            return reason

    def script_s(self) -> float | None:
        """Seconds since this member's last window closed unaborted, None while one is open
        (or after an abort): its time in the script (and the loop's own work between steps)
        outside Tidal's collectives; the caller says whether it is in a group at all."""
        left = self._left
        return None if left is None else max(0.0, time.monotonic() - left)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                if self._opened is None or self._aborted is not None:
                    continue
                facts = self._facts(time.monotonic() - self._opened)
                reason = abort_reason(facts)
                if reason is None:
                    if facts.busy and facts.open_s >= facts.timeout_s and not self._noted:
                        self._noted = True
                        log.warning(
                            "tidal: a collective has waited %.0f s (the collective timeout) for "
                            "a peer busy in its script (an evaluation, a save?): waiting on",
                            facts.open_s,
                        )
                    continue
                self._aborted = reason
                self._abort()
