"""What a job has seen of its market so far: a running, time-weighted summary (no future).

``MarketTracker`` folds observations ``(elapsed_s, price, capacity)`` into a summary in O(1)
each; the value observed holds until the next observation, as trace rows do. ``summary()``
returns a frozen ``Market`` that a policy reads through ``Measurements.market``. Nothing here
looks ahead: the summary at time t is a function of the observations up to t only.

``Market`` fields: ``seconds`` observed; the time-weighted ``price_mean``, its ``price_min``
and ``price_max``; ``price_recent``, an exponentially weighted mean with a time constant of
``RECENT_S`` (the trend is ``price_recent - price_mean``); the time-weighted
``capacity_mean``, ``capacity_min``; ``outage_s``, the seconds with no capacity at all, and
``longest_outage_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RECENT_S = 3600.0


@dataclass(frozen=True, kw_only=True)
class Market:
    seconds: float
    price_mean: float
    price_min: float
    price_max: float
    price_recent: float
    capacity_mean: float
    capacity_min: int
    outage_s: float = 0.0
    longest_outage_s: float = 0.0

    def __post_init__(self) -> None:
        nums = (self.seconds, self.price_mean, self.price_min, self.price_max, self.price_recent)
        if not all(math.isfinite(x) and x >= 0 for x in nums):
            raise ValueError(f"Market: seconds and prices must be finite and >= 0, got {self}")
        if not self.price_min <= self.price_max:
            raise ValueError(f"Market: need price_min <= price_max, got {self}")
        if self.capacity_min < 0 or not self.capacity_mean >= 0:
            raise ValueError(f"Market: capacities must be >= 0, got {self}")
        if not 0 <= self.longest_outage_s <= self.outage_s <= self.seconds + 1e-9:
            raise ValueError(f"Market: need 0 <= longest_outage_s <= outage_s <= seconds: {self}")

    @property
    def outage_fraction(self) -> float:
        return self.outage_s / self.seconds if self.seconds > 0 else 0.0


class MarketTracker:
    """Running summary of observed prices and capacities; ``capacity`` None = unlimited
    (not counted). Observations must come in time order."""

    def __init__(self) -> None:
        self._t: float | None = None
        self._price = 0.0
        self._cap: int | None = None
        self._seconds = 0.0
        self._price_s = 0.0
        self._cap_s = 0.0
        self._cap_seconds = 0.0
        self._pmin = math.inf
        self._pmax = 0.0
        self._recent = 0.0
        self._cmin: int | None = None
        self._outage = 0.0
        self._run = 0.0
        self._longest = 0.0

    def observe(self, t: float, price: float, capacity: int | None) -> None:
        """The market at ``t`` (seconds since the job started) is ``price``, ``capacity``."""
        if self._t is not None:
            if t < self._t:
                raise ValueError(f"MarketTracker: time went back from {self._t} to {t}")
            self._advance(t)
        else:
            self._recent = price
        self._t, self._price, self._cap = t, price, capacity
        self._pmin, self._pmax = min(self._pmin, price), max(self._pmax, price)
        if capacity is not None:
            self._cmin = capacity if self._cmin is None else min(self._cmin, capacity)

    def _advance(self, t: float) -> None:
        dt = t - self._t
        if dt <= 0:
            return
        self._seconds += dt
        self._price_s += self._price * dt
        self._recent += (1.0 - math.exp(-dt / RECENT_S)) * (self._price - self._recent)
        if self._cap is not None:
            self._cap_s += self._cap * dt
            self._cap_seconds += dt
            if self._cap == 0:
                self._outage += dt
                self._run += dt
                self._longest = max(self._longest, self._run)
            else:
                self._run = 0.0
        self._t = t

    def summary(self, t: float | None = None) -> Market | None:
        """The summary up to ``t`` (default: the last observation); None before any."""
        if self._t is None:
            return None
        if t is not None and t > self._t:
            self.observe(t, self._price, self._cap)
        secs = self._seconds
        mean = self._price_s / secs if secs > 0 else self._price
        cap_mean = self._cap_s / self._cap_seconds if self._cap_seconds > 0 else (self._cap or 0)
        return Market(
            seconds=secs,
            price_mean=mean,
            price_min=self._pmin,
            price_max=self._pmax,
            price_recent=self._recent,
            capacity_mean=float(cap_mean),
            capacity_min=self._cmin or 0,
            outage_s=self._outage,
            longest_outage_s=self._longest,
        )
