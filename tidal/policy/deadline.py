"""The cost policy under a deadline: meet it at the least cost, without seeing the future.

After the gates of ``common.gate``, with ``R`` the samples left, ``X(k)`` the samples/s at
``k`` workers (measured, else the fitted model), ``X'(k) = X(k) - X(k-1)``, ``left`` the
seconds to the deadline, ``pause`` the measured rescale pause and ``cap`` the most workers
allowed now:

1. **Reserve.** Plan to finish ``reserve`` early: the largest of ``deadline_margin`` x
   ``left``, 2 pauses, and ``left`` x the share of the market's past without capacity
   (an outage seen may come again).
2. **Need and safe.** ``need``: the fewest workers that, held from now, train ``R`` by
   ``left - reserve`` (a change costs a pause). ``safe``: the fewest that may run for
   twice the expected rest of a high price (the market's mean excursion, or as long again
   as the current one has lasted; before a high price was seen to pass, stretched by
   1 / (1 - linear), below) and still leave the usual capacity (now, or what it was 75% of
   the time) the time to finish.
3. **Outlook.** ``future`` = the average over the time left of a price that returns from
   now to the median seen (the market's past included) at the pace its past excursions
   did (a high price at the pace of ``safe``'s spell, below), times
   ``1 + price_premium x linear``,
   where ``linear`` = X'(need) / (X(need) / need) is how linear scaling is at that pace
   (hurrying as a hedge is cheap when it is linear, dear on the flat top). Medians ignore
   spikes and follow lasting steps. ``lam`` = future / X'(need): what a sample put off
   costs at the margin, at the deadline pace.
4. **Size.** ``want``: the largest k whose marginal worker pays for itself at that value,
   ``lam x X'(k) >= price now``, at least ``need`` (``safe`` while dear: the price is
   ``DEAR_BAND`` above the outlook, or, for a job already below ``need``, not that much
   below it). Cheap now, or scaling nearly linear: more workers and the job gets ahead
   (static-max's safety against later rises); dear now: fewer, and the work waits.
5. **Move or hold.** Behind (the current size eats more than half the reserve; while
   dear, it could not wait out one mean excursion): grow to ``want`` at once. Otherwise
   move only to a size at least ``hysteresis`` away whose gain in value over the
   time it lasts (a high or low price's expected spell, at least an hour; the rest of the
   job for a move to the plan), ``lam x X(k) - price x k`` a second, beats both the
   samples the pause loses (and the pause back to ``need``, for a wait) and ``MATERIAL``
   of the spend over that time.
"""

from __future__ import annotations

import math

from tidal.policy.common import Context, dur, hold, rate
from tidal.policy.inputs import Decision
from tidal.policy.plan import budget_cap, fewest_feasible, finish_time, first_true, marginal, to

HOLD_S = 3600.0  # how long a new size is assumed to be kept, to weigh its pause
MATERIAL = 0.01  # a change must gain this share of the spend over the gain's horizon
DEAR_BAND = 0.05  # the price must be this much above the outlook to wait


def _reserve(ctx: Context, left: float) -> float:
    return max(ctx.m.params.deadline_margin * left, 2 * ctx.pause, 0.0)


def outlook(ctx: Context, left: float, linear: float = 1.0) -> float:
    """The price per worker-hour that work put off is assumed to cost: the average over
    the ``left`` seconds of a price that returns from now to the median seen at the pace
    the market's past showed (``Market.price_persistence_s``), plus the premium scaled by
    ``linear`` (hurrying as a hedge is cheap when scaling is linear, dear on the flat top)."""
    m = ctx.m
    now = m.price_per_worker_hour
    expected = now
    mk = m.market
    if mk is not None and mk.seconds > 0:
        # A price below the median returns up at the market's pace (the cautious reading);
        # one above it comes down at the pace ``_spell`` expects.
        tau = mk.price_persistence_s if now <= mk.price_median else _spell(ctx, linear)
        x = max(left, 0.0) / tau
        stays = (1.0 - math.exp(-x)) / x if x > 1e-9 else 1.0
        expected = mk.price_median + (now - mk.price_median) * stays
    return (1.0 + m.params.price_premium * linear) * expected


