"""The scaling policies are pure functions: feed measurements, check the decisions."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tidal.policy import get_policy, known_policies, parse_duration
from tidal.policy.inputs import Decision, Measurements, PolicyParams, SizeStats
from tidal.policy.market import Market
from tidal.policy.model import fit, ring_factor
from tidal.policy.registry import Measurements as CoordinatorMeasurements

# A job model to derive measurements from: per-sample compute C on one worker, ring
# all-reduce bandwidth term A and latency L per sample (ResNet-50-like proportions).
C, A, L, BATCH = 1 / 1200, 0.0327 / 1024, 0.001 / 1024, 1024


def true_rate(n: int, c: float = C, a: float = A, lat: float = L) -> float:
    comm = a * ring_factor(n) + lat if n > 1 else 0.0
    return 1.0 / (c / n + comm)


def stats(n: int, steps: int = 50, rate: float | None = None, split: bool = True) -> SizeStats:
    x = true_rate(n) if rate is None else rate
    step_s = BATCH / x
    comm = (A * ring_factor(n) + L) * BATCH if n > 1 else 0.0
    return SizeStats(
        world_size=n,
        samples_per_s=x,
        samples=steps * BATCH,
        steps=steps,
        compute_s=step_s - comm if split else None,
        comm_s=comm if split else None,
    )


def meas(n: int, sizes=None, **kw) -> Measurements:
    base = dict(
        step=1000,
        world_size=n,
        target=n,
        min_workers=1,
        max_workers=64,
        stats=tuple(stats(k) for k in (sizes if sizes is not None else [n])),
        rescale_pause_s=10.0,
        price_per_worker_hour=1.0,
        max_steps=100_000,
        elapsed_s=3600.0,
        since_change_s=600.0,
    )
    base.update(kw)
    return Measurements(**base)


throughput = get_policy("throughput")
cost = get_policy("cost")


# -- registry and inputs ---------------------------------------------------------------
def test_registry_knows_the_three_policies_and_names_them_on_a_typo():
    assert known_policies() == ["static", "cost", "throughput"]
    with pytest.raises(ValueError, match="unknown policy 'thruput'; known policies: static, cost"):
        get_policy("thruput")


def test_the_coordinators_five_field_measurements_still_work_with_every_policy():
    m = CoordinatorMeasurements(step=3, world_size=2, target=2, min_workers=1, max_workers=3)
    for name in known_policies():
        d = get_policy(name)(m)
        assert isinstance(d, Decision) and d.target == 2 and d.reason


def test_static_keeps_the_target_even_when_capacity_is_lower():
    d = get_policy("static")(meas(8, capacity=3))
    assert d.target == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_workers=0), "min_workers"),
        (dict(min_workers=5, max_workers=4), "raise --max-workers"),
        (dict(price_per_worker_hour=-1.0), "price_per_worker_hour"),
        (dict(stats=(stats(2), stats(2))), "at most one SizeStats per world size"),
        (dict(max_steps=0), "max_steps"),
    ],
)
def test_measurements_validate_with_the_fix_in_the_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        meas(4, **kwargs)


def test_params_and_stats_validate():
    with pytest.raises(ValueError, match=r"min_efficiency must be in \(0, 1\]"):
        PolicyParams(min_efficiency=1.5)
    with pytest.raises(ValueError, match="hysteresis"):
        PolicyParams(min_efficiency=0.1, hysteresis=0.2)
    with pytest.raises(ValueError, match="both compute_s and comm_s"):
        SizeStats(world_size=2, samples_per_s=10, samples=10, steps=1, compute_s=0.1)
    with pytest.raises(ValueError, match="deadline must be a positive duration"):
        PolicyParams(deadline_s=0)


def test_parse_duration():
    assert parse_duration("5400") == 5400
    assert parse_duration("90m") == 5400
    assert parse_duration("1d12h") == 36 * 3600
    assert parse_duration("2.5h") == 9000
    for bad in ("abc", "10x", "-5", "0", "1h 2q"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)


# -- the model ---------------------------------------------------------------------------
def test_fit_recovers_the_all_reduce_model_from_the_split():
    model = fit([stats(1), stats(4), stats(16)])
    assert model.comm_known
    assert model.c == pytest.approx(C, rel=1e-9)
    assert model.a == pytest.approx(A, rel=1e-6) and model.l == pytest.approx(L, rel=1e-5)
    assert model.samples_per_s(64) == pytest.approx(true_rate(64), rel=1e-9)


def test_fit_without_split_uses_size_one_as_the_compute_baseline():
    model = fit([stats(1, split=False), stats(4, split=False), stats(16, split=False)])
    assert model.samples_per_s(32) == pytest.approx(true_rate(32), rel=1e-6)


def test_fit_from_one_size_alone_guesses_perfect_scaling():
    model = fit([stats(4, split=False)])
    assert not model.comm_known
    assert model.samples_per_s(8) == pytest.approx(2 * true_rate(4))


def test_fit_from_two_sizes_above_one_without_split_predicts_between_and_beyond():
    model = fit([stats(4, split=False), stats(16, split=False)])
    assert model.samples_per_s(8) == pytest.approx(true_rate(8), rel=1e-6)
    assert model.samples_per_s(64) == pytest.approx(true_rate(64), rel=1e-6)


# -- gates -------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [throughput, cost])
def test_capacity_below_the_target_is_followed_at_once_even_in_cooldown(policy):
    d = policy(meas(8, capacity=3, since_change_s=1.0))
    assert d.target == 3 and "capacity is 3" in d.reason


@pytest.mark.parametrize("policy", [throughput, cost])
def test_no_decision_while_measuring_cooling_down_or_changing(policy):
    d = policy(meas(2, stats=(SizeStats(world_size=2, samples_per_s=9.0, samples=50, steps=5),)))
    assert d.target == 2 and "measuring 2 workers: 5/20 steps" in d.reason
    d = policy(meas(2, since_change_s=12.0))
    assert d.target == 2 and "cooling down" in d.reason
    d = policy(meas(2, world_size=3))
    assert d.target == 2 and "waiting for the world size (3)" in d.reason


def test_slow_steps_are_trusted_after_min_measure_s():
    slow = SizeStats(world_size=1, samples_per_s=10.0, samples=1000, steps=3)  # 100 s
    d = throughput(meas(1, stats=(slow,), rescale_pause_s=1.0))
    assert "measuring" not in d.reason


# -- throughput --------------------------------------------------------------------------
def efficiency(a: int, b: int, xa: float, xb: float) -> float:
    return ((xb - xa) / (b - a)) / (xa / a)


def two_sizes(n: int, k: int, e: float, xn: float = 4000.0) -> tuple[SizeStats, SizeStats]:
    """Stats at ``n`` and ``k`` whose measured marginal efficiency from n to k is ``e``."""
    xk = xn + e * (k - n) * xn / n
    return (
        SizeStats(world_size=n, samples_per_s=xn, samples=50 * BATCH, steps=50),
        SizeStats(world_size=k, samples_per_s=xk, samples=50 * BATCH, steps=50),
    )


def test_throughput_grows_to_a_measured_size_while_efficiency_is_high():
    d = throughput(meas(4, stats=two_sizes(4, 5, 0.9)))
    assert d.target == 5
    assert "grow 4 -> 5" in d.reason and "0.90" in d.reason and "4,000 samples/s" in d.reason
    assert d.predicted["samples_per_s"] == pytest.approx(4900.0)


def test_throughput_shrinks_when_efficiency_falls_below_the_band():
    d = throughput(meas(5, stats=two_sizes(4, 5, 0.5)))
    assert d.target == 4
    assert "shrink 5 -> 4" in d.reason and "is 0.50" in d.reason and "< 0.65" in d.reason


@pytest.mark.parametrize("e", [0.66, 0.68, 0.70, 0.72, 0.74])
def test_throughput_does_not_flap_inside_the_hysteresis_band(e):
    assert throughput(meas(4, stats=two_sizes(4, 5, e))).target == 4
    assert throughput(meas(5, stats=two_sizes(4, 5, e))).target == 5


def test_throughput_never_flaps_over_noisy_measurements_around_the_threshold():
    """A loop of decisions at the threshold with +-0.04 noise: the target never moves."""
    target, changes = 4, 0
    for i in range(200):
        e = 0.70 + 0.04 * math.sin(i * 1.7)
        d = throughput(meas(target, stats=two_sizes(4, 5, e), since_change_s=1e4))
        changes += d.target != target
        target = d.target
    assert changes == 0


def test_throughput_cooldown_blocks_a_second_change_right_after_the_first():
    assert throughput(meas(4, stats=two_sizes(4, 5, 0.9), since_change_s=5.0)).target == 4


def test_throughput_explores_an_untried_size_when_the_gain_pays_for_the_pause():
    d = throughput(meas(1, sizes=[1], rescale_pause_s=None))
    assert d.target == 2
    assert "explore 1 -> 2" in d.reason and "predicted" in d.reason and "perfect" in d.reason


def test_throughput_does_not_explore_when_the_gain_cannot_pay_for_the_pause():
    # 20 steps left at 1,200 samples/s: 17 s, halved by a second worker; pause 30 s.
    d = throughput(meas(1, sizes=[1], step=99_980, rescale_pause_s=30.0))
    assert d.target == 1 and "not worth a change" in d.reason
    d = throughput(meas(1, sizes=[1], step=99_000, rescale_pause_s=300.0))
    assert d.target == 1 and "saves" in d.reason and "rescale pause 5.0 min" in d.reason


def test_throughput_explores_in_steps_of_a_quarter_and_stops_where_efficiency_drops():
    # With the ResNet-like model the marginal efficiency 3->4 is about 0.75: explore stops.
    d = throughput(meas(2, sizes=[1, 2]))
    assert d.target == 3 and "explore 2 -> 3" in d.reason
    d = throughput(meas(3, sizes=[1, 2, 3]))
    assert d.target == 3 and "hold 3 workers" in d.reason
    fast = [
        SizeStats(world_size=k, samples_per_s=1000.0 * k, samples=9e4, steps=90) for k in (1, 8)
    ]
    assert throughput(meas(8, stats=tuple(fast))).target == 10  # 8 + round(8 * 0.25)


def test_throughput_respects_max_workers_and_capacity():
    fast = tuple(
        SizeStats(world_size=k, samples_per_s=1000.0 * k, samples=9e4, steps=90) for k in (1, 3)
    )
    d = throughput(meas(3, stats=fast, max_workers=3))
    assert d.target == 3 and "ceiling of 3" in d.reason
    assert throughput(meas(3, stats=fast, capacity=3)).target == 3


# -- cost --------------------------------------------------------------------------------
FLAT = PolicyParams(price_premium=0.0)  # trusts the past: no hedge, the plain deadline rule


def brute_fewest(m: Measurements, limit: float) -> int:
    """The fewest workers finishing within ``limit`` under the true model."""
    remaining = (m.max_steps - m.step) * BATCH
    for k in range(m.min_workers, m.max_workers + 1):
        pause = 0.0 if k == m.world_size else m.rescale_pause_s
        if pause + remaining / true_rate(k) <= limit:
            return k
    raise AssertionError("none")


def reserve(left: float, pause: float = 10.0) -> float:
    return max(0.01 * left, 2 * pause)


def deadline_meas(n: int, deadline_s: float, params: PolicyParams = FLAT, **kw) -> Measurements:
    return meas(
        n,
        sizes=sorted({1, 4, 16, n}),
        params=replace(params, deadline_s=deadline_s),
        **kw,
    )


def market(
    price: float = 1.0, *, median: float | None = None, spell: float = 3600.0, ended: int = 0
) -> Market:
    """A market seen for a day at ``median`` (default ``price``), now at ``price``."""
    mid = price if median is None else median
    return Market(
        seconds=86400.0,
        price_mean=mid,
        price_median=mid,
        price_min=min(mid, price),
        price_max=max(mid, price),
        price_recent=mid,
        price_persistence_s=spell,
        price_excursions=ended,
        capacity_mean=64.0,
        capacity_min=64,
        capacity_low=64,
    )


def test_cost_starts_at_the_most_workers_when_nothing_is_measured():
    m = meas(1, stats=(), params=PolicyParams(deadline_s=7200), capacity=40)
    d = cost(m)
    assert d.target == 64 and "nothing measured yet" in d.reason  # max_workers: the world
    assert cost(replace(m, params=PolicyParams())).target == 1  # is min(target, capacity)


def test_cost_grows_to_the_fewest_workers_that_meet_the_deadline_when_behind():
    # 99,000 steps of 1,024 samples left; a deadline that needs about 40 workers.
    remaining = 99_000 * BATCH
    deadline = 3600 + remaining / true_rate(40) / 0.99 + 60
    m = deadline_meas(4, deadline)  # far behind at 4 workers
    d = cost(m)
    left = deadline - 3600
    assert d.target == brute_fewest(m, left - reserve(left))
    assert 35 <= d.target <= 45
    assert "grow 4 ->" in d.reason and "deadline in" in d.reason
    assert d.predicted["finish_s"] <= deadline


def test_cost_shrinks_to_the_plan_when_well_ahead_and_holds_near_it():
    remaining = 99_000 * BATCH
    deadline = 3600 + remaining / true_rate(20) / 0.99
    m = deadline_meas(64, deadline)
    d = cost(m)
    assert d.target == brute_fewest(m, deadline - 3600 - reserve(deadline - 3600))
    assert "shrink 64 ->" in d.reason and "gains $" in d.reason
    plan = d.target
    # At the plan (or within the hysteresis band above it): hold, no flapping.
    for n in (plan, plan + 1):
        assert cost(deadline_meas(n, deadline)).target == n


def test_cost_grows_to_the_fastest_size_when_the_deadline_cannot_be_met():
    d = cost(deadline_meas(8, 3600 + 600))
    assert d.target == 64 and "cannot be met" in d.reason


def linear_stats(*sizes: int) -> tuple[SizeStats, ...]:
    return tuple(
        SizeStats(world_size=k, samples_per_s=1000.0 * k, samples=90 * BATCH, steps=90)
        for k in sizes
    )


def test_cost_holds_when_a_change_gains_less_than_one_percent_of_the_spend():
    # Linear scaling at a flat price: every size costs the same per sample, so shrinking
    # from 30 to the 20 the deadline needs gains nothing worth a pause.
    remaining = 99_000 * BATCH
    deadline = 3600 + remaining / 20_000 / 0.99 + 30
    m = meas(30, stats=linear_stats(1, 20, 30), params=replace(FLAT, deadline_s=deadline))
    d = cost(m)
    assert d.target == 30 and "would gain $0.00" in d.reason and "1% of the spend" in d.reason


def test_cost_premium_hedges_by_hurrying_only_where_it_is_cheap():
    """A rise it cannot foresee is hedged by getting ahead: every worker when scaling is
    linear (the same $/sample at any size), a few more on the flat top (dear there)."""
    remaining = 99_000 * BATCH
    deadline = 3600 + remaining / 20_000 / 0.99 + 30  # linear: about 20 workers
    hedge = PolicyParams(deadline_s=deadline)
    m = meas(20, stats=linear_stats(1, 4, 20), params=hedge, market=market())
    assert cost(m).target == 64
    deadline = 3600 + remaining / true_rate(20) / 0.99  # flat top: about 20 workers
    m = deadline_meas(20, deadline, params=PolicyParams(), market=market())
    need = brute_fewest(m, deadline - 3600 - reserve(deadline - 3600))
    assert need <= cost(m).target <= 1.15 * need + 1


def test_cost_hurries_while_the_price_is_low_against_the_median_seen():
    remaining = 99_000 * BATCH
    deadline = 3600 + remaining / true_rate(20) / 0.99
    calm = cost(deadline_meas(20, deadline, market=market(1.0)))
    cheap = cost(deadline_meas(20, deadline, market=market(1.0, median=2.5)))
    assert calm.target <= 21 < cheap.target
    assert "outlook $" in cheap.reason and "grow 20 ->" in cheap.reason


def test_cost_waits_out_a_spike_in_a_market_whose_spikes_pass():
    remaining = 99_000 * BATCH
    deadline = 3600 + remaining / true_rate(20) / 0.99 + 600
    spiky = market(3.0, median=1.0, spell=900.0, ended=12)  # 15-minute spikes, 12 seen
    d = cost(deadline_meas(20, deadline, market=spiky, price_per_worker_hour=3.0))
    assert d.target < 20 and "dear now" in d.reason and "shrink 20 ->" in d.reason


def test_cost_does_not_wait_out_a_rise_the_market_never_showed_passing_when_linear():
    remaining = 99_000 * BATCH
    sizes = tuple(
        SizeStats(world_size=k, samples_per_s=1000.0 * k, samples=90 * BATCH, steps=90)
        for k in (1, 4, 20)
    )
    deadline = 3600 + remaining / 20_000 / 0.99 + 60
    step = market(3.0, median=1.0, spell=3600.0, ended=0)  # flat history, then a rise
    m = meas(20, stats=sizes, params=replace(FLAT, deadline_s=deadline), market=step)
    d = cost(replace(m, price_per_worker_hour=3.0))
    assert d.target >= 20  # the rise may be a lasting step: putting work off saves nothing


def test_cost_gates_no_capacity_more_workers_than_samples_and_an_unmeasured_size():
    deadline = 3600 + 99_000 * BATCH / true_rate(40)
    params = replace(FLAT, deadline_s=deadline)
    d = cost(meas(0, sizes=[1, 4, 16], target=40, capacity=0, params=params))
    assert d.target == 40 and "no capacity now" in d.reason  # waits, keeps its target
    # A size not measured yet (the capacity moved the world there): the fitted model decides.
    fresh = meas(23, sizes=[1, 4, 16], target=40, capacity=23, params=params)
    assert "measuring" not in cost(fresh).reason
    assert "measuring" in throughput(meas(23, sizes=[1, 16])).reason
    # More workers than a step has samples for: down at once.
    few = meas(64, sizes=[1, 4, 64], max_steps=100_000, params=PolicyParams(deadline_s=deadline))
    few = replace(few, stats=tuple(replace(x, samples=x.steps * 32) for x in few.stats))
    d = cost(few)
    assert d.target <= 32 and "shrink 64 ->" in d.reason and "a step has samples for 32" in d.reason


def test_cost_keeps_its_target_when_the_capacity_dips_below_it():
    remaining = 99_000 * BATCH
    deadline = 3600 + remaining / true_rate(40) / 0.99
    m = deadline_meas(30, deadline, target=40, capacity=30)  # world follows the capacity
    d = cost(m)
    assert d.target >= 40 and "available now" in d.reason
    # The throughput policy follows the capacity down instead.
    assert throughput(meas(30, target=40, capacity=30)).target == 30


def test_cost_budget_stops_growth_before_the_budget_would_be_exceeded():
    fast = tuple(
        SizeStats(world_size=k, samples_per_s=1000.0 * k, samples=90 * BATCH, steps=90)
        for k in (1, 4)
    )
    # Perfect scaling: every size costs the same per sample, so only the budget limits.
    # 99,000 steps x 1,024 samples / 1,000 per worker-second = 28.2 worker-hours = $28.16.
    params = PolicyParams(budget=28.0)
    d = cost(meas(4, stats=fast, params=params, spent=0.0))
    assert d.target == 1 and "exceed the $28.00 budget" in d.reason
    d = cost(meas(4, stats=fast, params=PolicyParams(budget=40.0)))
    assert d.target == 5 and "budget $40.00 allows <= 64" in d.reason
    # Once the budget only fits the current size, growth stops.
    near = PolicyParams(budget=28.165)  # $28.16 at 4 workers, $28.174 with a pause to 5
    assert cost(meas(4, stats=fast, params=near)).target == 4


def test_cost_budget_shrinks_when_the_projection_exceeds_it():
    # At 16 workers the rest of the job costs $50.90, at 4 workers $29.
    d = cost(meas(16, sizes=[1, 4, 16], params=PolicyParams(budget=40.0)))
    assert 4 < d.target < 16
    assert "shrink 16 -> " in d.reason and "exceeds the budget $40.00" in d.reason
    assert d.predicted["cost"] <= 40.0


def test_cost_budget_wins_over_the_deadline():
    remaining = 99_000 * BATCH
    deadline = 3600 + remaining / true_rate(40) / 0.95 + 60
    unlimited = cost(deadline_meas(4, deadline))
    capped = cost(meas(4, sizes=[1, 4, 16], params=PolicyParams(deadline_s=deadline, budget=70.0)))
    assert capped.target < unlimited.target
    assert "the budget $70.00 allows at most" in capped.reason
    assert capped.predicted["cost"] <= 70.0


def test_cost_without_deadline_or_budget_goes_to_the_cheapest_size():
    d = cost(meas(8, sizes=[1, 8]))
    assert d.target == 1 and "cheapest $/sample" in d.reason
    assert cost(meas(1, sizes=[1, 8])).target == 1


def test_cost_needs_max_steps_for_a_deadline():
    d = cost(meas(4, sizes=[1, 4], max_steps=None, params=PolicyParams(deadline_s=7200)))
    assert d.target == 4 and "needs the job's max_steps" in d.reason
