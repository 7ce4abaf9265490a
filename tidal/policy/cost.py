"""The ``cost`` policy: the least cost that meets the deadline, within the budget.

- **deadline** (``params.deadline_s``, needs ``max_steps``): ``deadline.deadline``, the
  robust rule (a reserve, the fewest workers that still finish, and more while the price
  is low against what was seen, with a premium for the unseen future). Nothing measured yet:
  start at the most workers allowed, which measures the communication cost at once and
  puts the job ahead, then give back what the deadline does not need. The target is not
  lowered when the capacity dips below it: the world size follows the capacity down and
  back, as static-max's does, without a decision and its pauses each way. With a ``budget``
  too, the size is capped at the largest whose projected job cost fits (the budget wins).
- **budget only**: the throughput rule (``throughput.decide``) limited to the sizes whose
  projected job cost ``spent + k * price * (pause + R / X(k))`` fits the budget: it stops
  growing when the budget would be exceeded and shrinks when the projection exceeds it.
- **neither**: the cheapest $/sample, which under the model is ``min_workers``.
"""

from __future__ import annotations

from tidal.policy.common import gate, hold
from tidal.policy.deadline import deadline
from tidal.policy.inputs import Decision, Measurements
from tidal.policy.plan import budget_cap, to
from tidal.policy.throughput import decide as throughput_decide


def _start(m: Measurements) -> Decision | None:
    """With a deadline and nothing measured yet: the most workers allowed now."""
    if m.params.deadline_s is None or m.max_steps is None or m.stats:
        return None
    top = m.max_workers
    if m.target >= top:
        return None
    return Decision(
        target=top,
        reason=(
            f"deadline set, nothing measured yet: start at the most workers allowed, {top}, "
            "to measure the communication cost at once and get ahead; what the deadline "
            "does not need is given back"
        ),
    )


def cost(m: Measurements) -> Decision:
    """The least cost that finishes ``max_steps`` by the deadline, or the throughput rule
    under the budget, or the cheapest $/sample. See the module docstring for the rule."""
    first = _start(m)
    if first is not None:
        return first
    p = m.params
    ctx = gate(m, follow_capacity=p.deadline_s is None)
    if isinstance(ctx, Decision):
        return ctx
    if p.deadline_s is not None:
        if not ctx.known_end:
            return hold(m, "a deadline needs the job's max_steps: holding")
        return deadline(ctx, p.deadline_s, p.budget)
    if p.budget is not None:
        if not ctx.known_end:
            return hold(m, "a budget needs the job's max_steps: holding")
        allowed = budget_cap(ctx, p.budget)
        if allowed is None:
            return to(
                ctx,
                ctx.lo,
                f"even {ctx.lo} workers exceed the ${p.budget:,.2f} budget "
                f"(projected ${ctx.projected_cost(ctx.lo):,.2f})",
            )
        if allowed < ctx.n:
            return to(
                ctx,
                allowed,
                f"shrink {ctx.n} -> {allowed}: projected job cost at "
                f"{ctx.n} workers ${ctx.projected_cost(ctx.n):,.2f} exceeds the budget "
                f"${p.budget:,.2f}",
            )
        return throughput_decide(ctx, allowed, f"budget ${p.budget:,.2f} allows <= {allowed}: ")
    if ctx.n > ctx.lo:
        return to(
            ctx,
            ctx.lo,
            f"no deadline or budget: the cheapest $/sample is at "
            f"{ctx.lo} workers (${ctx.dollars_per_sample(ctx.lo):.3g} against "
            f"${ctx.dollars_per_sample(ctx.n):.3g} at {ctx.n})",
        )
    return hold(
        m, f"no deadline or budget: {ctx.n} workers is the cheapest $/sample", **ctx.predict(ctx.n)
    )
