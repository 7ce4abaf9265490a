"""What a scaling policy is given and what it answers: frozen, validated dataclasses.

A policy is a pure function ``Measurements -> Decision`` (see ``registry``). The coordinator
builds one ``Measurements`` per control-loop pass from what it measured; the simulator builds
them from its job model. Every number a policy uses arrives here, so a test can feed any
situation it likes. Invalid values raise ``ValueError`` with the fix in the message.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from tidal.config import JobSpec
from tidal.policy.market import Market


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


@dataclass(frozen=True, kw_only=True)
class SizeStats:
    """What was measured while the job trained at one world size (all generations of that
    size together, rescale pauses excluded).

    ``samples_per_s``: samples trained per second of training wall time at this size.
    ``samples`` / ``steps``: how many samples and optimizer steps that rate is based on.
    ``compute_s`` / ``comm_s``: optional mean per-step split of the step time into compute
    (forward, backward, optimizer) and waiting for gradient communication, averaged over the
    members; give both or neither. They let the throughput model separate the part that
    shrinks with more workers from the part that grows.
    """

    world_size: int
    samples_per_s: float
    samples: int
    steps: int
    compute_s: float | None = None
    comm_s: float | None = None

    def __post_init__(self) -> None:
        _check(self.world_size >= 1, f"SizeStats.world_size must be >= 1, got {self.world_size}")
        _check(
            math.isfinite(self.samples_per_s) and self.samples_per_s >= 0,
            f"SizeStats.samples_per_s must be a finite number >= 0, got {self.samples_per_s}",
        )
        _check(
            self.samples >= 0 and self.steps >= 0,
            f"SizeStats.samples and .steps must be >= 0, got {self.samples} and {self.steps}",
        )
        _check(
            (self.compute_s is None) == (self.comm_s is None),
            "SizeStats: give both compute_s and comm_s, or neither",
        )
        if self.compute_s is not None:
            _check(
                _finite(self.compute_s)
                and _finite(self.comm_s)
                and self.compute_s >= 0
                and self.comm_s >= 0
                and self.compute_s + self.comm_s > 0,
                f"SizeStats.compute_s and .comm_s must be >= 0 with a positive sum, got "
                f"{self.compute_s} and {self.comm_s}",
            )

    @property
    def has_split(self) -> bool:
        return self.compute_s is not None

    @property
    def seconds(self) -> float:
        """Training seconds behind the rate."""
        return self.samples / self.samples_per_s if self.samples_per_s > 0 else 0.0

    def trusted(self, params: PolicyParams) -> bool:
        """Enough measured to decide on: ``min_steps`` steps, or 2 steps and
        ``min_measure_s`` seconds."""
        if self.samples_per_s <= 0 or self.samples <= 0:
            return False
        return self.steps >= params.min_steps or (
            self.steps >= 2 and self.seconds >= params.min_measure_s
        )


@dataclass(frozen=True, kw_only=True)
class PolicyParams:
    """The knobs of the policies; built once per job from its flags (``from_spec``).

    ``min_efficiency``: the throughput policy grows while the marginal scaling efficiency
    stays at or above ``min_efficiency + hysteresis`` and shrinks below
    ``min_efficiency - hysteresis``. ``hysteresis`` is also the cost policy's relative
    size band: it shrinks only to a size at least that fraction smaller.
    ``cooldown_s``: no policy change within this many seconds of the last target change.
    ``min_steps``, ``min_measure_s``: a world size's measurement is trusted after
    ``min_steps`` steps at it, or after 2 steps that took ``min_measure_s`` seconds in all
    (slow steps are less noisy). See ``trusted``.
    ``deadline_s``: seconds from the job's start by which the cost policy must finish.
    ``budget``: dollars the whole job may cost (cost policy).
    ``assumed_pause_s``: the rescale pause assumed before one has been measured.
    ``horizon_s``: the training time still ahead assumed when ``max_steps`` is unknown.
    ``grow_fraction``: an exploration step is ``max(1, round(n * grow_fraction))`` workers.
    ``deadline_margin``: the cost policy plans to finish this fraction of the time left
    early (a reserve for capacity drops), and grows once its prediction eats half of it.
    ``price_premium``: the cost policy values work it puts off as if the future price were
    this fraction above what it has seen (the mean, or the recent level if higher): a hedge
    against rises it cannot foresee. 0 trusts the past entirely.
    """

    min_efficiency: float = JobSpec.min_efficiency
    hysteresis: float = 0.05
    cooldown_s: float = JobSpec.decision_interval_s
    min_steps: int = 20
    min_measure_s: float = 60.0
    deadline_s: float | None = None
    budget: float | None = None
    assumed_pause_s: float = 10.0
    horizon_s: float = 3600.0
    grow_fraction: float = 0.25
    deadline_margin: float = 0.01
    price_premium: float = 0.25

    @classmethod
    def from_spec(cls, spec: JobSpec, **knobs: Any) -> PolicyParams:
        """The one place a job's flags become policy knobs: every field named as a ``JobSpec``
        field takes the spec's value (``min_efficiency``, ``deadline_s``, ``budget``),
        ``cooldown_s`` is ``--decision-interval``; ``knobs`` set any other."""
        names = {f.name for f in fields(spec)} & {f.name for f in fields(cls)}
        shared = {name: getattr(spec, name) for name in names}
        return cls(**shared, cooldown_s=spec.decision_interval_s, **knobs)

    def __post_init__(self) -> None:
        _check(
            0 < self.min_efficiency <= 1,
            f"min_efficiency must be in (0, 1], got {self.min_efficiency}: e.g. 0.7",
        )
        _check(
            0 <= self.hysteresis < self.min_efficiency,
            f"hysteresis must be in [0, min_efficiency), got {self.hysteresis}: e.g. 0.05",
        )
        _check(
            math.isfinite(self.cooldown_s) and self.cooldown_s >= 0,
            f"cooldown_s must be >= 0, got {self.cooldown_s}",
        )
        _check(self.min_steps >= 1, f"min_steps must be >= 1, got {self.min_steps}")
        _check(
            math.isfinite(self.min_measure_s) and self.min_measure_s > 0,
            f"min_measure_s must be > 0, got {self.min_measure_s}",
        )
        _check(
            self.deadline_s is None or (math.isfinite(self.deadline_s) and self.deadline_s > 0),
            f"the deadline must be a positive duration, got {self.deadline_s} s: e.g. 36h",
        )
        _check(
            self.budget is None or (math.isfinite(self.budget) and self.budget > 0),
            f"the budget must be a positive number of dollars, got {self.budget}",
        )
        _check(
            math.isfinite(self.assumed_pause_s) and self.assumed_pause_s >= 0,
            f"assumed_pause_s must be >= 0, got {self.assumed_pause_s}",
        )
        _check(
            math.isfinite(self.horizon_s) and self.horizon_s > 0,
            f"horizon_s must be > 0, got {self.horizon_s}",
        )
        _check(
            0 < self.grow_fraction <= 4,
            f"grow_fraction must be in (0, 4], got {self.grow_fraction}: e.g. 0.25",
        )
        _check(
            0 <= self.deadline_margin < 0.5,
            f"deadline_margin must be in [0, 0.5), got {self.deadline_margin}: e.g. 0.01",
        )
        _check(
            0 <= self.price_premium <= 10,
            f"price_premium must be in [0, 10], got {self.price_premium}: e.g. 0.25",
        )


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """One snapshot of the job, as the coordinator (or the simulator) sees it now.

    ``step``: committed steps so far. ``world_size``: members of the current generation.
    ``target``: the target count now. ``min_workers``/``max_workers``: the job's bounds.
    ``stats``: one ``SizeStats`` per world size trained at so far (at most one per size).
    ``rescale_pause_s``: the mean measured training stall of a membership change (None:
    none measured yet). ``price_per_worker_hour``: dollars per worker-hour now.
    ``capacity``: workers available now (None: unlimited). ``max_steps``: the job's length
    in steps (None: unknown). ``elapsed_s``: seconds since the job started. ``spent``:
    dollars spent so far. ``since_change_s``: seconds since the target last changed, for
    whatever reason (None: never changed). ``market``: what was seen of prices and
    capacity since the job started (``market.MarketTracker``; None: nothing but now).
    ``params``: the policy knobs.
    """

    step: int
    world_size: int
    target: int
    min_workers: int
    max_workers: int
    stats: tuple[SizeStats, ...] = ()
    rescale_pause_s: float | None = None
    price_per_worker_hour: float = 0.0
    capacity: int | None = None
    max_steps: int | None = None
    elapsed_s: float = 0.0
    spent: float = 0.0
    since_change_s: float | None = None
    market: Market | None = None
    params: PolicyParams = field(default_factory=PolicyParams)

    def __post_init__(self) -> None:
        _check(self.step >= 0, f"step must be >= 0, got {self.step}")
        _check(self.world_size >= 0, f"world_size must be >= 0, got {self.world_size}")
        _check(self.target >= 0, f"target must be >= 0, got {self.target}")
        _check(
            1 <= self.min_workers <= self.max_workers,
            f"need 1 <= min_workers <= max_workers, got {self.min_workers} and "
            f"{self.max_workers}: raise --max-workers",
        )
        sizes = [s.world_size for s in self.stats]
        _check(
            len(sizes) == len(set(sizes)),
            f"stats must hold at most one SizeStats per world size, got sizes {sizes}",
        )
        _check(
            self.rescale_pause_s is None
            or (math.isfinite(self.rescale_pause_s) and self.rescale_pause_s >= 0),
            f"rescale_pause_s must be >= 0 or None, got {self.rescale_pause_s}",
        )
        _check(
            math.isfinite(self.price_per_worker_hour) and self.price_per_worker_hour >= 0,
            f"price_per_worker_hour must be >= 0, got {self.price_per_worker_hour}",
        )
        _check(
            self.capacity is None or self.capacity >= 0,
            f"capacity must be >= 0 or None, got {self.capacity}",
        )
        _check(
            self.max_steps is None or self.max_steps >= 1,
            f"max_steps must be >= 1 or None, got {self.max_steps}",
        )
        _check(
            math.isfinite(self.elapsed_s) and self.elapsed_s >= 0,
            f"elapsed_s must be >= 0, got {self.elapsed_s}",
        )
        _check(
            math.isfinite(self.spent) and self.spent >= 0, f"spent must be >= 0, got {self.spent}"
        )
        _check(
            self.since_change_s is None or self.since_change_s >= 0,
            f"since_change_s must be >= 0 or None, got {self.since_change_s}",
        )

    def stats_for(self, world_size: int) -> SizeStats | None:
        for s in self.stats:
            if s.world_size == world_size:
                return s
        return None


@dataclass(frozen=True, kw_only=True)
class Decision:
    """A policy's answer: the ``target`` worker count, the ``reason`` in words (with the
    measured numbers behind it), and ``predicted``: what the policy expects at that target
    (keys such as ``samples_per_s``, ``finish_s``, ``cost``, ``marginal_efficiency``)."""

    target: int
    reason: str
    predicted: dict[str, float] = field(default_factory=dict)


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``"90"`` or ``"90s"`` -> 90.0; ``"2h30m"`` -> 9000.0; units s, m, h, d."""
    t = text.strip().lower()
    try:
        value = float(t)
    except ValueError:
        value = None
    if value is None:
        parts = _DURATION_PART.findall(t)
        if not parts or "".join(n + u for n, u in parts) != t:
            raise ValueError(
                f"bad duration {text!r}: write seconds or NUMBER+UNIT parts, e.g. 5400, 90m, 1d12h"
            )
        value = sum(float(n) * _UNIT_S[u] for n, u in parts)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"bad duration {text!r}: it must be positive, e.g. 36h")
    return value
