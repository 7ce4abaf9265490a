"""The ``cost`` policy: the fewest workers that meet the deadline, within the budget.

After the gates of ``common.gate``, with ``R`` the samples left, ``X(k)`` the samples/s at
``k`` workers (measured, else the fitted model), ``left`` the seconds to the deadline and
``margin`` = ``deadline_margin``:

- **deadline** (``params.deadline_s``, needs ``max_steps``): ``k`` is feasible when
  ``pause + R / X(k) <= left - reserve`` (no pause if ``k == n``; ``reserve`` = ``margin``
  x ``left``, at least 3 rescale pauses, kept for capacity drops and model error; eaten
  into when nothing else fits).
  The plan is the
  fewest feasible workers (the fastest allowed size when none is). Grow to the plan when
  the current size is behind (``R / X(n) > left - reserve / 2``); shrink to it only when
  it is at least ``hysteresis`` smaller than ``n`` and saves more dollars than the pause
  costs; else hold. With a ``budget`` too, the plan is capped at the largest size whose
  projected job cost fits the budget (the budget wins over the deadline).
- **budget only**: the throughput rule (``throughput.decide``) limited to the sizes whose
  projected job cost ``spent + k * price * (pause + R / X(k))`` fits the budget: it stops
  growing when the budget would be exceeded and shrinks when the projection exceeds it.
- **neither**: the cheapest $/sample, which under the model is ``min_workers``.
"""

from __future__ import annotations

from tidal.policy.common import Context, dur, gate, hold, rate
from tidal.policy.inputs import Decision, Measurements
from tidal.policy.throughput import decide as throughput_decide


def _first_true(lo: int, hi: int, ok) -> int | None:
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


def _finish_time(ctx: Context, k: int) -> float:
    return (0.0 if k == ctx.n else ctx.pause) + ctx.time_left(k)


def _fewest_feasible(ctx: Context, limit: float) -> int | None:
    """The fewest workers in ``[lo, cap]`` that train the rest within ``limit`` seconds,
    a change costing the rescale pause (None if no size can).

    Moving to ``k`` takes ``pause + R / X(k)``, which the model makes monotone in ``k``
    above 1: a binary search over ``[max(lo, 2), cap]``, with size 1, the current size (no
    pause) and measured sizes (which may differ from the model a little) checked apart."""

    def ok(k: int) -> bool:
        return ctx.pause + ctx.time_left(k) <= limit

    here = ctx.lo <= ctx.n <= ctx.cap and ctx.time_left(ctx.n) <= limit
    found = [ctx.n] if here else []
    if ctx.lo == 1 and ok(1):
        found.append(1)
    k = _first_true(max(ctx.lo, 2), ctx.cap, ok)
    if k is not None:
        found.append(k)
        found.extend(j for j in ctx.measured if ctx.lo <= j < k and ok(j))
    return min(found, default=None)


def _budget_cap(ctx: Context, budget: float) -> int | None:
    """The largest size in ``[lo, cap]`` whose projected job cost fits ``budget`` (None if
    not even ``lo`` fits). Projected cost rises with ``k`` under the model (above 1)."""
    fits = [
        k for k in (ctx.lo, ctx.n) if ctx.lo <= k <= ctx.cap and ctx.projected_cost(k) <= budget
    ]
    lo = max(ctx.lo, 2)
    k = _first_true(lo, ctx.cap, lambda j: ctx.projected_cost(j) > budget)
    if k is None:
        fits.append(ctx.cap)
    elif k - 1 >= lo:
        fits.append(k - 1)
    return max(fits, default=None)


