"""Which members are alive and busy in their script, outside Tidal's collectives: a pure rule.

A member's heartbeat says how long it has been in its script since its last collective
(``HeartbeatRequest.script_s``: an evaluation, a save, an upload between steps). The
coordinator publishes, with the members' answers, those known alive and busy at least
``BUSY_AFTER_S`` (``HeartbeatResponse.busy``); a peer waiting for one of them in a
collective does not give up at the collective timeout (``tidal.worker.membership.watch``). A member
whose heartbeats stop (SIGSTOP, a lost machine) leaves the list once its last heartbeat is
older than the heartbeat timeout, when the coordinator kills it as hung anyway.

The threshold keeps the list still while members train: every member is outside its
collectives for most of each step (its forward and backward), and an answer that changed
every step would be re-published on every pass. A peer only needs the list once it has
waited the collective timeout, which is longer than the heartbeat timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Seconds in the script, outside the collectives, from which a member counts as busy.
BUSY_AFTER_S = 1.0


@dataclass(frozen=True, kw_only=True)
class BusyFacts:
    """One worker as its last heartbeat left it: ``generation`` that heartbeat's, ``script_s``
    its time in the script then (None: in a collective, or in no group), ``silent_s`` since
    that heartbeat (None: none yet)."""

    worker_id: int
    generation: int
    script_s: float | None
    silent_s: float | None


def busy_members(
    workers: list[BusyFacts], *, generation: int | None, heartbeat_timeout_s: float
) -> frozenset[int]:
    """The workers alive and busy in ``generation`` (the newest formed one): their last
    heartbeat, of that generation, came within the heartbeat timeout and said at least
    ``BUSY_AFTER_S`` in the script."""
    if generation is None:
        return frozenset()
    return frozenset(
        w.worker_id
        for w in workers
        if w.generation == generation
        and w.script_s is not None
        and w.script_s >= BUSY_AFTER_S
        and w.silent_s is not None
        and w.silent_s <= heartbeat_timeout_s
    )
