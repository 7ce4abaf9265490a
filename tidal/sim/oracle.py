"""The hindsight optimum ("oracle"): the cheapest schedule of worker counts that finishes the
job by the deadline, computed with the whole trace and the job model known in advance.

**Schedule space.** The time from the job's start to the deadline is cut into *slots*: the
trace's rows, runs of equal rows merged, then cut into pieces of at most ``grid_s`` seconds
(``auto_grid``: 60 s, coarser for long deadlines). A schedule is one target per slot; as
everywhere in the simulator the world size is ``min(target, capacity)``, a change of it
stalls training for the rescale pause (paid), and the job stops paying when its last sample
is trained. Targets are every size in ``[min, max]`` when there are at most ``ALL_SIZES``
of them, else a geometric grid of ``GRID_SIZES`` sizes (steps of about 10% between 1 and
10,000), refined around the sizes the best schedules use plus the trace's capacity levels when there are few: near its optimum the cost is
flat in the size, so the grid costs well under 0.1% (``docs/policies.md``).

**Exact search** (``exact.exact``), used when the problem is small: a dynamic program over
slots whose states are (target, samples done, dollars spent, pause left), keeping per target
only the states no other state beats on all three (more samples, fewer dollars, less pause):
every schedule that could still be the cheapest is kept, so the result is the optimum. The
tests compare it with a brute-force enumeration of every schedule.

**Lagrangian dynamic program** (``lagrangian``), for any size: with ``lam`` the value of a
sample in dollars, the schedule maximising ``lam * samples - dollars`` is found by a dynamic
program over (slot, target) in O(slots x targets): from slot to slot a target is kept
(paying the pause if the capacity moved its world size) or changed (from the best previous
state, paying the pause), and the job may stop after any slot. Samples rise with ``lam``;
``lam`` is searched (16 values at once, 4 rounds, vectorised with numpy) for the smallest
value whose schedule trains every sample by the deadline. That schedule, replayed by the
simulator, is the oracle's row (the cheapest of it and static-max, which is always
feasible when the deadline comes from static-max). Every ``lam`` also gives a lower bound,
``lam * samples - value(lam)``, on the cost of any schedule in the space: the row carries
the best one (``lower_bound``), so the oracle's distance from the true optimum is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tidal.sim.job import JobModel
from tidal.sim.trace import Trace

ALL_SIZES = 160
GRID_SIZES = 96
LAMBDAS = 12
ROUNDS = 4


@dataclass(frozen=True)
class Slots:
    """The oracle's time slots: ``start`` (seconds since the job started), ``dur``,
    ``price`` ($ per worker-hour) and ``cap`` (workers), one entry per slot."""

    start: np.ndarray
    dur: np.ndarray
    price: np.ndarray
    cap: np.ndarray

    def __len__(self) -> int:
        return len(self.dur)

    def as_trace(self, trace: Trace, start_s: float) -> Trace:
        """``trace`` with a row at every slot start (equal rows where a row was cut), so
        that the simulator asks a scripted policy at every slot."""
        from tidal.sim.trace import TracePoint

        before = [p for p in trace.points if p.time_s < start_s]
        rows = [
            TracePoint(start_s + s, int(c), p)
            for s, p, c in zip(
                self.start.tolist(), self.price.tolist(), self.cap.tolist(), strict=True
            )
        ]
        end = start_s + float(self.start[-1] + self.dur[-1])
        last = trace.at(end)
        after = [TracePoint(end, last.capacity, last.price_per_worker_hour)]
        after += [p for p in trace.points if p.time_s > end]
        return Trace(tuple(before + rows + after), trace.source)


def auto_grid(deadline_s: float) -> float:
    """Slots of at most a minute, or 1/2000 of the deadline when that is longer."""
    return max(60.0, deadline_s / 2000.0)


def make_slots(trace: Trace, start_s: float, deadline_s: float, grid_s: float) -> Slots:
    """The slots of ``[start_s, start_s + deadline_s)``, relative to the job's start."""
    end = start_s + deadline_s
    runs: list[list[float]] = []  # [t0, t1, price, cap]
    i = trace.index_at(start_s)
    t = start_s
    pts = trace.points
    while t < end:
        t1 = min(end, pts[i + 1].time_s if i + 1 < len(pts) else math.inf)
        p, c = pts[i].price_per_worker_hour, pts[i].capacity
        if runs and runs[-1][2] == p and runs[-1][3] == c:
            runs[-1][1] = t1
        else:
            runs.append([t, t1, p, c])
        t, i = t1, i + 1
    start, dur, price, cap = [], [], [], []
    for t0, t1, p, c in runs:
        n = max(1, math.ceil((t1 - t0) / grid_s - 1e-9))
        step = (t1 - t0) / n
        for k in range(n):
            start.append(t0 + k * step - start_s)
            dur.append(step)
            price.append(p)
            cap.append(c)
    return Slots(
        np.array(start, dtype=float),
        np.array(dur, dtype=float),
        np.array(price, dtype=float),
        np.array(cap, dtype=np.int64),
    )


