"""Scripted scaling: the target worker count as a pure function of the job's step.

An entry of ``--schedule`` at or past the job's length (``Trainer.run(max_steps)``, which
the coordinator learns when the first worker registers: ``Job.job_length``) never applies:
the job ends before that step. Such entries start no spares, and the job says once that it
ignores them (``docs/decisions/schedule-past-the-end.md``).
"""

from __future__ import annotations

Schedule = tuple[tuple[int, int], ...]


def reachable(schedule: Schedule, length: int | None) -> Schedule:
    """The entries of ``schedule`` the job can reach: those before step ``length``. ``None``:
    the length is not known yet (no worker has registered): every entry counts, since a
    spare for a scale-up that may come is the cheaper mistake than a late one."""
    return schedule if length is None else tuple(e for e in schedule if e[0] < length)


def future_peak(schedule: Schedule, step: int, length: int | None = None) -> int:
    """The largest count the schedule will still ask for after ``step`` and before the job's
    ``length`` (0 if none): the warm workers a scheduled scale-up will need."""
    return max((count for at, count in reachable(schedule, length) if at > step), default=0)


def ignored(schedule: Schedule, length: int) -> list[str]:
    """One line for each entry at or past the job's ``length``, saying it is ignored."""
    return [
        f"--schedule entry {at}:{count} is at or past the job's last step "
        f"(Trainer.run({length})): ignored"
        for at, count in schedule
        if at >= length
    ]
