"""A member busy in its script between collectives: what it says, and what its peers read.

An evaluation, a save or an upload on one member between two steps makes the others wait
in their next collective for as long as it takes. Tidal lets them wait, without failing
anyone, while that member is known alive (``tidal.worker.membership.watch``):

- **What it says.** Each heartbeat carries ``script_s`` (``HeartbeatRequest``): seconds
  since the member's last collective window closed, while it is a member of a formed DDP
  group; None otherwise (forming, healing, inside its step's collectives, outside any
  group; and under ``sharding="fsdp"``, whose collectives the window does not cover).
- **What its peers read.** The coordinator lists the members alive (heartbeating) and busy
  that long in its answer (``HeartbeatResponse.busy``; ``tidal.coordinator.rules.busy``); a peer
  trusts that list while its answer is fresh (``peers_busy``).
- **gloo's own timeout.** A gloo collective fails by itself once the group's timeout has
  passed, whatever the watch decides. So each DDP generation's group gets ``BUSY_WAIT_S``
  at its first step (``long_timeout``): the watch bounds the step's collectives (cut at
  ``--collective-timeout`` unless a peer is busy, at once when a member is dropped), and a
  dead or killed peer fails the others' collectives as its connections close. Forming and
  healing keep the collective timeout.

Not covered: a membership change agreed at the very step after which a member evaluates
(its peers' rendezvous still times out after ``--collective-timeout``).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

#: How many heartbeat intervals an answer stays fresh enough to trust its ``busy`` list.
FRESH_BEATS = 5.0
#: The timeout of a formed DDP generation's gloo group (module doc): a week.
BUSY_WAIT_S = 7 * 24 * 3600.0


def script_s(left_s: float | None, *, in_group: bool) -> float | None:
    """What this member's heartbeat says (module doc): ``left_s`` (``AbortWatch.script_s``)
    while it is in a formed group, else None."""
    return left_s if in_group else None


def peers_busy(
    *, busy: list[int], members: list[int], me: int | None, answer_age_s: float, interval_s: float
) -> bool:
    """Whether a peer (a member of ``members`` other than ``me``) is in the answer's ``busy``
    list, the answer no older than ``FRESH_BEATS`` heartbeat intervals."""
    if not busy or answer_age_s > FRESH_BEATS * interval_s:
        return False
    listed = set(busy)
    return any(m in listed for m in members if m != me)


def long_timeout(backend: str) -> None:
    """Give the current default gloo group ``BUSY_WAIT_S`` for its later collectives."""
    if backend == "gloo":
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=BUSY_WAIT_S))