def candidate_sizes(lo: int, hi: int, caps: np.ndarray) -> np.ndarray:
    """Every size in ``[lo, hi]``, or a geometric grid with the capacity levels."""
    if hi - lo + 1 <= ALL_SIZES:
        return np.arange(lo, hi + 1, dtype=np.int64)
    grid = np.unique(np.round(np.geomspace(lo, hi, GRID_SIZES)).astype(np.int64))
    levels = np.unique(caps[(caps >= lo) & (caps <= hi)])
    if len(levels) <= 40:
        grid = np.union1d(grid, levels)
    return np.union1d(grid, [lo, hi]).astype(np.int64)


def rates(job: JobModel, world: np.ndarray) -> np.ndarray:
    """Samples/s at each world size (0 at 0): the job model, vectorised."""
    w = np.maximum(world, 1).astype(float)
    comm = np.where(w > 1, 2.0 * (w - 1) / w * job.grad_bytes / job.bandwidth_bytes_s, 0.0)
    comm = comm + np.where(w > 1, job.latency_s, 0.0)
    x = job.global_batch / (job.global_batch / w * job.compute_s_per_sample + comm)
    for n, step_s in job.measured_step_s:  # a measured model's own sizes
        x = np.where(world == n, job.global_batch / step_s, x)
    return np.where(world > 0, x, 0.0)


class _Tables:
    """Per (slot, target) arrays the dynamic program reads."""

    def __init__(self, job: JobModel, sl: Slots, sizes: np.ndarray) -> None:
        self.sizes = sizes
        under = sizes[None, :] <= sl.cap[:, None]
        world = np.where(under, sizes[None, :], sl.cap[:, None])
        x = np.where(under, rates(job, sizes)[None, :], rates(job, sl.cap)[:, None])
        self.gain = sl.dur[:, None] * x  # samples a slot trains without a pause
        self.cost = sl.dur[:, None] * sl.price[:, None] / 3600.0 * world
        lost = np.minimum(job.rescale_pause_s, sl.dur)[:, None] * x
        moved = np.zeros(world.shape, dtype=bool)  # the job's start costs no pause
        moved[1:] = (world[1:] != world[:-1]) & (world[1:] > 0)
        self.keep = self.gain - lost * moved  # keep the target (the capacity may move it)
        self.switch = self.gain - lost * (world > 0)  # change the target: a pause
        # A change of target that leaves the world size alone (both above the capacity):
        # the new world equals the previous capacity, reached from any target >= it.
        prev_cap = np.concatenate([sl.cap[:1], sl.cap[:-1]])
        self.from_idx = np.searchsorted(sizes, prev_cap)  # first target >= prev capacity
        self.capped = (world == prev_cap[:, None]) & (world > 0)
        self.capped[0] = False
        self.has_capped = self.capped.any(axis=1) & (self.from_idx < len(sizes))


def _values(tab: _Tables, lams: np.ndarray) -> np.ndarray:
    """``max over schedules of lam * samples - dollars`` for each ``lam`` (stopping allowed
    after any slot; 0 = not starting)."""
    lam = lams[:, None]
    f = lam * tab.gain[0] - tab.cost[0]
    top = f.max(axis=1)
    best = np.maximum(0.0, top)
    keep, switch, cost, capped = tab.keep, tab.switch, tab.cost, tab.has_capped
    for i in range(1, tab.gain.shape[0]):
        new = f + lam * keep[i]
        np.maximum(new, top[:, None] + lam * switch[i], out=new)
        if capped[i]:
            cm = f[:, tab.from_idx[i] :].max(axis=1)[:, None]
            mask = tab.capped[i]
            new[:, mask] = np.maximum(new[:, mask], cm + lam * tab.gain[i, mask])
        new -= cost[i]
        f = new
        top = f.max(axis=1)
        np.maximum(best, top, out=best)
    return best


