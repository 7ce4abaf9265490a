"""Capacity traces, the job model and the simulator (all pure: no processes, no I/O but
reading the example traces)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from tidal.policy import PolicyParams
from tidal.policy.market import MarketTracker
from tidal.sim import (
    COMPARE_POLICIES,
    DEFAULT_JOB,
    PRESETS,
    SimConfig,
    compare,
    get_job,
    load_trace,
    parse_trace,
    simulate,
)
from tidal.sim.trace import Trace

TRACES = Path(__file__).resolve().parent.parent / "examples" / "traces"
HEADER = "time_s,capacity,price_per_worker_hour\n"
WEEK = 7 * 86400


def trace(rows: str, source: str = "t.csv"):
    return parse_trace(HEADER + rows, source)


# -- traces ------------------------------------------------------------------------------
def test_trace_rows_hold_until_the_next_row():
    tr = trace("0,3,0.9\n15,1,1.5\n45,3,0.9\n")
    assert tr.at(0).capacity == 3 and tr.at(14.9).capacity == 3
    assert tr.at(15).capacity == 1 and tr.at(15).price_per_worker_hour == 1.5
    assert tr.at(1e9).capacity == 3
    assert tr.next_change(0) == 15 and tr.next_change(15) == 45 and tr.next_change(50) > 1e300
    assert tr.max_capacity == 3 and tr.duration_s == 45


def test_trace_ignores_blank_lines_comments_and_spaces():
    tr = parse_trace("# a comment\n time_s, capacity, price_per_worker_hour\n\n0, 2, 1\n", "x")
    assert tr.points[0].capacity == 2


@pytest.mark.parametrize(
    "text, where, what",
    [
        ("time,capacity,price\n0,1,1\n", "t.csv:1:", "expected the header"),
        (HEADER + "0,1\n", "t.csv:2:", "expected 3 values"),
        (HEADER + "0,1,1\nabc,1,1\n", "t.csv:3:", "time_s 'abc' is not a number"),
        (HEADER + "0,1,1\n10,2.5,1\n", "t.csv:3:", "capacity must be a whole number"),
        (HEADER + "0,-1,1\n", "t.csv:2:", "capacity must be a whole number"),
        (HEADER + "0,1,cheap\n", "t.csv:2:", "price_per_worker_hour 'cheap' is not a number"),
        (HEADER + "0,1,-2\n", "t.csv:2:", "price_per_worker_hour must be >= 0"),
        (HEADER + "5,1,1\n", "t.csv:2:", "first row must be at time_s 0"),
        (HEADER + "0,1,1\n10,1,1\n10,2,1\n", "t.csv:4:", "time_s must increase"),
        (HEADER + "0,1,1\nnan,1,1\n", "t.csv:3:", "finite number"),
        ("", "t.csv:", "empty trace"),
        (HEADER, "t.csv:", "no rows"),
    ],
)
def test_malformed_traces_give_one_line_naming_file_and_line(text, where, what):
    with pytest.raises(ValueError) as err:
        parse_trace(text, "t.csv")
    message = str(err.value)
    assert message.startswith(where) and what in message
    assert "\n" not in message


def test_load_trace_names_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match="trace file not found: .*nope.csv"):
        load_trace(tmp_path / "nope.csv")


GEN = runpy.run_path(str(TRACES / "make_traces.py"))
MARKETS = list(GEN["MARKETS"])


@pytest.mark.parametrize("name", MARKETS)
def test_example_traces_are_what_their_generator_writes(name):
    text = (TRACES / f"{name}.csv").read_text()
    assert text == GEN["text"](GEN["MARKETS"][name]())


def test_the_trace_set_has_one_market_shape_per_trace():
    t = {name: load_trace(TRACES / f"{name}.csv") for name in MARKETS}
    hours = {n: {p.time_s // 3600: p for p in tr.points} for n, tr in t.items()}
    assert all(tr.duration_s >= WEEK for tr in t.values())
    day = [hours["diurnal"][h].price_per_worker_hour for h in range(24)]
    assert day.index(max(day)) in (19, 20, 21) and day.index(min(day)) in (7, 8, 9)
    steps = {p.price_per_worker_hour for p in t["price-steps"].points}
    assert steps == {0.92, 1.38, 2.53} and {p.capacity for p in t["price-steps"].points} == {32}
    dear = t["cheap-then-dear"]
    assert dear.at(8 * 3600 - 1).price_per_worker_hour * 2.75 == pytest.approx(
        dear.at(8 * 3600).price_per_worker_hour, abs=0.01
    )
    spikes = [p for p in t["spikes"].points if p.price_per_worker_hour >= 3.0]
    assert len(spikes) >= 10 and all(p.capacity == 48 for p in spikes)
    assert (
        t["scarcity"].at(29 * 3600).capacity == 16 and t["scarcity"].at(31 * 3600).capacity == 128
    )
    assert {(p.capacity, p.price_per_worker_hour) for p in t["flat"].points} == {(256, 1.2)}
    zero = [p.time_s for p in t["outage"].points if p.capacity == 0]
    assert min(zero) == 600 and max(zero) < 6000 and len(zero) == 18  # one outage


@pytest.mark.parametrize("name", MARKETS)
def test_acceptance_on_the_trace_set(name):
    """Issue 18: the cost policy within 10% of the oracle's $/sample, by the deadline, and
    never above static-max's $/sample (the default job, as tidal simulate --compare)."""
    tr = load_trace(TRACES / f"{name}.csv")
    rows = {
        r.policy: r
        for r in compare(get_job(DEFAULT_JOB), tr, SimConfig(workers_max=tr.max_capacity))
    }
    best, top = rows["cost"], rows["static-max"]
    assert best.completed and best.completion_s <= best.deadline_s
    assert best.vs_oracle <= 1.10
    assert best.cost_per_sample <= top.cost_per_sample


