"""The members' own step logs (``train.py``: ``TIME STEP`` per committed step): how long
the job committed nothing new, whether or not its coordinator was up to see it."""

from __future__ import annotations

from pathlib import Path


def commits(out: Path) -> list[tuple[float, int]]:
    """Every (time, step) any member committed, by time."""
    found = []
    for path in out.glob("steps-worker-*.txt"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:  # a line being written is skipped
                found.append((float(parts[0]), int(parts[1])))
    return sorted(found)


def stall(out: Path, t0: float, t1: float) -> float:
    """The longest time in [t0, t1] in which the job committed no new step (a step redone
    after a failure, or another member's copy of it, is not new)."""
    found = commits(out)
    newest, last, worst = -1, t0, 0.0
    for t, step in found:
        if step <= newest:
            continue
        newest = step
        if t0 <= t <= t1:
            worst, last = max(worst, t - last), t
    return max(worst, t1 - last) if found else 0.0


def commits_between(out: Path, t0: float, t1: float) -> int:
    """How many distinct steps the job committed in [t0, t1]."""
    return len({step for t, step in commits(out) if t0 <= t <= t1})
