"""Scripted scaling: the target worker count as a pure function of the job's step."""

from __future__ import annotations


def future_peak(schedule: tuple[tuple[int, int], ...], step: int) -> int:
    """The largest count the schedule will still ask for after ``step`` (0 if none)."""
    return max((count for at, count in schedule if at > step), default=0)
