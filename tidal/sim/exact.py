"""The oracle's exact search, for small problems: the optimum over every schedule.

A dynamic program over the slots whose states are (target, samples done, dollars spent,
pause left). Per target it keeps only the states that no other state beats on all three
(more samples, fewer dollars, less pause left): from a beaten state the same decisions can
only finish later or dearer, so the optimal schedule's states are always kept and the
cheapest finished schedule is the optimum. Accounting as the simulator's: the world size
is ``min(target, capacity)``; a change of it to more than 0 workers (not at the job's start)
stalls training for the pause, paid; a change to 0 leaves the pause running; the job stops
paying when its last sample is trained.
"""

from __future__ import annotations

import numpy as np

from tidal.sim.job import JobModel
from tidal.sim.oracle import Slots, rates

EXACT_MAX_SIZE = 20_000  # slots x targets^2 above which the exact search is not tried
EXACT_MAX_STEPS = 200_000  # (state, target) pairs it may try before giving up


def exact(job: JobModel, sl: Slots, lo: int, hi: int) -> tuple[int, ...] | None:
    """The optimum by a dynamic program over non-dominated states; None if it would take
    too long (more than ``EXACT_MAX_STEPS`` steps) or no schedule finishes in time."""
    sizes = list(range(lo, hi + 1))
    budget = EXACT_MAX_STEPS
    if len(sl) * len(sizes) ** 2 > EXACT_MAX_SIZE:
        return None
    work = float(job.total_samples)
    pause = job.rescale_pause_s
    caps, durs, prices = sl.cap.tolist(), sl.dur.tolist(), (sl.price / 3600.0).tolist()
    rate = {w: float(rates(job, np.array([w]))[0]) for w in range(0, hi + 1)}
    # state key: target; value: list of (samples, dollars, pause left, path)
    states: dict[int, list[tuple[float, float, float, tuple[int, ...]]]] = {}
    best: tuple[float, tuple[int, ...]] | None = None
    for i, (cap, d, p) in enumerate(zip(caps, durs, prices, strict=True)):
        nxt: dict[int, list] = {}
        sources = (
            [(None, (0.0, 0.0, 0.0, ()))]
            if i == 0
            else [(k, s) for k, lst in states.items() for s in lst]
        )
        budget -= len(sources) * len(sizes)
        if budget < 0:
            return None
        for prev, (done, spent, left, path) in sources:
            was = 0 if prev is None else min(prev, caps[i - 1])
            for t in sizes:
                w = min(t, cap)
                if w != was and w > 0 and i > 0:
                    left2 = pause
                else:
                    left2 = left
                train = max(0.0, d - left2) if w > 0 else 0.0
                gain = rate[w] * train
                if w > 0 and done + gain >= work * (1 - 1e-12):
                    end = min(d, left2) + (work - done) / rate[w]
                    total = spent + w * p * end
                    if best is None or total < best[0] - 1e-12:
                        best = (total, path + (t,))
                    continue
                cost = spent + w * p * d
                if best is not None and cost >= best[0]:
                    continue
                nxt.setdefault(t, []).append((done + gain, cost, max(0.0, left2 - d), path + (t,)))
        states = {k: _pareto(v) for k, v in nxt.items()}
    return best[1] if best is not None else None


def _pareto(states: list) -> list:
    """The states no other beats on samples (more), dollars and pause left (less)."""
    states.sort(key=lambda s: (-s[0], s[1], s[2]))
    kept: list = []
    for s in states:
        if not any(k[0] >= s[0] and k[1] <= s[1] and k[2] <= s[2] for k in kept):
            kept.append(s)
    return kept
