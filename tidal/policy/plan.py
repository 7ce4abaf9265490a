"""Sizing helpers the cost policy shares: feasibility under a deadline, the budget cap,
the marginal throughput, and the decision that moves to a size (or holds)."""

from __future__ import annotations

from tidal.policy.common import Context, hold
from tidal.policy.inputs import Decision


def first_true(lo: int, hi: int, ok) -> int | None:
    """The smallest ``k`` in ``[lo, hi]`` with ``ok(k)``, assuming ``ok`` is monotone
    (False then True); None if ``ok(hi)`` is False."""
    if lo > hi or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def finish_time(ctx: Context, k: int) -> float:
    """Seconds to train the rest at ``k`` workers, a change costing the pause."""
    return (0.0 if k == ctx.n else ctx.pause) + ctx.time_left(k)


def fewest_feasible(
    ctx: Context, limit: float, lo: int | None = None, hi: int | None = None
) -> int | None:
    """The fewest workers in ``[lo, hi]`` (default ``[min, cap]``) that train the rest
    within ``limit`` seconds, a change costing the rescale pause (None if no size can).

    Moving to ``k`` takes ``pause + R / X(k)``, which the model makes monotone in ``k``
    above 1: a binary search over ``[max(lo, 2), cap]``, with size 1, the current size (no
    pause) and measured sizes (which may differ from the model a little) checked apart."""
    lo = ctx.lo if lo is None else lo
    hi = ctx.cap if hi is None else hi

    def ok(k: int) -> bool:
        return ctx.pause + ctx.time_left(k) <= limit

    here = lo <= ctx.n <= hi and ctx.time_left(ctx.n) <= limit
    found = [ctx.n] if here else []
    if lo == 1 and ok(1):
        found.append(1)
    k = first_true(max(lo, 2), hi, ok)
    if k is not None:
        found.append(k)
        found.extend(j for j in ctx.measured if lo <= j < k and ok(j))
    return min(found, default=None)


def budget_cap(ctx: Context, budget: float) -> int | None:
    """The largest size in ``[lo, cap]`` whose projected job cost fits ``budget`` (None if
    not even ``lo`` fits). Projected cost rises with ``k`` under the model (above 1)."""
    fits = [
        k for k in (ctx.lo, ctx.n) if ctx.lo <= k <= ctx.cap and ctx.projected_cost(k) <= budget
    ]
    lo = max(ctx.lo, 2)
    k = first_true(lo, ctx.cap, lambda j: ctx.projected_cost(j) > budget)
    if k is None:
        fits.append(ctx.cap)
    elif k - 1 >= lo:
        fits.append(k - 1)
    return max(fits, default=None)


def marginal(ctx: Context, k: int) -> float:
    """Samples/s the ``k``-th worker adds: ``X(k) - X(k - 1)`` (``X(1)`` for the first)."""
    return ctx.rate(k) - (ctx.rate(k - 1) if k > 1 else 0.0)


def to(ctx: Context, k: int, reason: str) -> Decision:
    """Move to ``k`` workers (hold when already there), saying why."""
    if k == ctx.n:
        return hold(ctx.m, reason, **ctx.predict(k))
    return Decision(target=k, reason=reason, predicted=ctx.predict(k))