def _usual(ctx: Context) -> int:
    """What catching up may count on: the capacity now, or the capacity seen 75% of the
    time (``Market.capacity_low``) if higher."""
    m = ctx.m
    if m.market is None or m.market.seconds <= 0:
        return ctx.cap
    return max(ctx.cap, min(m.max_workers, m.market.capacity_low))


def _spell(ctx: Context, linear: float) -> float:
    """How long a high price is expected to last from now: the market's mean excursion,
    or as long again as the current one has lasted if longer. In a market that has not
    yet shown a high price passing, a rise may be a lasting step: the prior spell is
    stretched by 1 / (1 - linear), for ever when scaling is linear (waiting then saves
    nothing but the price, and loses to static-max if the rise stays)."""
    mk = ctx.m.market
    if mk is None:
        return math.inf
    spell = max(mk.price_persistence_s, mk.price_excursion_s)
    if mk.price_excursions == 0:
        spell = spell / (1.0 - linear) if linear < 1.0 else math.inf
    return spell


def _safe(ctx: Context, limit: float, spell: float) -> int:
    """The fewest workers that may run for ``spell`` seconds and still leave the usual
    capacity the time to train the rest by ``limit`` (after a pause)."""
    hour = min(spell, max(limit, 0.0))
    if hour <= 0:
        return ctx.cap
    after = ctx.rate(_usual(ctx)) * max(0.0, limit - hour - ctx.pause)
    rate_needed = (ctx.remaining - after) / hour
    if rate_needed <= 0:
        return ctx.lo
    k = first_true(ctx.lo, ctx.cap, lambda j: ctx.rate(j) >= rate_needed)
    return ctx.cap if k is None else k


def _largest_paying(ctx: Context, lam: float, price_s: float, lo: int, hi: int) -> int:
    """The largest k in [lo, hi] with ``lam * X'(k) >= price_s``, else ``lo``. Above 1
    worker X' falls as k grows under the model: a binary search."""

    def pays(k: int) -> bool:
        return lam * marginal(ctx, k) >= price_s

    a, b = max(lo, 2), hi
    if a > b or not pays(a):
        return lo
    while a < b:
        mid = (a + b + 1) // 2
        if pays(mid):
            a = mid
        else:
            b = mid - 1
    return a


