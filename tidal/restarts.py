"""``--max-restarts``: how many lost workers a job replaces, as a count, a rate or unlimited.

A lost worker (a signal, a lost machine, a kill for missed heartbeats: ``exit_rules.judge_exit``)
is replaced while the job is within its limit; past it, the job goes on with the workers
left (its target shrinks to them) and fails if fewer than ``--min-workers`` are left. A
planned leave (a preemption notice, a scale-down) is not a loss and counts against nothing.

The forms (``parse_max_restarts``):

- ``N``: N losses over the job's life (the form before rates; ``0``: never replace);
- ``N/h`` (also ``N/m``, ``N/d``): at most N losses within any hour (minute, day): a loss is
  within the limit when fewer than N others happened in the window before it. A job on
  spot capacity loses workers now and then for as long as it runs; a crash loop (a
  replacement killed as it starts, again and again) loses them by the minute;
- ``unlimited``: every loss is replaced, as Ray Train's ``FailureConfig(max_failures=-1)``.

The default and why: docs/decisions/max-restarts.md. The rule is pure: the time of a loss
is a fact passed in (``within``), never read here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

#: ``tidal run``'s default (docs/decisions/max-restarts.md).
DEFAULT_MAX_RESTARTS = "60/h"
UNITS = {"m": 60.0, "h": 3600.0, "d": 86400.0}
_UNIT_WORDS = {"m": "minute", "h": "hour", "d": "day"}
_RATE = re.compile(r"^(\d+)\s*/\s*([mhd])$")
_HOW = (
    "write N (lost workers over the job's life), N/h (a rate: at most N within any hour; "
    "also N/m, N/d) or unlimited"
)


@dataclass(frozen=True)
class RestartLimit:
    """``count``: losses allowed (None: unlimited); ``window_s``: the sliding window they
    are counted in (None: the job's life); ``text``: the form it was given in."""

    count: int | None
    window_s: float | None = None
    text: str = ""

    def __str__(self) -> str:
        return self.text or ("unlimited" if self.count is None else str(self.count))

    def spent(self) -> str:
        """The words for a loss past the limit: a clause of an event or a failure."""
        if self.window_s is None:
            return f"the restart budget of {self.count} is spent"
        unit = next((u for u, s in UNITS.items() if s == self.window_s), "")
        word = {"m": "a minute", "h": "an hour", "d": "a day"}.get(unit, "the window")
        return f"more than {self.count} workers were lost within {word}"

    def spent_short(self) -> str:
        """The same, as the reason of a target change."""
        if self.window_s is None:
            return f"restart budget of {self.count} spent"
        return f"losses past --max-restarts {self}"


def parse_max_restarts(value: object) -> RestartLimit:
    """The limit ``value`` (an int, or the text of ``--max-restarts``) says; ValueError,
    naming the flag and the forms, for anything else (a negative count, ``-1``, ``3/w``)."""
    if isinstance(value, bool):
        raise ValueError(f"--max-restarts: {_HOW}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"--max-restarts must be at least 0, got {value}: {_HOW}")
        return RestartLimit(count=value, text=str(value))
    if not isinstance(value, str):
        raise ValueError(f"--max-restarts: {_HOW}, got {value!r}")
    text = value.strip().lower()
    if text == "unlimited":
        return RestartLimit(count=None, text="unlimited")
    if text.isdigit():
        return RestartLimit(count=int(text), text=text)
    if (m := _RATE.fullmatch(text)) is not None:
        count, unit = int(m.group(1)), m.group(2)
        if count < 1:
            raise ValueError(
                f"--max-restarts {value!r}: a rate needs at least 1 per {_UNIT_WORDS[unit]} "
                "(write 0 never to replace a lost worker)"
            )
        return RestartLimit(count=count, window_s=UNITS[unit], text=f"{count}/{unit}")
    raise ValueError(f"--max-restarts: {_HOW}, got {value!r}")


def within(limit: RestartLimit, *, failures: int, recent: Iterable[float], now: float) -> bool:
    """Whether a loss at ``now`` (seconds, any clock that ``recent`` shares) is within
    ``limit``: ``failures``, the losses before it over the job's life; ``recent``, the times
    of earlier losses (those out of the window are ignored; one after ``now``, a clock set
    back, counts as inside it)."""
    if limit.count is None:
        return True
    if limit.window_s is None:
        return failures + 1 <= limit.count
    inside = sum(1 for t in recent if now - t < limit.window_s)
    return inside + 1 <= limit.count


def keep_recent(limit: RestartLimit, recent: Iterable[float], now: float) -> list[float]:
    """The loss times worth keeping at ``now`` for ``within`` (sorted): those inside the
    window, at most ``count`` of them (older ones can never matter again); none for a
    count or unlimited."""
    if limit.window_s is None or limit.count is None:
        return []
    inside = sorted(t for t in recent if now - t < limit.window_s)
    return inside[-limit.count :]