def test_spot_trace_is_a_week_of_fluctuating_capacity_and_price():
    tr = load_trace(TRACES / "spot.csv")
    caps = {p.capacity for p in tr.points}
    prices = [p.price_per_worker_hour for p in tr.points]
    assert tr.duration_s >= WEEK
    assert len(caps) >= 5 and max(caps) == 128 and min(caps) <= 32
    assert min(prices) >= 0.9 and max(prices) <= 3.06 and max(prices) > 2 * min(prices)


def test_the_policies_cannot_see_the_future():
    """Fed a trace cut at time t (the last row then holds for ever), each policy makes the
    same decisions up to t: nothing it decides on comes from after t."""
    tr = load_trace(TRACES / "spot.csv")
    job = SMALL.with_overrides(total_steps=40_000)
    for cut in (2 * 3600, 3 * 3600 + 1200, 5 * 3600):  # the job starts at 1 h
        early = Trace(tuple(p for p in tr.points if p.time_s <= cut), "cut")
        for name in ("throughput", "cost"):
            cfg = SimConfig(workers_max=128, params=PolicyParams(deadline_s=6 * 3600), start_s=3600)
            full = simulate(job, tr, name, cfg).log
            short = simulate(job, early, name, cfg).log
            before = [d for d in full if d[0] < cut]
            assert before and before == [d for d in short if d[0] < cut], (name, cut)


def test_market_tracker_summarises_the_past_and_only_the_past():
    m = MarketTracker()
    assert m.summary() is None
    rows = [
        (0, 1.0, 8),
        (600, 1.0, 8),
        (1200, 3.0, 4),
        (1800, 1.0, 8),
        (3600, 1.0, 0),
        (4200, 1.0, 8),
    ]
    for t, price, cap in rows:
        m.observe(t - 3600.0, price, cap)  # the first hour is the market's past
    s = m.summary(1200.0)  # 20 minutes into the job
    assert s.seconds == 4800 and s.price_max == 3.0 and s.price_min == 1.0
    assert s.price_median == pytest.approx(1.0, rel=0.01)
    assert s.price_mean == pytest.approx((1.0 * 4200 + 3.0 * 600) / 4800)
    assert s.price_excursions == 1 and s.price_persistence_s == pytest.approx((600 + 3600) / 2)
    assert s.outage_s == 600 and s.longest_outage_s == 600 and s.capacity_min == 0
    assert s.capacity_low == 4 and s.price_excursion_s == 0  # 25th percentile of the time
    with pytest.raises(ValueError, match="time went back"):
        m.observe(0.0, 1.0, 8)


def test_drop_trace_goes_from_3_to_1_and_back_within_a_minute():
    tr = load_trace(TRACES / "drop.csv")
    assert [p.capacity for p in tr.points] == [3, 1, 3]
    assert tr.points[-1].time_s - tr.points[1].time_s <= 60


