"""Capped exponential backoff with jitter: the one wait every retry loop of Tidal uses (a
worker's calls through a coordinator outage, a cloud metadata endpoint that errs).

Pure: the random draw is a fact passed in, so the rule is table-tested."""

from __future__ import annotations


def capped(failures: int, *, base_s: float, cap_s: float, draw: float) -> float:
    """The wait after ``failures`` errors in a row: ``min(cap_s, base_s * 2**failures)``,
    scaled into its upper half by ``draw`` (uniform in [0, 1)), so that processes that
    failed together do not retry together."""
    return min(cap_s, base_s * 2 ** min(failures, 64)) * (0.5 + 0.5 * draw)
