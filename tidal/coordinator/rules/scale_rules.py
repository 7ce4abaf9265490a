"""The loop's rules about the worker count: the target within the capacity, who leaves
when capacity shrinks, a leaver's new target, and when ``--schedule`` entries apply and
settle. Pure, table-tested (``tests/test_rules.py``); ``scaling`` carries them out.
"""

from __future__ import annotations

from collections.abc import Iterable


# -- capacity -----------------------------------------------------------------------------
def capacity_victims(alive: list[int], members: list[int], capacity: int) -> list[int]:
    """Which of the ``alive`` workers (not yet told to leave) get a preemption notice when
    only ``capacity`` may run: spares first (nothing to hand over), then the highest ranks
    of ``members`` (rank order)."""
    excess = len(alive) - capacity
    if excess <= 0:
        return []
    spares = [w for w in alive if w not in members][:excess]
    ranked = sorted((w for w in alive if w in members), key=members.index, reverse=True)
    return spares + ranked[: excess - len(spares)]


# -- preemption notices ------------------------------------------------------------------
def leaver_target(*, sent_by_us: bool, requested: int, min_workers: int) -> int | None:
    """The new requested count when a worker announces it leaves (SIGTERM): None when the
    coordinator sent the notice itself (the target already counts it); one less, never
    below ``--min-workers``, when the cloud did (capacity went away with it)."""
    if sent_by_us:
        return None
    return max(min_workers, requested - 1)


# -- the target ------------------------------------------------------------------------------
def effective_target(requested: int, capacity: int | None) -> int:
    """What the job runs: the requested count, within the capacity available now."""
    return requested if capacity is None else max(0, min(requested, capacity))


# -- --schedule
def reached(settled: int | None, step: int) -> bool:
    """Whether the settled step ``settled`` (None: none yet) is ``step`` or later."""
    return settled is not None and settled >= step


# -- --schedule ------------------------------------------------------------------------------
def schedule_due(
    schedule: tuple[tuple[int, int], ...], done: int, step: int
) -> list[tuple[int, int]]:
    """The entries of ``--schedule`` (after the first ``done``) the job has reached at
    ``step``, in order: each sets the target when its step is committed."""
    due = []
    while done < len(schedule) and step >= schedule[done][0]:
        due.append(schedule[done])
        done += 1
    return due


def schedule_ahead(
    schedule: tuple[tuple[int, int], ...],
    done: int,
    step: int,
    *,
    formed: bool,
    settled: int | None,
) -> list[tuple[int, int]]:
    """The ``--schedule`` entries to apply now: those the job has reached at ``step``
    (``schedule_due``); when there are none and the latest generation has formed, the next
    entry if it is at ``step + 1``: a change at ``s`` is applied while the members run step
    ``s - 1``, so whoever leaves knows it before committing that step, and nobody waits at
    ``s`` for the loop's pass. Safe: a member reports ``s - 1`` only once the all-reduce of
    the step before has returned, so every member has set that step's control word already,
    and the earliest word that can carry the switch is step ``s - 1``'s: the switch comes
    after it, at ``s``, as does every hold there. Never two changes in one: an entry due now
    goes alone (``10:2,11:3``: the change at 11 waits for the generation of 10 to form), and
    nothing goes ahead while the last applied entry is not settled (``settled``: the job's
    settled step, None if none; its generation may not even be open yet, waiting for a
    worker) nor before
    the latest generation formed (a start, a resume)."""
    due = schedule_due(schedule, done, step)
    if due or not formed or (done and not reached(settled, schedule[done - 1][0])):
        return due
    return [e for e in schedule_due(schedule, done, step + 1) if e[0] == step + 1][:1]


def schedule_near(schedule: tuple[tuple[int, int], ...], step: int) -> bool:
    """Whether a heartbeat reporting ``step`` may make a ``--schedule`` entry due: the
    entry's own step, or the one before it (``schedule_ahead``)."""
    return any(at - 1 <= step <= at for at, _ in schedule)


def schedule_settled(
    *,
    held_at: int | None,
    settled: int | None,
    members: int,
    target: int,
    waited_s: float,
    timeout_s: float,
    newer_forming: bool,
) -> bool:
    """Whether members held at scheduled step ``held_at`` may go on: the generation has
    the target count, or it could not get there within the start timeout (the job trains
    on with what it has rather than wait forever), or ``newer_forming``: a generation newer
    than the one they hold in is open and not formed. That one cannot form while they hold
    (they are its members), and no joiner is admitted until it forms (``policy.reconcile``):
    waiting for the target could only end at the timeout. Seen: the lone survivor of a
    failure held at step 20 of ``--schedule 20:3``, its replacement's generation opened
    with 2, the third worker ready and waiting for that one to form: 120 s. Released, they
    form it and the third joins at a step boundary after it."""
    if held_at is None or reached(settled, held_at):
        return False
    return members == target or waited_s > timeout_s or newer_forming


def newer_forming(
    *, at: int, latest: int, formed: bool, held: Iterable[tuple[int, int] | None]
) -> bool:
    """Whether generation ``latest``, open and not ``formed``, is newer than the one a
    member held at scheduled step ``at`` holds in (``held``: each of its members' last
    holding heartbeat, (step, generation), None if it sent none): then it needs them to
    form (``schedule_settled``). A generation merely not reported formed yet is not one:
    at ``10:2,11:3`` a member's holding heartbeat at 11 (which makes the entry at 11 due)
    may come before its generation's first-step report, and releasing the hold then
    skipped the change at 11 (the job trained on at 2, the third worker's generation
    never formed)."""
    return not formed and any(h is not None and h[0] == at and h[1] < latest for h in held)