# -- the job model -----------------------------------------------------------------------
def test_job_model_is_the_ring_all_reduce_cost_model():
    job = get_job("resnet50-v100")
    assert job.grad_bytes == pytest.approx(102.2e6, rel=1e-3)  # 25.6M fp32 parameters
    assert job.comm_s(1) == 0
    expected = 2 * 7 / 8 * job.grad_bytes / (25e9 / 8) + job.latency_s
    assert job.comm_s(8) == pytest.approx(expected)
    assert job.step_s(8) == pytest.approx(1024 / 8 / 1200 + expected)
    assert job.total_samples >= 90 * 1_281_167 - 1024
    assert set(PRESETS) >= {"resnet50-v100", "resnet50-v100-fp32", "resnet50-v100-100gbe"}


def test_llm_presets_carry_their_cited_figures():
    tiny, llama = get_job("tinyllama-1.1b-a100"), get_job("llama2-7b-a100")
    # TinyLlama: 24k tokens/s per A100-40G, 8 GPUs a node, 2,048-token sequences, 2M-token
    # batches, 22B tokens; 2.2 GB of bf16 gradients over 400 Gbit/s.
    assert tiny.samples_per_s(1) == pytest.approx(8 * 24_000 / 2048, rel=1e-3)
    assert tiny.global_batch * 2048 == 2**21 and tiny.total_steps * 2**21 == pytest.approx(
        22e9, rel=1e-3
    )
    assert tiny.grad_bytes == 2.2e9 and tiny.bandwidth_bytes_s == 50e9
    # Llama 2 7B: 184,320 A100-80GB hours for 2.0T tokens, 4M-token batches of 4,096.
    gpu_tokens_s = llama.samples_per_s(1) * 4096 / 8
    assert gpu_tokens_s * 184_320 * 3600 == pytest.approx(2.0e12, rel=1e-3)
    assert llama.global_batch * 4096 == 4 * 2**20 and llama.bandwidth_bytes_s == 200e9
    assert llama.total_steps * 4 * 2**20 == pytest.approx(20 * 6.74e9, rel=1e-3)  # Chinchilla


def test_unknown_job_and_bad_overrides_are_errors():
    with pytest.raises(
        ValueError, match="unknown job 'bert'; known jobs: llama2-7b-a100, resnet50-v100"
    ):
        get_job("bert")
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        get_job("resnet50-v100").with_overrides(bandwidth_bytes_s=0)


# -- the simulator -----------------------------------------------------------------------
SMALL = get_job("resnet50-v100").with_overrides(total_steps=3000)


def test_static_max_finishes_faster_than_static_min_and_costs_more_per_sample():
    tr = trace("0,16,1.0\n")
    lo = simulate(SMALL, tr, "static-min", SimConfig(workers_max=16))
    hi = simulate(SMALL, tr, "static-max", SimConfig(workers_max=16))
    assert lo.completed and hi.completed
    assert hi.completion_s < lo.completion_s / 4
    assert hi.cost_per_sample > lo.cost_per_sample
    # Constant price: the cost is worker-hours times the price, exactly.
    assert hi.cost == pytest.approx(hi.worker_hours * 1.0)
    assert hi.samples == SMALL.total_samples


def test_static_completion_time_matches_the_model():
    tr = trace("0,8,2.0\n")
    r = simulate(SMALL, tr, "static-max", SimConfig(workers_max=8))
    assert r.completion_s == pytest.approx(SMALL.total_steps * SMALL.step_s(8))
    assert r.cost == pytest.approx(8 * 2.0 * r.completion_s / 3600)


def test_capacity_drops_preempt_and_cost_pauses():
    tr = trace("0,3,1.0\n600,1,1.0\n1200,3,1.0\n")
    r = simulate(SMALL, tr, "static-max", SimConfig(workers_max=3))
    assert r.rescales == 2 and r.peak_workers == 3
    flat = simulate(SMALL, trace("0,3,1.0\n"), "static-max", SimConfig(workers_max=3))
    assert r.completion_s > flat.completion_s + 2 * SMALL.rescale_pause_s


def test_no_capacity_for_ever_means_the_job_does_not_finish():
    r = simulate(SMALL, trace("0,2,1.0\n60,0,1.0\n"), "static-max", SimConfig(workers_max=2))
    assert not r.completed and r.completion_s is None and r.samples < SMALL.total_samples