def deadline(ctx: Context, deadline_s: float, budget: float | None) -> Decision:
    m, n, p = ctx.m, ctx.n, ctx.m.params
    left = deadline_s - m.elapsed_s
    reserve = _reserve(ctx, left)
    limit = left - reserve
    need = fewest_feasible(ctx, limit) if limit > 0 else None
    if need is None and left > 0:
        need = fewest_feasible(ctx, left)  # eat into the reserve
    why = ""
    # Sizes above the capacity now are allowed as a target: the world size follows the
    # capacity and grows back to the target when it returns, without a decision.
    free = ctx.cap
    if m.capacity is not None and m.capacity < m.max_workers:
        per_step = ctx.samples_per_step
        most = m.max_workers if not math.isfinite(per_step) else min(m.max_workers, int(per_step))
        free = max(ctx.cap, most)
    short = need is None  # not with the capacity now
    if short:
        need = max((ctx.lo, ctx.cap), key=ctx.rate)  # the fastest allowed now
        best = max(need, _usual(ctx))
        if ctx.pause + ctx.time_left(best) > left:
            why = (
                f"the deadline cannot be met: even {best} workers "
                f"({rate(ctx.rate(best))}) need {dur(finish_time(ctx, best))}, "
                f"{dur(max(0.0, left))} left; "
            )
    # What it would take with more capacity: the target while the capacity binds.
    beyond = None
    if short and free > ctx.cap:
        beyond = fewest_feasible(ctx, max(limit, 0.0), ctx.cap + 1, free) or free
    price_s = m.price_per_worker_hour / 3600.0
    # How linear scaling is at the deadline pace: the marginal worker's throughput over
    # the average worker's (1: linear; near 0: the flat top, where hurrying buys little).
    linear = min(1.0, marginal(ctx, need) / (ctx.rate(need) / need)) if need > 1 else 1.0
    future = outlook(ctx, left, linear)
    lam = future / 3600.0 / max(marginal(ctx, need), 1e-12)
    # Dear: the price is 5% above the outlook; a job already below ``need`` stays dear
    # until the price is 5% under it (a band, so that it does not flap).
    price = m.price_per_worker_hour
    dear = not why and (
        price > future * (1 + DEAR_BAND) or (n < need and price > future * (1 - DEAR_BAND))
    )
    # While dear, the work may wait out a spell twice the market's mean excursion; it is
    # behind once it could not wait out one (a band, so that it does not flap).
    safe = _safe(ctx, limit, _spell(ctx, linear)) if dear else need
    low = min(need, safe)
    want = max(low, _largest_paying(ctx, lam, price_s, low, free))
    if beyond is not None and not dear:
        want = max(want, beyond)
    if dear:
        urgent = n < min(need, _safe(ctx, left - reserve / 2, _spell(ctx, linear) / 2))
    else:
        urgent = ctx.time_left(n) > left - reserve / 2
    if budget is not None:
        allowed = budget_cap(ctx, budget)
        if allowed is None:
            return to(
                ctx,
                ctx.lo,
                f"even {ctx.lo} workers exceed the ${budget:,.2f} budget "
                f"(projected ${ctx.projected_cost(ctx.lo):,.2f})",
            )
        if want > allowed:
            why += (
                f"the budget ${budget:,.2f} allows at most {allowed} workers "
                f"(projected ${ctx.projected_cost(allowed):,.2f}); "
            )
            want = allowed
    reach = min(want, ctx.cap)
    head = (
        f"deadline in {dur(left)} (reserve {dur(reserve)}): {need} workers needed "
        f"({dur(finish_time(ctx, need))} at {rate(ctx.rate(need))}); price "
        f"${m.price_per_worker_hour:.2f}/h, outlook ${future:.2f}/h"
    )
    if dear:
        head += f" (dear now: down to {low} workers may wait it out)"
    if want > reach:
        head += f"; {want} wanted, {reach} available now"

    def move(k: int, reason: str) -> Decision:
        if k == m.target:
            return hold(m, reason, **ctx.predict(min(k, ctx.cap)))
        return Decision(target=k, reason=reason, predicted=ctx.predict(min(k, ctx.cap)))

    if n > ctx.cap:  # more workers than the steps have samples for: no use at all
        return move(reach, f"{why}shrink {n} -> {reach}: a step has samples for {ctx.cap}; {head}")
    if (urgent and reach > n) or (why and reach != n):
        return move(want, f"{why}grow {n} -> {want}: {head}")
    if reach == n:  # the world stays; the target may move above the capacity
        close = abs(want - m.target) < max(1.0, p.hysteresis * m.target)
        if close and min(m.target, ctx.cap) == n:
            return hold(m, f"{why}hold {n} workers: {head}")
        return move(want, f"{why}hold {n} workers: {head}")
    if abs(reach - n) < max(1.0, p.hysteresis * n):
        return hold(m, f"hold {n} workers ({reach} is within the band): {head}")

    def value(k: int) -> float:
        return lam * ctx.rate(k) - price_s * k

    # The gain lasts as long as the reason for the move: a high or low price its
    # expected spell, a move to the plan the rest of the job.
    lasts = _spell(ctx, linear) if (dear or reach > need) else math.inf
    horizon = min(max(0.0, limit), max(lasts, HOLD_S))
    gain = (value(reach) - value(n)) * horizon
    paused = ctx.rate(reach) + (ctx.rate(need) if reach < need else 0.0)  # and the way back
    spend = price_s * n * horizon
    loss = max(lam * paused * ctx.pause, MATERIAL * spend)
    verb = "grow" if reach > n else "shrink"
    if gain > loss and math.isfinite(gain):
        return move(
            want,
            f"{verb} {n} -> {want}: {head}; gains ${gain:,.2f} over "
            f"{dur(horizon)} against ${loss:,.2f} (the pause, or {MATERIAL:.0%} of the spend)",
        )
    return hold(
        m,
        f"hold {n} workers: {head}; {reach} would gain ${gain:,.2f}, not more than "
        f"${loss:,.2f} (the pause, or {MATERIAL:.0%} of the spend)",
    )
