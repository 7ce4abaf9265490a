"""What every adaptive policy does first: the gates, and the view of the job it decides on.

``gate(m)`` answers with a ``Decision`` when the policy must not (or need not) think now:

1. the capacity (or ``max_workers``) fell below the target: follow it down at once (the
   cost policy keeps its target and lets the world size follow the capacity);
2. the world size has not reached the target (or the capacity) yet: wait for it;
3. the current size's measurement is not trusted yet (``SizeStats.trusted``): measure
   (the cost policy, whose world size follows a churning capacity, decides from the model
   fitted to the sizes it did measure once there is one);
4. the target changed less than ``params.cooldown_s`` ago: cool down (no flapping).

Otherwise it returns a ``Context``: the fitted throughput model, the sizes allowed now, the
work left and the rescale pause, from which the policy picks its target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tidal.policy.inputs import Decision, Measurements
from tidal.policy.model import ScalingModel, fit


def rate(x: float) -> str:
    return f"{x:,.0f} samples/s" if x >= 100 else f"{x:,.3g} samples/s"


def dur(s: float) -> str:
    if not math.isfinite(s):
        return "forever"
    if s >= 7200:
        return f"{s / 3600:,.1f} h"
    if s >= 120:
        return f"{s / 60:,.1f} min"
    return f"{s:,.1f} s"


def hold(m: Measurements, why: str, **predicted: float) -> Decision:
    return Decision(target=m.target, reason=why, predicted=dict(predicted))


@dataclass(frozen=True)
class Context:
    """The job as a policy sees it once the gates are passed.

    ``n``: the world size (== target). ``lo``..``cap``: the sizes allowed now (``cap`` is
    the least of ``max_workers``, the capacity and the samples per step). ``measured``:
    samples/s of every trusted size. ``remaining``: samples left
    (``max_steps`` known) or what the current size trains in ``horizon_s`` (``known_end``
    False). ``pause``: the measured rescale pause, else ``assumed_pause_s``.
    """

    m: Measurements
    n: int
    lo: int
    cap: int
    model: ScalingModel
    measured: dict[int, float]
    remaining: float
    known_end: bool
    pause: float
    samples_per_step: float
    _rates: dict[int, float] = field(default_factory=dict, compare=False, repr=False)

    def rate(self, k: int) -> float:
        """Samples/s at ``k`` workers: measured if trusted, else the model's prediction."""
        got = self._rates.get(k)
        if got is None:
            got = self.measured.get(k)
            if got is None:
                got = self.model.samples_per_s(k)
            self._rates[k] = got
        return got

    def efficiency(self, a: int, b: int) -> float:
        """Marginal scaling efficiency from ``a`` to ``b`` workers (``a < b``): the throughput
        each added worker brings, as a fraction of what each of the ``a`` workers delivers."""
        xa, xb = self.rate(a), self.rate(b)
        return ((xb - xa) / (b - a)) / (xa / a)

    def time_left(self, k: int) -> float:
        """Seconds to train the remaining samples at ``k`` workers (no pause)."""
        return self.remaining / self.rate(k)

    def dollars_per_sample(self, k: int) -> float:
        return k * self.m.price_per_worker_hour / 3600.0 / self.rate(k)

    def projected_cost(self, k: int) -> float:
        """Dollars for the whole job if it goes to ``k`` workers now and stays there."""
        pause = 0.0 if k == self.n else self.pause
        price = self.m.price_per_worker_hour / 3600.0
        return self.m.spent + k * price * (pause + self.time_left(k))

    def predict(self, k: int) -> dict[str, float]:
        out = {"samples_per_s": self.rate(k), "cost_per_sample": self.dollars_per_sample(k)}
        if self.known_end:
            pause = 0.0 if k == self.n else self.pause
            out["finish_s"] = self.m.elapsed_s + pause + self.time_left(k)
            out["cost"] = self.projected_cost(k)
        return out

    def shown(self, k: int) -> str:
        """``k``'s rate in words, saying whether it was measured or predicted."""
        word = "measured" if k in self.measured else "predicted"
        return f"{k}: {rate(self.rate(k))} {word}"


def gate(m: Measurements, *, follow_capacity: bool = True) -> Decision | Context:
    """The gates (module docstring), or the ``Context`` to decide on. With
    ``follow_capacity`` False the target may stay above the capacity (the world size
    follows the capacity down and back without a decision, as static's does); it still
    follows ``max_workers`` down."""
    p = m.params
    ceiling = m.max_workers if m.capacity is None else min(m.max_workers, m.capacity)
    bound = ceiling if follow_capacity else m.max_workers
    if m.target > max(m.min_workers, bound):
        new = max(m.min_workers, bound)
        what = f"capacity is {m.capacity} workers now" if m.capacity is not None else ""
        if m.capacity is None or m.capacity >= m.max_workers or not follow_capacity:
            what = f"--max-workers is {m.max_workers}"
        return Decision(target=new, reason=f"{what}, below the target {m.target}")
    reachable = min(m.target, max(ceiling, 0))
    if m.world_size != reachable:
        return hold(m, f"waiting for the world size ({m.world_size}) to reach {reachable}")
    if m.world_size == 0:
        return hold(m, "no capacity now: nothing trains, waiting for it to come back")
    here = m.stats_for(m.world_size)
    trusted = [s for s in m.stats if s.trusted(p)]
    if (here is None or not here.trusted(p)) and (follow_capacity or not trusted):
        steps = here.steps if here is not None else 0
        return hold(m, f"measuring {m.world_size} workers: {steps}/{p.min_steps} steps")
    if m.since_change_s is not None and m.since_change_s < p.cooldown_s:
        return hold(
            m,
            f"cooling down: last change {dur(m.since_change_s)} ago < {dur(p.cooldown_s)}",
        )
    model = fit(trusted)
    if model is None:  # unreachable: a size is trusted
        return hold(m, f"no throughput measured at {m.world_size} workers yet")
    total_samples = sum(s.samples for s in m.stats)
    total_steps = sum(s.steps for s in m.stats)
    per_step = total_samples / total_steps if total_steps else math.inf
    cap = max(m.min_workers, min(ceiling, int(per_step) if math.isfinite(per_step) else ceiling))
    measured = {s.world_size: s.samples_per_s for s in trusted}
    if m.max_steps is not None and math.isfinite(per_step):
        remaining, known_end = max(0.0, (m.max_steps - m.step) * per_step), True
    else:
        now = here.samples_per_s if here is not None and here.trusted(p) else None
        rate_now = now if now is not None else model.samples_per_s(max(1, m.world_size))
        remaining, known_end = rate_now * p.horizon_s, False
    pause = m.rescale_pause_s if m.rescale_pause_s is not None else p.assumed_pause_s
    return Context(
        m=m,
        n=m.world_size,
        lo=m.min_workers,
        cap=cap,
        model=model,
        measured=measured,
        remaining=remaining,
        known_end=known_end,
        pause=pause,
        samples_per_step=per_step,
    )