def test_adaptive_policies_change_size_with_reasons_and_stay_within_capacity():
    tr = trace("0,32,1.0\n3600,8,3.0\n7200,32,1.0\n")
    cfg = SimConfig(workers_max=32, params=PolicyParams(deadline_s=4 * 3600))
    for name in ("throughput", "cost"):
        r = simulate(SMALL.with_overrides(total_steps=20_000), tr, name, cfg)
        assert r.completed and r.decisions >= 1 and r.peak_workers <= 32
        assert all(reason for _, _, reason in r.log)
        assert all(target <= 32 for _, target, _ in r.log)


def test_cost_policy_meets_a_reachable_deadline_cheaper_than_static_max():
    tr = trace("0,64,1.0\n")
    fast = simulate(
        SMALL.with_overrides(total_steps=50_000), tr, "static-max", SimConfig(workers_max=64)
    )
    cfg = SimConfig(workers_max=64, params=PolicyParams(deadline_s=1.3 * fast.completion_s))
    r = simulate(SMALL.with_overrides(total_steps=50_000), tr, "cost", cfg)
    assert r.completion_s <= 1.3 * fast.completion_s
    assert r.cost_per_sample < 0.8 * fast.cost_per_sample


def test_compare_runs_every_policy_and_gives_cost_1_1_x_static_max():
    tr = trace("0,64,1.0\n")
    results = compare(SMALL, tr, SimConfig(workers_max=64))
    assert [r.policy for r in results] == list(COMPARE_POLICIES)
    by = {r.policy: r for r in results}
    assert by["cost"].deadline_s == pytest.approx(1.1 * by["static-max"].completion_s)
    given = compare(SMALL, tr, SimConfig(workers_max=64, params=PolicyParams(deadline_s=9999)))
    assert {r.policy: r for r in given}["cost"].deadline_s == 9999


def test_simulation_is_deterministic():
    tr = load_trace(TRACES / "spot.csv")
    job = SMALL.with_overrides(total_steps=30_000)
    a = simulate(job, tr, "cost", SimConfig(workers_max=128, params=PolicyParams(deadline_s=9e3)))
    b = simulate(job, tr, "cost", SimConfig(workers_max=128, params=PolicyParams(deadline_s=9e3)))
    assert a == b


def test_config_validation():
    with pytest.raises(ValueError, match="--workers-min <= --workers-max"):
        SimConfig(workers_min=5, workers_max=4)
    with pytest.raises(ValueError, match="--workers 9 is outside"):
        SimConfig(workers_max=4, workers=9)
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(SMALL, trace("0,1,1\n"), "nope", SimConfig(workers_max=1))


@pytest.mark.timeout(120)
def test_ten_thousand_workers_over_a_week():
    """Event-driven: a week of 10-minute rows at up to 10,000 workers, every policy."""
    rows = "".join(
        f"{t},{10_000 - (t // 600 % 7) * 700},{1.0 + (t // 600 % 5) * 0.4:.2f}\n"
        for t in range(0, WEEK + 1, 600)
    )
    tr = trace(rows)
    job = get_job("resnet50-v100").with_overrides(
        global_batch=2**20, grad_bytes=1e6, total_steps=10**7
    )
    cfg = SimConfig(workers_max=10_000, max_sim_s=WEEK)
    results = compare(job, tr, cfg)
    by = {r.policy: r for r in results}
    hi = by["static-max"]
    assert not hi.completed  # the job is longer than the week: it ran the whole trace
    assert hi.peak_workers == 10_000 and hi.rescales > 500
    assert hi.worker_hours == pytest.approx(
        sum(min(10_000, p.capacity) * 600 for p in tr.points[:-1]) / 3600, rel=0.01
    )
    assert by["throughput"].peak_workers > 1000


def test_start_offset_replays_the_trace_from_there():
    tr = trace("0,2,1.0\n600,8,4.0\n")
    late = simulate(SMALL, tr, "static-max", SimConfig(workers_max=8, start_s=600))
    early = simulate(SMALL, tr, "static-max", SimConfig(workers_max=8))
    assert late.peak_workers == 8 and late.rescales == 0
    assert late.completion_s == pytest.approx(SMALL.total_steps * SMALL.step_s(8))
    assert late.cost == pytest.approx(8 * 4.0 * late.completion_s / 3600)
    assert early.rescales == 1 and early.completion_s > late.completion_s