def _deadline(ctx: Context, deadline_s: float, budget: float | None) -> Decision:
    m, n, p = ctx.m, ctx.n, ctx.m.params
    left = deadline_s - m.elapsed_s
    reserve = max(p.deadline_margin * left, 3 * ctx.pause, 0.0)
    finish_n = ctx.time_left(n)
    plan = _fewest_feasible(ctx, left - reserve) if left > reserve else None
    if plan is None and left > 0:
        plan = _fewest_feasible(ctx, left)  # eat into the reserve
    why = ""
    if plan is None:
        plan = max((ctx.lo, ctx.cap), key=ctx.rate)  # the fastest allowed
        why = (
            f"the deadline cannot be met: even {plan} workers ({rate(ctx.rate(plan))}) "
            f"need {dur(_finish_time(ctx, plan))}, {dur(max(0.0, left))} left; "
        )
    if budget is not None:
        allowed = _budget_cap(ctx, budget)
        if allowed is None:
            return _over_budget(ctx, budget)
        if plan > allowed:
            why += (
                f"the budget ${budget:,.2f} allows at most {allowed} workers "
                f"(projected ${ctx.projected_cost(allowed):,.2f}); "
            )
            plan = allowed
    head = (
        f"deadline in {dur(left)} (reserve {dur(reserve)}): {n} workers need "
        f"{dur(finish_n)} at {rate(ctx.rate(n))}; {plan} workers need "
        f"{dur(_finish_time(ctx, plan))} at {rate(ctx.rate(plan))}"
    )
    behind = finish_n > left - reserve / 2
    if plan > n and (behind or why):
        return _to(ctx, plan, f"{why}grow {n} -> {plan}: {head}")
    if plan < n and (plan <= n * (1 - p.hysteresis) or why):
        saved = ctx.remaining * (ctx.dollars_per_sample(n) - ctx.dollars_per_sample(plan))
        pause_cost = ctx.pause * plan * m.price_per_worker_hour / 3600
        if saved > pause_cost or why:
            return _to(
                ctx,
                plan,
                f"{why}shrink {n} -> {plan}: {head}; saves ${saved:,.2f} "
                f"against ${pause_cost:,.2f} of rescale pause",
            )
    return hold(m, f"{why}hold {n} workers: {head}", **ctx.predict(n))


def _over_budget(ctx: Context, budget: float) -> Decision:
    return _to(
        ctx,
        ctx.lo,
        f"even {ctx.lo} workers exceed the ${budget:,.2f} budget "
        f"(projected ${ctx.projected_cost(ctx.lo):,.2f})",
    )


def _to(ctx: Context, k: int, reason: str) -> Decision:
    if k == ctx.n:
        return hold(ctx.m, reason, **ctx.predict(k))
    return Decision(target=k, reason=reason, predicted=ctx.predict(k))


def cost(m: Measurements) -> Decision:
    """The fewest workers that finish ``max_steps`` by the deadline, or the throughput rule
    under the budget, or the cheapest $/sample. See the module docstring for the rule."""
    ctx = gate(m)
    if isinstance(ctx, Decision):
        return ctx
    p = m.params
    if p.deadline_s is not None:
        if not ctx.known_end:
            return hold(m, "a deadline needs the job's max_steps: holding")
        return _deadline(ctx, p.deadline_s, p.budget)
    if p.budget is not None:
        if not ctx.known_end:
            return hold(m, "a budget needs the job's max_steps: holding")
        allowed = _budget_cap(ctx, p.budget)
        if allowed is None:
            return _over_budget(ctx, p.budget)
        if allowed < ctx.n:
            return _to(
                ctx,
                allowed,
                f"shrink {ctx.n} -> {allowed}: projected job cost at "
                f"{ctx.n} workers ${ctx.projected_cost(ctx.n):,.2f} exceeds the budget "
                f"${p.budget:,.2f}",
            )
        return throughput_decide(ctx, allowed, f"budget ${p.budget:,.2f} allows <= {allowed}: ")
    if ctx.n > ctx.lo:
        return _to(
            ctx,
            ctx.lo,
            f"no deadline or budget: the cheapest $/sample is at "
            f"{ctx.lo} workers (${ctx.dollars_per_sample(ctx.lo):.3g} against "
            f"${ctx.dollars_per_sample(ctx.n):.3g} at {ctx.n})",
        )
    return hold(
        m, f"no deadline or budget: {ctx.n} workers is the cheapest $/sample", **ctx.predict(ctx.n)
    )
