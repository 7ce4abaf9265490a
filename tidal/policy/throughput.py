"""The ``throughput`` policy: add workers while each one added still pays.

Rule, with ``e(a, b)`` the marginal scaling efficiency from ``a`` to ``b`` workers (the
samples/s each added worker brings, over what each of the ``a`` workers delivers), ``thr``
= ``min_efficiency`` and ``band`` = ``hysteresis``; after the gates of ``common.gate``:

- **shrink** to ``p`` (the largest measured size below ``n``, else ``n`` minus about a
  fifth) when ``e(p, n) < thr - band``;
- **grow** to the largest candidate ``k`` (a measured size above ``n``, or the exploration
  step ``n + max(1, round(n * grow_fraction))``) with ``e(n, k) >= thr + band`` whose time
  saved over the remaining work is at least the rescale pause (twice the pause for an
  untried size: the way there and, if the prediction was wrong, the way back);
- else **hold**.

``e`` uses measured rates where a size has been measured and the fitted model
(``model.fit``) elsewhere. Because growing needs ``thr + band`` and shrinking ``thr - band``
on the same measured pair, a size pair whose efficiency sits near the threshold cannot
make the target flap; the cooldown bounds the rate of changes on top of that.
"""

from __future__ import annotations

from tidal.policy.common import Context, dur, gate, hold, rate
from tidal.policy.inputs import Decision, Measurements


def grow_step(n: int, fraction: float) -> int:
    return max(1, round(n * fraction))


def shrink_to(ctx: Context, n: int) -> int:
    """The size a shrink from ``n`` goes to: the largest measured size below, else about a
    fifth fewer workers (the inverse of a 25% growth step)."""
    below = [k for k in ctx.measured if ctx.lo <= k < n]
    if below:
        return max(below)
    return max(
        ctx.lo, n - max(1, round(n * ctx.m.params.grow_fraction / (1 + ctx.m.params.grow_fraction)))
    )


def decide(ctx: Context, ceiling: int, label: str = "") -> Decision:
    """The throughput rule with sizes bounded by ``ceiling`` (<= ``ctx.cap``)."""
    m, n, p = ctx.m, ctx.n, ctx.m.params
    hi, low = p.min_efficiency + p.hysteresis, p.min_efficiency - p.hysteresis
    if ctx.time_left(n) < 2 * ctx.pause:
        return hold(
            m,
            f"{label}{dur(ctx.time_left(n))} of training left, under twice the rescale "
            f"pause ({dur(ctx.pause)}): not worth a change",
            **ctx.predict(n),
        )
    notes: list[str] = []
    if n > ctx.lo:
        k = shrink_to(ctx, n)
        e = ctx.efficiency(k, n)
        if e < low:
            return Decision(
                target=k,
                reason=(
                    f"{label}shrink {n} -> {k}: marginal efficiency {k}->{n} is {e:.3f} "
                    f"({ctx.shown(k)}, {ctx.shown(n)}) < {low:.2f} "
                    f"(min {p.min_efficiency:.2f} - band {p.hysteresis:.2f})"
                ),
                predicted={**ctx.predict(k), "marginal_efficiency": e},
            )
        notes.append(f"e({k}->{n}) = {e:.3f} >= {low:.2f}")
    if n >= ceiling:
        notes.append(f"at the ceiling of {ceiling} workers")
    else:
        explore = min(ceiling, n + grow_step(n, p.grow_fraction))
        best: tuple[int, float, float] | None = None
        for k in sorted({k for k in ctx.measured if n < k <= ceiling} | {explore}):
            e = ctx.efficiency(n, k)
            saved = ctx.time_left(n) - ctx.time_left(k)
            need = ctx.pause * (1 if k in ctx.measured else 2)
            if e >= hi and saved >= need:
                best = (k, e, saved)
            elif k == explore and e < hi:
                notes.append(f"e({n}->{k}) = {e:.3f} < {hi:.2f}")
            elif k == explore:
                notes.append(
                    f"{n}->{k} saves {dur(saved)} < {dur(need)} (rescale pause {dur(ctx.pause)})"
                )
        if best is not None:
            k, e, saved = best
            verb = "grow" if k in ctx.measured else "explore"
            model = "" if k in ctx.measured else f" [{ctx.model.how}]"
            return Decision(
                target=k,
                reason=(
                    f"{label}{verb} {n} -> {k}: marginal efficiency {n}->{k} is {e:.3f} "
                    f"({ctx.shown(n)}, {ctx.shown(k)}) >= {hi:.2f} "
                    f"(min {p.min_efficiency:.2f} + band {p.hysteresis:.2f}); saves "
                    f"{dur(saved)} of the {dur(ctx.time_left(n))} left, rescale pause "
                    f"{dur(ctx.pause)}{model}"
                ),
                predicted={**ctx.predict(k), "marginal_efficiency": e},
            )
    return hold(
        m,
        f"{label}hold {n} workers at {rate(ctx.rate(n))}: " + "; ".join(notes),
        **ctx.predict(n),
    )


def throughput(m: Measurements) -> Decision:
    """Grow while the measured marginal scaling efficiency stays above ``min_efficiency``,
    shrink when it falls below; explore untried sizes only when the fitted model predicts
    a gain worth the rescale pause. See the module docstring for the exact rule."""
    ctx = gate(m)
    if isinstance(ctx, Decision):
        return ctx
    return decide(ctx, ctx.cap)
