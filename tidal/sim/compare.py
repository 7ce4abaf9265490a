"""``compare``: every policy over one trace, measured against the hindsight optimum.

``compare`` runs static-min, static-max, throughput and cost, then the ``oracle`` (the
cheapest schedule that finishes by the same deadline as the cost policy, ``oracle.py``),
and gives every row ``vs_oracle``: its $/sample over the oracle's. Unless the config has a
deadline, the cost policy and the oracle get ``DEADLINE_FACTOR`` x static-max's time.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

from tidal.sim.job import JobModel
from tidal.sim.simulate import SimConfig, SimResult, run, simulate
from tidal.sim.trace import Trace

COMPARE_POLICIES = ("static-min", "static-max", "throughput", "cost", "oracle")
DEADLINE_FACTOR = 1.1


def compare(job: JobModel, trace: Trace, config: SimConfig) -> list[SimResult]:
    """Every policy of ``COMPARE_POLICIES``, with ``vs_oracle`` on each row (None when the
    oracle has no row: no deadline could be set, or none is feasible)."""
    results = [simulate(job, trace, name, config) for name in COMPARE_POLICIES[:2]]
    fastest = results[1].completion_s
    deadline = config.params.deadline_s
    if deadline is None and fastest is not None:
        deadline = DEADLINE_FACTOR * fastest
    limited = replace(config, params=replace(config.params, deadline_s=deadline))
    results.append(simulate(job, trace, "throughput", config))
    results.append(simulate(job, trace, "cost", limited))
    best = oracle(job, trace, limited) if deadline is not None else None
    if best is not None:
        results.append(best)
    return with_vs_oracle(results)


def with_vs_oracle(results: list[SimResult]) -> list[SimResult]:
    """``vs_oracle`` = each finished row's $/sample over the oracle row's."""
    ref = next((r for r in results if r.policy == "oracle"), None)
    if ref is None or ref.cost_per_sample is None:
        return results
    out = []
    for r in results:
        ratio = None
        if r.completed and r.cost_per_sample is not None and ref.cost_per_sample > 0:
            ratio = r.cost_per_sample / ref.cost_per_sample
        out.append(replace(r, vs_oracle=ratio))
    return out


def oracle(
    job: JobModel, trace: Trace, config: SimConfig, *, grid_s: float | None = None
) -> SimResult | None:
    """The oracle's row: its schedule replayed by the simulator (None if no schedule
    finishes by ``config.params.deadline_s``). Needs a deadline."""
    # numpy (~0.1 s) only here: the package's import is on every CLI command's path
    # (``tidal`` builds the simulate parser from its names).
    from tidal.sim.exact import exact
    from tidal.sim.oracle import auto_grid, lagrangian, make_slots

    deadline = config.params.deadline_s
    if deadline is None:
        raise ValueError("the oracle needs a deadline: give --deadline (e.g. 3h)")
    start = config.start_s
    sl = make_slots(trace, start, deadline, grid_s or auto_grid(deadline))
    lo, hi = config.workers_min, config.workers_max
    replay_trace = sl.as_trace(trace, start)
    starts = sl.start.tolist()
    runs: dict[tuple[int, ...], SimResult] = {}

    def replay(plan: tuple[int, ...]) -> SimResult:
        if plan not in runs:

            def scripted(elapsed: float) -> int:
                return plan[min(len(plan) - 1, max(0, bisect.bisect_right(starts, elapsed) - 1))]

            runs[plan] = run(
                job, replay_trace, None, plan[0], config, label="oracle", plan=scripted
            )
        return runs[plan]

    def feasible(plan: tuple[int, ...]) -> tuple[bool, float]:
        r = replay(plan)
        ok = r.completed and r.completion_s is not None and r.completion_s <= deadline * 1.000001
        return ok, r.cost

    found = exact(job, sl, lo, hi)
    if found is not None:
        plans, method, bound = [found], "exact", None
    else:
        plans, bound = lagrangian(job, sl, lo, hi, feasible)
        method = "lagrangian"
    plans.append((hi,))  # static-max's schedule: feasible whenever static-max is
    ok = [p for p in plans if feasible(p)[0]]
    if not ok:
        return None
    plan = min(ok, key=lambda p: replay(p).cost)
    best = replay(plan)
    if method == "exact":
        bound = best.cost
    if method == "lagrangian" and plan == (hi,):
        method = "lagrangian (static-max)"
    return replace(
        best,
        deadline_s=deadline,
        oracle={
            "method": method,
            "lower_bound": bound,
            "slots": len(sl),
            "changes": best.decisions,
        },
    )
