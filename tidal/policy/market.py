"""What a job has seen of its market so far: a running, time-weighted summary (no future).

``MarketTracker`` folds observations ``(t, price, capacity)`` into a summary; the value
observed holds until the next observation, as trace rows do. ``summary()`` returns a frozen
``Market`` that a policy reads through ``Measurements.market``. Nothing here looks ahead:
the summary at time t is a function of the observations up to t only. Times may start
before the job (a negative ``t``: the market's past, which a scheduler knows too).

``Market`` fields: ``seconds`` observed; the time-weighted ``price_mean``, ``price_median``,
``price_min`` and ``price_max``; ``price_recent``, the time-weighted median of the last
``RECENT_S`` (a spike shorter than half of it does not move it, a lasting step does);
``price_excursions``, how many times the price went more than ``BAND`` away from the
median and came back; ``price_persistence_s``, how long such an excursion lasts: their
seconds plus ``PRIOR_S`` over their number plus one (``PRIOR_S`` before any ended);
``price_excursion_s``, how long the price has been away now (0 within the band);
the time-weighted
``capacity_mean`` and the ``capacity_min``; ``outage_s``, the seconds without any
capacity, and ``longest_outage_s``; ``capacity_low``, the capacity exceeded 75% of the time
(time-weighted 25th percentile, 1% resolution).

Medians come from histograms of 1%-wide price buckets and are refreshed every
``REFRESH_S`` seconds of market time (and whenever a new price extreme appears), so a week
of one-minute rows costs milliseconds.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

RECENT_S = 7200.0
REFRESH_S = 300.0
BAND = 0.15
PRIOR_S = 3600.0
_BUCKET = math.log(1.01)


@dataclass(frozen=True, kw_only=True)
class Market:
    seconds: float
    price_mean: float
    price_median: float
    price_min: float
    price_max: float
    price_recent: float
    price_persistence_s: float
    capacity_mean: float
    capacity_min: int
    capacity_low: int = 0
    price_excursions: int = 0
    price_excursion_s: float = 0.0
    outage_s: float = 0.0
    longest_outage_s: float = 0.0

    def __post_init__(self) -> None:
        nums = (
            self.seconds,
            self.price_mean,
            self.price_median,
            self.price_min,
            self.price_max,
            self.price_recent,
        )
        if not all(math.isfinite(x) and x >= 0 for x in nums) or not self.price_persistence_s > 0:
            raise ValueError(f"Market: seconds and prices must be finite and >= 0, got {self}")
        if not self.price_min <= self.price_max:
            raise ValueError(f"Market: need price_min <= price_max, got {self}")
        if self.capacity_min < 0 or self.capacity_low < 0 or not self.capacity_mean >= 0:
            raise ValueError(f"Market: capacities must be >= 0, got {self}")
        if self.price_excursions < 0 or not 0 <= self.price_excursion_s <= self.seconds + 1e-6:
            raise ValueError(f"Market: excursions must be >= 0 and within seconds: {self}")
        if not 0 <= self.longest_outage_s <= self.outage_s <= self.seconds + 1e-6:
            raise ValueError(f"Market: need 0 <= longest_outage_s <= outage_s <= seconds: {self}")

    @property
    def outage_fraction(self) -> float:
        return self.outage_s / self.seconds if self.seconds > 0 else 0.0


class _Histogram:
    """Seconds per 1%-wide price bucket, with the weighted median."""

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.secs: dict[int, float] = {}
        self.total = 0.0

    @staticmethod
    def key(price: float) -> int:
        return round(math.log(price) / _BUCKET) if price > 0 else -(10**9)

    def add(self, price: float, dt: float) -> None:
        k = self.key(price)
        if k not in self.secs:
            bisect.insort(self.keys, k)
            self.secs[k] = 0.0
        self.secs[k] += dt
        self.total += dt

    def quantile(self, q: float) -> float | None:
        if self.total <= 0:
            return None
        part, run = self.total * q, 0.0
        for k in self.keys:
            run += self.secs[k]
            if run >= part:
                return math.exp(k * _BUCKET) if k > -(10**9) else 0.0
        return None

    def median(self) -> float | None:
        return self.quantile(0.5)


class MarketTracker:
    """Running summary of observed prices and capacities; ``capacity`` None = unlimited
    (not counted). Observations must come in time order."""

    def __init__(self) -> None:
        self._t: float | None = None
        self._price = 0.0
        self._cap: int | None = None
        self._seconds = self._price_s = self._cap_s = self._cap_seconds = 0.0
        self._pmin, self._pmax = math.inf, 0.0
        self._cmin: int | None = None
        self._outage = self._run = self._longest = 0.0
        self._all = _Histogram()
        self._window = _Histogram()
        self._caps = _Histogram()
        self._recent: deque[tuple[float, float, float]] = deque()  # (t0, t1, price)
        self._medians: tuple[float, float, int] | None = None
        self._refreshed = -math.inf
        self._side = 0  # +1 above the median's band, -1 below, 0 within
        self._excursions = 0  # ended
        self._outside = 0.0  # seconds in ended excursions
        self._away = 0.0  # seconds in the current one

    def observe(self, t: float, price: float, capacity: int | None) -> None:
        """The market at ``t`` (seconds since the job started) is ``price``, ``capacity``."""
        if self._t is not None:
            if t < self._t:
                raise ValueError(f"MarketTracker: time went back from {self._t} to {t}")
            self._advance(t)
        if price < self._pmin or price > self._pmax:
            self._medians = None  # a new extreme: refresh the medians
        self._t, self._price, self._cap = t, price, capacity
        self._pmin, self._pmax = min(self._pmin, price), max(self._pmax, price)
        if capacity is not None:
            self._cmin = capacity if self._cmin is None else min(self._cmin, capacity)
        mid = self._refresh()[0]
        side = 1 if price > mid * (1 + BAND) else -1 if price < mid * (1 - BAND) else 0
        if side != self._side:
            if self._side != 0:  # an excursion ended (into the band, or across it)
                self._excursions += 1
                self._outside += self._away
            self._away = 0.0
            self._side = side

    def _refresh(self) -> tuple[float, float, int]:
        """The (whole, recent) median prices and the low capacity, recomputed when stale."""
        if self._medians is None or self._t - self._refreshed >= REFRESH_S:
            whole = self._all.median()
            recent = self._window.median()
            low = self._caps.quantile(0.25)
            self._medians = (
                self._price if whole is None else whole,
                self._price if recent is None else recent,
                (self._cap or 0) if low is None else int(low + 0.5),
            )
            self._refreshed = self._t
        return self._medians

    def _advance(self, t: float) -> None:
        dt = t - self._t
        if dt <= 0:
            return
        self._seconds += dt
        self._away += dt if self._side else 0.0
        self._price_s += self._price * dt
        self._all.add(self._price, dt)
        self._window.add(self._price, dt)
        self._recent.append((self._t, t, self._price))
        while self._recent and self._recent[0][1] <= t - RECENT_S:
            t0, t1, p = self._recent.popleft()
            self._window.add(p, -(t1 - t0))
        if self._cap is not None:
            self._caps.add(float(self._cap), dt)
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
        whole, recent, low = self._refresh()
        cap_mean = self._cap_s / self._cap_seconds if self._cap_seconds > 0 else (self._cap or 0)
        return Market(
            seconds=secs,
            price_mean=self._price_s / secs if secs > 0 else self._price,
            price_median=whole,
            price_min=self._pmin,
            price_max=self._pmax,
            price_recent=recent,
            price_persistence_s=(self._outside + PRIOR_S) / (self._excursions + 1),
            price_excursions=self._excursions,
            price_excursion_s=self._away,
            capacity_mean=float(cap_mean),
            capacity_min=self._cmin or 0,
            capacity_low=low,
            outage_s=self._outage,
            longest_outage_s=self._longest,
        )
