"""Capacity traces: how many workers are available, at what price, over time.

A trace is a CSV file with the header ``time_s,capacity,price_per_worker_hour``; each row
holds from its ``time_s`` until the next row's (the last row holds for ever). The first row
is at time 0, times strictly increase, capacities are whole numbers >= 0 and prices are
dollars per worker-hour >= 0. Blank lines and lines starting with ``#`` are ignored.

``parse_trace`` is pure (text in, ``Trace`` out); ``load_trace`` reads a file. A malformed
trace raises one ``ValueError`` line naming the file and the line: ``FILE:LINE: problem``.
The coordinator's ``--capacity`` replay and the simulator share this parser.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path

HEADER = ("time_s", "capacity", "price_per_worker_hour")


@dataclass(frozen=True)
class TracePoint:
    time_s: float
    capacity: int
    price_per_worker_hour: float


@dataclass(frozen=True)
class Trace:
    """Rows in time order; ``at(t)`` is the row in force at ``t`` seconds."""

    points: tuple[TracePoint, ...]
    source: str = "<trace>"
    times: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.points or self.points[0].time_s != 0:
            raise ValueError(f"{self.source}: a trace needs rows, the first at time_s 0")
        times = [p.time_s for p in self.points]
        if any(b <= a for a, b in zip(times, times[1:], strict=False)):
            raise ValueError(f"{self.source}: time_s must strictly increase")
        object.__setattr__(self, "times", tuple(times))

    def index_at(self, t: float) -> int:
        """The index of the row in force at ``t`` (the first row before time 0)."""
        return max(0, bisect.bisect_right(self.times, t) - 1)

    def at(self, t: float) -> TracePoint:
        return self.points[self.index_at(t)]

    def next_change(self, t: float) -> float:
        """The time of the first row after ``t`` (``inf`` if none)."""
        i = self.index_at(t) + 1
        return self.points[i].time_s if i < len(self.points) else math.inf

    @property
    def duration_s(self) -> float:
        return self.points[-1].time_s

    @property
    def max_capacity(self) -> int:
        return max(p.capacity for p in self.points)


def _bad(source: str, line: int, problem: str) -> ValueError:
    return ValueError(f"{source}:{line}: {problem}")


def parse_trace(text: str, source: str = "<trace>") -> Trace:
    """Parse the CSV ``text``; ``source`` names it in error messages."""
    points: list[TracePoint] = []
    header_seen = False
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        cells = [c.strip() for c in line.split(",")]
        if not header_seen:
            if tuple(cells) != HEADER:
                raise _bad(source, lineno, f"expected the header {','.join(HEADER)}, got {line!r}")
            header_seen = True
            continue
        if len(cells) != 3:
            raise _bad(
                source,
                lineno,
                f"expected 3 values (time_s,capacity,price_per_worker_hour), got {len(cells)}: {line!r}",
            )
        t_text, cap_text, price_text = cells
        try:
            t = float(t_text)
        except ValueError:
            raise _bad(source, lineno, f"time_s {t_text!r} is not a number") from None
        if not math.isfinite(t) or t < 0:
            raise _bad(source, lineno, f"time_s must be a finite number >= 0, got {t_text}")
        if not cap_text.isdigit():
            raise _bad(source, lineno, f"capacity must be a whole number >= 0, got {cap_text!r}")
        try:
            price = float(price_text)
        except ValueError:
            raise _bad(
                source, lineno, f"price_per_worker_hour {price_text!r} is not a number"
            ) from None
        if not math.isfinite(price) or price < 0:
            raise _bad(source, lineno, f"price_per_worker_hour must be >= 0, got {price_text}")
        if not points and t != 0:
            raise _bad(source, lineno, f"the first row must be at time_s 0, got {t_text}")
        if points and t <= points[-1].time_s:
            raise _bad(
                source, lineno, f"time_s must increase: {t_text} after {points[-1].time_s:g}"
            )
        points.append(TracePoint(t, int(cap_text), price))
    if not header_seen:
        raise ValueError(f"{source}: empty trace; expected the header {','.join(HEADER)}")
    if not points:
        raise ValueError(f"{source}: the trace has a header but no rows")
    return Trace(tuple(points), source)


def load_trace(path: str | Path) -> Trace:
    """Read and parse a trace file; a missing or unreadable file is a ``ValueError`` too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"trace file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read trace file {path}: {exc}") from None
    return parse_trace(text, str(path))