def _schedule(tab: _Tables, lam: float) -> tuple[list[int], float]:
    """The schedule maximising ``lam * samples - dollars`` and its value (backtracked)."""
    n, k = tab.gain.shape
    back = np.empty((n, k), dtype=np.int32)
    idx = np.arange(k, dtype=np.int32)
    f = lam * tab.gain[0] - tab.cost[0]
    back[0] = idx
    j = int(f.argmax())
    best, at = (float(f[j]), (0, j)) if f[j] > 0 else (0.0, None)
    for i in range(1, n):
        j = int(f.argmax())
        keep = f + lam * tab.keep[i]
        move = f[j] + lam * tab.switch[i]
        choice = np.where(move > keep, j, idx)
        new = np.maximum(keep, move)
        if tab.has_capped[i]:
            lo = int(tab.from_idx[i])
            jj = lo + int(f[lo:].argmax())
            mask = tab.capped[i]
            alt = f[jj] + lam * tab.gain[i]
            take = mask & (alt > new)
            choice = np.where(take, jj, choice)
            new = np.where(take, alt, new)
        new -= tab.cost[i]
        back[i] = choice
        f = new
        j = int(f.argmax())
        if f[j] > best:
            best, at = float(f[j]), (i, j)
    if at is None:
        return [], 0.0
    i, j = at
    path = [0] * (i + 1)
    while i >= 0:
        path[i] = j
        j = int(back[i, j])
        i -= 1
    return [int(tab.sizes[p]) for p in path], best


def evaluate(tab: _Tables, sl: Slots, work: float, targets: np.ndarray) -> tuple[float, float]:
    """(completion time, dollars) of one target per slot, the last holding after (inf if
    it does not finish within the slots); pauses as in the dynamic program."""
    k = np.searchsorted(tab.sizes, targets)
    rows = np.arange(len(targets))
    prev = np.concatenate([k[:1], k[:-1]])
    same = (k == prev) | (tab.capped[rows, k] & (tab.sizes[prev] >= sl.cap[rows - 1]))
    gained = np.where(same, tab.keep[rows, k], tab.switch[rows, k])
    gained[0] = tab.gain[0, k[0]]
    done = np.cumsum(gained)
    i = int(np.searchsorted(done, work * (1 - 1e-12)))
    if i >= len(targets):
        return math.inf, math.inf
    before = float(done[i - 1]) if i else 0.0
    rate = tab.gain[i, k[i]] / sl.dur[i]
    lost = tab.gain[i, k[i]] - gained[i]
    t_in = lost / rate + (work - before) / rate
    spent = float(tab.cost[rows[:i], k[:i]].sum()) + tab.cost[i, k[i]] * t_in / sl.dur[i]
    return float(sl.start[i] + t_in), spent


def _crossover(
    tab: _Tables, sl: Slots, work: float, deadline: float, cheap: np.ndarray, sure: np.ndarray
) -> list[np.ndarray]:
    """Schedules that follow ``sure`` (finishes in time) until a slot and ``cheap`` (does
    not) after it, or the other way round, at the slot found by bisection that just
    finishes in time: the two schedules' integer sizes mixed at a pause's cost."""
    out = []
    n = len(cheap)
    for first, second in ((sure, cheap), (cheap, sure)):

        def mixed(m: int, first=first, second=second) -> np.ndarray:
            return np.concatenate([first[:m], second[m:]])

        # m = n is all ``first``; m = 0 all ``second``: one end finishes in time.
        ok_at_n = evaluate(tab, sl, work, mixed(n))[0] <= deadline
        lo, hi = 0, n  # invariant: the "sure" end finishes, the other may not
        if not ok_at_n:
            lo, hi = hi, lo
        for _ in range(40):
            if abs(hi - lo) <= 1:
                break
            mid = (lo + hi) // 2
            if evaluate(tab, sl, work, mixed(mid))[0] <= deadline:
                lo = mid
            else:
                hi = mid
        out.append(mixed(lo))
    return out


