"""The oracle: the cheapest schedule that meets the deadline, checked against brute force.

Every schedule of a small trace (one target per row) is replayed by the simulator itself;
the cheapest that finishes by the deadline is the optimum the oracle must find.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tidal.policy import PolicyParams
from tidal.sim import SimConfig, compare, get_job, load_trace, oracle, parse_trace, run, simulate
from tidal.sim.exact import exact
from tidal.sim.oracle import (
    _Tables,
    auto_grid,
    candidate_sizes,
    evaluate,
    lagrangian,
    make_slots,
)

HEADER = "time_s,capacity,price_per_worker_hour\n"
TRACES = Path(__file__).resolve().parent.parent / "examples" / "traces"
ROWS = 1e9  # a grid coarser than any row: one slot per row, as the brute force enumerates


def small_job(steps: int, pause: float = 10.0):
    return get_job("resnet50-v100").with_overrides(total_steps=steps, rescale_pause_s=pause)


def brute_force(job, trace, lo: int, hi: int, deadline: float):
    """(cost, plan) of the cheapest schedule finishing by ``deadline``, by the simulator."""
    sl = make_slots(trace, 0.0, deadline, ROWS)
    replay = sl.as_trace(trace, 0.0)
    starts = sl.start.tolist()
    cfg = SimConfig(workers_min=lo, workers_max=hi, params=PolicyParams(deadline_s=deadline))
    best = None
    for plan in itertools.product(range(lo, hi + 1), repeat=len(sl)):

        def scripted(elapsed: float, plan=plan) -> int:
            return plan[min(len(plan) - 1, max(0, bisect.bisect_right(starts, elapsed) - 1))]

        r = run(job, replay, None, plan[0], cfg, label="brute", plan=scripted)
        if r.completed and r.completion_s <= deadline * (1 + 1e-9):
            if best is None or r.cost < best[0] - 1e-12:
                best = (r.cost, plan)
    return best


# Small traces whose optimum can be checked by hand (and is, by brute force): rows of 10
# minutes, 1-3 workers, 10 s pauses.
CASES = [
    # cheap then dear: work early at the most workers, then as few as the rest needs
    ("0,3,1.0\n600,3,3.0\n1200,3,3.0\n1800,3,1.0\n", 3000, 2400.0),
    # dear then cheap: wait (1 worker), then all in the cheap rows
    ("0,3,3.0\n600,3,3.0\n1200,3,0.5\n1800,3,0.5\n", 2500, 2400.0),
    # a capacity drop in the middle and an outage: the pauses count
    ("0,3,1.0\n600,1,1.0\n1200,0,1.0\n1800,3,1.2\n", 2000, 2400.0),
    # flat and tight: the fewest workers that finish, or a mix of two sizes
    ("0,3,1.0\n600,3,1.0\n1200,3,1.0\n", 2600, 1800.0),
]


@pytest.mark.parametrize("rows, steps, deadline", CASES)
def test_oracle_is_the_brute_force_optimum_on_small_traces(rows, steps, deadline):
    trace = parse_trace(HEADER + rows)
    job = small_job(steps)
    cfg = SimConfig(workers_max=3, params=PolicyParams(deadline_s=deadline))
    want = brute_force(job, trace, 1, 3, deadline)
    got = oracle(job, trace, cfg, grid_s=ROWS)
    assert want is not None and got is not None
    assert got.cost == pytest.approx(want[0], rel=1e-9)
    assert got.completion_s <= deadline * (1 + 1e-9)
    assert got.oracle["method"] == "exact" and got.oracle["lower_bound"] == got.cost


@pytest.mark.parametrize("seed", range(6))
def test_oracle_is_the_brute_force_optimum_on_random_small_traces(seed):
    rng = random.Random(seed)
    rows = "".join(
        f"{i * 600},{rng.randint(0, 3)},{rng.choice([0.5, 1.0, 2.0, 3.0])}\n"
        for i in range(rng.randint(3, 5))
    )
    trace = parse_trace(HEADER + rows)
    job = small_job(rng.randint(500, 2500), pause=rng.choice([0.0, 10.0, 60.0]))
    deadline = rng.choice([0.8, 1.0]) * trace.duration_s + 600
    cfg = SimConfig(workers_max=3, params=PolicyParams(deadline_s=deadline))
    want = brute_force(job, trace, 1, 3, deadline)
    got = oracle(job, trace, cfg, grid_s=ROWS)
    assert (want is None) == (got is None)
    if want is not None:
        assert got.cost == pytest.approx(want[0], rel=1e-9)
        # The Lagrangian program's bound holds below the optimum; its schedule above.
        sl = make_slots(trace, 0.0, deadline, ROWS)
        plans, bound = lagrangian(job, sl, 1, 3, lambda plan: (True, 0.0))
        assert bound <= want[0] * (1 + 1e-9)


def test_an_infeasible_deadline_has_no_oracle_and_a_missing_one_is_an_error():
    trace = parse_trace(HEADER + "0,2,1.0\n")
    job = small_job(5000)
    assert oracle(job, trace, SimConfig(workers_max=2, params=PolicyParams(deadline_s=60))) is None
    with pytest.raises(ValueError, match="the oracle needs a deadline"):
        oracle(job, trace, SimConfig(workers_max=2))


def test_slots_merge_equal_rows_and_cut_at_the_grid_and_the_deadline():
    trace = parse_trace(HEADER + "0,4,1.0\n300,4,1.0\n600,2,2.0\n")
    sl = make_slots(trace, 0.0, 1000.0, 250.0)
    assert sl.start.tolist() == [0.0, 200.0, 400.0, 600.0, 800.0]  # 600 s cut in 3, 400 in 2
    assert sl.cap.tolist() == [4, 4, 4, 2, 2] and float(sl.dur.sum()) == 1000.0
    later = make_slots(trace, 450.0, 300.0, 1e9)  # from a start into the trace
    assert later.start.tolist() == [0.0, 150.0] and later.cap.tolist() == [4, 2]
    assert auto_grid(3600) == 60 and auto_grid(7 * 86400) == pytest.approx(302.4)


def test_sizes_are_all_of_a_small_range_and_a_geometric_grid_of_a_large_one():
    assert candidate_sizes(1, 8, np.array([4])).tolist() == list(range(1, 9))
    grid = candidate_sizes(1, 10_000, np.array([5_000]))
    assert grid[0] == 1 and grid[-1] == 10_000 and 5_000 in grid and len(grid) < 200
    big = grid[grid >= 20]
    assert np.all(big[1:] / big[:-1] < 1.15)  # steps of at most 15% above 20 workers


def test_the_fast_evaluator_agrees_with_the_simulator():
    trace = load_trace(TRACES / "spikes.csv")
    job = small_job(20_000)
    sl = make_slots(trace, 0.0, 4 * 3600, 600.0)
    tab = _Tables(job, sl, candidate_sizes(1, 96, sl.cap))
    rng = np.random.default_rng(3)
    plan = rng.choice([24, 48, 96], size=len(sl))
    finish, dollars = evaluate(tab, sl, float(job.total_samples), plan)
    starts = sl.start.tolist()
    cfg = SimConfig(workers_max=96)
    r = run(
        job,
        sl.as_trace(trace, 0.0),
        None,
        int(plan[0]),
        cfg,
        label="x",
        plan=lambda e: int(plan[min(len(plan) - 1, bisect.bisect_right(starts, e) - 1)]),
    )
    assert r.completion_s == pytest.approx(finish, rel=1e-9)
    assert r.cost == pytest.approx(dollars, rel=1e-9)


@pytest.mark.parametrize("name", ["spot", "diurnal", "flat", "spikes"])
def test_oracle_row_is_a_replay_between_its_bound_and_static_max(name):
    trace = load_trace(TRACES / f"{name}.csv")
    job = get_job("resnet50-v100")
    rows = {r.policy: r for r in compare(job, trace, SimConfig(workers_max=trace.max_capacity))}
    best, top = rows["oracle"], rows["static-max"]
    assert best.completion_s <= best.deadline_s * (1 + 1e-6)
    assert best.oracle["lower_bound"] <= best.cost <= top.cost
    assert best.cost <= 1.02 * best.oracle["lower_bound"]  # the optimum is in between
    in_time = [r for r in rows.values() if r.completed and r.completion_s <= best.deadline_s]
    assert all(r.vs_oracle >= 0.999 for r in in_time)  # nothing that meets it is cheaper


@pytest.mark.timeout(120)
def test_oracle_on_a_week_of_minute_rows_at_ten_thousand_workers():
    """Complexity: O(slots x sizes) per lambda, a few rounds of 12 lambdas; the wall-clock
    claim (every policy in under 10 s) is measured in docs/policies.md, not here."""
    gen = __import__("runpy").run_path(str(TRACES / "make_traces.py"))
    rows = gen["scale_rows"]()
    trace = parse_trace(HEADER + "".join(f"{t},{c},{p:.3f}\n" for t, c, p in rows))
    job = get_job("llama2-7b-a100").with_overrides(total_steps=900_000, global_batch=16384)
    cfg = SimConfig(workers_max=10_000)
    top = simulate(job, trace, "static-max", cfg)
    limited = replace(cfg, params=PolicyParams(deadline_s=1.1 * top.completion_s))
    best = oracle(job, trace, limited)
    assert best is not None and best.oracle["slots"] >= 9_000
    assert best.oracle["lower_bound"] <= best.cost <= top.cost
    assert best.completion_s <= limited.params.deadline_s * (1 + 1e-6)
    assert exact(job, make_slots(trace, 0.0, 3600.0, 60.0), 1, 10_000) is None  # too big
