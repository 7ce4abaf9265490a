"""Reconciling membership with the target: a pure function from the pool to a plan.

The controller carries the plan out (open a generation, start processes, retire spares);
tests call ``reconcile`` directly with any pool they like.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: The longest a start waits for the settling generation's first step (``Pool.settling_s``):
#: a first step that takes longer (a compile for the new batch shape) should not hold a
#: replacement back by that much.
START_DEFER_S = 2.0


@dataclass(frozen=True, kw_only=True)
class Pool:
    """The workers as the coordinator sees them now.

    ``members``: the current generation's members in rank order (alive ones only).
    ``standby``: registered, warmed-up workers outside the group, oldest first.
    ``starting``: launched processes that have not registered yet.
    ``spares``: how many warm workers beyond the target a known future scale-up will need.
    ``forming``: True before the job's first generation: then the first generation waits for
    the whole initial target, as a rendezvous for a fixed-size job would.
    ``settling``: the latest generation is open but has not formed yet (its members are
    meeting and healing, e.g. after a failure). Joiners wait until it forms: admitting one
    now would abandon that rendezvous and heal half done (a replacement forked in half a
    second otherwise superseded every re-form after a failure, and the pause tripled);
    once formed, a join is one planned switch at a step boundary. Starts wait too, up to
    ``START_DEFER_S`` of ``settling_s`` (how long it has been settling): a replacement
    process forked at a failure spent its start-up (the script's imports, the model, the
    warm-up) on the cores the survivors' rendezvous, heal and redone step needed, ~8 ms of
    every recovery's pause on two cores (measured: the phases after the leave, less one
    step, p50 12.6 ms with the start at once, 4.2 ms deferred; 20 kills each). The
    replacement starts one step later, within a start-up of seconds.
    ``ending``: a member of the current generation reported the end of its training loop
    (the job's last step, or a stop): the generation ends with the job, and no join or
    leave may re-form it (the members that finished cannot meet again; a joiner admitted at
    the last step waited for them in vain, and the finished members, made members again,
    had their clean exits counted as failures). The exits and the wind-down decide.
    ``nodes``: where each member runs (a host), where the backend says (``leavers``).
    """

    members: list[int]
    standby: list[int]
    starting: list[int]
    target: int
    spares: int = 0
    forming: bool = False
    settling: bool = False
    settling_s: float = 0.0
    ending: bool = False
    nodes: Mapping[int, str | None] = field(default_factory=dict)


def leavers(members: Sequence[int], nodes: Mapping[int, str | None], count: int) -> list[int]:
    """The ``count`` members a scale-down removes, in rank order: one at a time from the
    node holding the most of the members still kept, its highest rank (what stays is spread
    over the hosts, as ``tidal scale`` up spread it); between nodes holding as many, the
    node of the highest rank. On one node (every local job), or with no node known, these
    are the last ``count`` ranks."""
    count = max(0, min(count, len(members)))
    if len({nodes.get(m) for m in members}) <= 1:
        return list(members[len(members) - count :])  # one node: O(N), as it always was
    kept = list(members)
    for _ in range(count):
        load: dict[str | None, int] = {}
        for m in kept:
            load[nodes.get(m)] = load.get(nodes.get(m), 0) + 1
        most = max(load.values())
        # the highest rank whose node is among the most loaded
        victim = next(m for m in reversed(kept) if load[nodes.get(m)] == most)
        kept.remove(victim)
    stay = set(kept)
    return [m for m in members if m not in stay]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What to do. ``members`` is the next generation's member list in rank order, or None
    when the membership stays; ``reason`` says why in words."""

    members: list[int] | None = None
    reason: str = ""
    start: int = 0
    retire: list[int] = field(default_factory=list)
    to_standby: list[int] = field(default_factory=list)


def reconcile(pool: Pool) -> Plan:
    if pool.ending:
        return Plan(reason="a member ended its training loop: the generation ends with the job")
    members, standby = list(pool.members), list(pool.standby)
    need = pool.target - len(members)
    new_members: list[int] | None = None
    reason = ""
    removed: list[int] = []
    if need > 0 and standby:
        if pool.forming and len(standby) < need:
            admit: list[int] = []  # wait for the whole initial group
        elif pool.settling:
            admit = []  # join the generation after the one forming now
        else:
            admit = standby[:need]
        if admit:
            standby = standby[len(admit) :]
            new_members = members + admit
            names = ", ".join(str(w) for w in admit)
            reason = (
                f"start with {len(new_members)} workers"
                if pool.forming
                else f"worker{'s' if len(admit) > 1 else ''} {names} joined (target {pool.target})"
            )
    elif need < 0:
        removed = leavers(members, pool.nodes, -need)
        new_members = [m for m in members if m not in removed]
        names = ", ".join(str(w) for w in removed)
        reason = f"worker{'s' if len(removed) > 1 else ''} {names} left (target {pool.target})"
    members_after = new_members if new_members is not None else members
    short = max(0, pool.target - len(members_after))
    # Warm workers we will want outside the group: the shortfall plus the spares.
    want_outside = short + pool.spares
    keep_removed = removed[: max(0, want_outside - len(standby) - len(pool.starting))]
    retire_removed = [w for w in removed if w not in keep_removed]
    outside = standby + keep_removed
    surplus = len(outside) + len(pool.starting) - want_outside
    retire_standby = standby[: max(0, min(surplus, len(standby)))]
    start = max(0, want_outside - len(outside) - len(pool.starting))
    if pool.settling and pool.settling_s < START_DEFER_S:
        start = 0  # after the forming generation's first step (``Pool``)
    return Plan(
        members=new_members,
        reason=reason,
        start=start,
        retire=retire_removed + retire_standby,
        to_standby=keep_removed,
    )