def _search(tab: _Tables, work: float, a: float, b: float, rounds: int):
    """Narrow ``[a, b]`` (log lam) around the smallest lam whose schedule trains ``work``
    samples; None if even ``b``'s does not. Returns (a, b, best lower bound)."""
    bound = -math.inf
    for _ in range(rounds):
        lams = np.exp(np.linspace(a, b, LAMBDAS))
        vals = _values(tab, lams)
        bound = max(bound, float((lams * work - vals).max()))
        # The samples of lam's schedule are the slope of value(lam), which is convex: the
        # secant slopes bracket them, so lam* lies between the neighbours of the first
        # secant that reaches the job's samples.
        slopes = np.diff(vals) / np.diff(lams)
        over = np.nonzero(slopes >= work)[0]
        if len(over) == 0:
            return None
        j = int(over[0])
        a, b = math.log(lams[max(0, j - 1)]), math.log(lams[j + 1])
    return a, b, bound


def _refined(sizes: np.ndarray, used: np.ndarray, limit: int = 192) -> np.ndarray:
    """``sizes`` plus every size between the grid neighbours of the ``used`` ones."""
    extra: list[np.ndarray] = [sizes]
    total = len(sizes)
    for s in used.tolist():
        k = int(np.searchsorted(sizes, s))
        lo = int(sizes[max(0, k - 1)])
        hi = int(sizes[min(len(sizes) - 1, k + 1)])
        if total + hi - lo > limit:
            break
        extra.append(np.arange(lo, hi + 1, dtype=np.int64))
        total += hi - lo
    return np.unique(np.concatenate(extra))


def lagrangian(
    job: JobModel, sl: Slots, lo: int, hi: int, feasible
) -> tuple[list[tuple[int, ...]], float | None]:
    """Candidate schedules, cheapest found first, and the best lower bound.

    ``feasible(schedule)`` -> (finished by the deadline, cost): the simulator's verdict."""
    sizes = candidate_sizes(lo, hi, sl.cap)
    tab = _Tables(job, sl, sizes)
    work = float(job.total_samples)
    deadline = float(sl.start[-1] + sl.dur[-1])
    x = rates(job, np.arange(1, 3))
    price_hi = float(sl.price.max()) / 3600.0 or 1e-12
    price_lo = float(sl.price[sl.price > 0].min()) / 3600.0 if (sl.price > 0).any() else 1e-12
    top = rates(job, np.array([hi - 1, hi])) if hi > 1 else x
    marginal = max(float(top[1] - top[0]), 1e-12) if hi > 1 else float(x[0])
    lam_lo = 0.25 * price_lo / float(x[0])
    lam_hi = 16.0 * max(price_hi / marginal, price_hi * hi / float(top[-1]))
    found = _search(tab, work, math.log(lam_lo), math.log(lam_hi), ROUNDS)
    if found is None:
        return [], None  # not even the fastest schedule finishes in time
    a, b, bound = found

    def padded(path: list[int]) -> np.ndarray:
        full = np.full(len(sl), path[-1] if path else lo, dtype=np.int64)
        full[: len(path)] = path
        return full

    def bracket(tab: _Tables, a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
        sure = padded(_schedule(tab, math.exp(b))[0])
        for _ in range(8):  # the bracket's top should finish; make sure it does
            if evaluate(tab, sl, work, sure)[0] <= deadline:
                break
            b += 0.02
            sure = padded(_schedule(tab, math.exp(b))[0])
        return padded(_schedule(tab, math.exp(a))[0]), sure

    cheap, sure = bracket(tab, a, b)
    # The grid may skip the sizes the optimum needs: add every size around those used.
    finer = _refined(sizes, np.union1d(cheap, sure))
    if len(finer) > len(sizes):
        tab = _Tables(job, sl, finer)
        again = _search(tab, work, a - 0.05, b + 0.05, 2)
        if again is not None:
            a, b, bound = again
            cheap, sure = bracket(tab, a, b)
    found = [sure, *_crossover(tab, sl, work, deadline, cheap, sure)]
    found.sort(key=lambda p: evaluate(tab, sl, work, p)[1])
    plans: list[tuple[int, ...]] = []
    for plan in found:
        plan_t = _trim(plan)
        if plan_t not in plans:
            plans.append(plan_t)
        if feasible(plan_t)[0]:
            break
    return plans, bound


def _trim(plan: np.ndarray) -> tuple[int, ...]:
    """The schedule without its constant tail (the last target holds anyway)."""
    end = len(plan)
    while end > 1 and plan[end - 1] == plan[end - 2]:
        end -= 1
    return tuple(int(v) for v in plan[:end])
