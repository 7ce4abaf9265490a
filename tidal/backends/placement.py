"""Where the workers of a job on joined hosts go, and when a host is lost: pure rules.

The hosts backend (``tidal.backends.hosts``) gathers the facts (each host's slots and the
workers placed on it, when each agent was last heard from) and carries the verdicts out;
these functions only decide, so their tables are tested in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Room:
    """A host as placement sees it: ``slots`` workers at most, ``used`` placed on it and not
    ended yet; ``leaving``: its agent is going away (it takes nothing more)."""

    host_id: int
    slots: int
    used: int
    leaving: bool = False

    @property
    def free(self) -> int:
        return 0 if self.leaving else max(0, self.slots - self.used)


def place(hosts: Sequence[Room]) -> int | None:
    """The host a new worker goes to, or None when none has a free slot (the worker waits,
    ``pending``, until a host joins or a slot frees).

    Spread, as a user of several machines expects (Ray's ``SPREAD``): among the hosts with a
    free slot, the one running the fewest of the job's workers; then the one with the most
    free slots (a larger host before a smaller one of equal load); then the lowest id (the
    host that joined first). A host is never given more workers than its slots."""
    open_ = [h for h in hosts if h.free > 0]
    if not open_:
        return None
    return min(open_, key=lambda h: (h.used, -h.free, h.host_id)).host_id


@dataclass(frozen=True, kw_only=True)
class Heard:
    """When a host's agent was last heard from: ``silent_s`` since its last call; ``cut_s``
    since the connection of a poll it had waiting closed without a word (its process died:
    the kernel closed its socket), None if that did not happen since its last call."""

    host_id: int
    silent_s: float
    cut_s: float | None = None


def lost_hosts(
    heard: Sequence[Heard], *, timeout_s: float, cut_grace_s: float
) -> list[tuple[int, str]]:
    """The hosts to count as lost, each with why in words: silent for ``timeout_s`` (the
    machine is down, or its network cut: nothing closes its connection), or its waiting
    poll's connection closed ``cut_grace_s`` ago and it has not called since (its agent was
    killed; a live agent whose connection broke calls again at once). A lost host's workers
    are failed workers; an agent that comes back later joins as a new host."""
    lost = []
    for h in heard:
        if h.cut_s is not None and h.cut_s >= cut_grace_s:
            lost.append(
                (
                    h.host_id,
                    f"its agent's connection closed {h.cut_s:.1f} s ago, with no call since",
                )
            )
        elif h.silent_s >= timeout_s:
            lost.append((h.host_id, f"no word from its agent for {h.silent_s:.1f} s"))
    return lost
