"""``sim_vs_live``'s pure parts (the trace it writes, the model it measures from a status
and step records, the simulate command and the rows) and the simulator's measured model
(per-size step times, start-up); the live run itself is ``-m bench``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.common import Rec
from bench.sim_vs_live import (
    measured_model,
    rows,
    run_simulate,
    simulate_args,
    step_times,
    trace_csv,
    within,
)
from tidal.sim.job import PRESETS
from tidal.sim.simulate import SimConfig, simulate
from tidal.sim.trace import parse_trace


def _ends(t0: float, first: int, n: int, step: float, world: int, pid: int = 1) -> list[Rec]:
    return [Rec("E", t0 + i * step, first + i, world, 0, pid) for i in range(n)]


def test_the_trace_cycles_and_parses() -> None:
    trace = parse_trace(trace_csv(40.0, cycles=2))
    caps = [(p.time_s, p.capacity) for p in trace.points]
    # 2 -> 3 -> 1 -> 2, twice; the cycle's last 2 and the next one's first are one row
    assert caps == [(0, 2), (10, 3), (20, 1), (30, 2), (50, 3), (60, 1), (70, 2)]
    assert trace.at(25).price_per_worker_hour == 6.0


def test_step_times_skip_the_step_that_holds_a_change() -> None:
    recs = _ends(100.0, 0, 11, 0.2, 2) + _ends(103.0, 11, 5, 0.3, 3)
    recs.append(Rec("E", 100.1, 3, 2, 1, 2))  # another rank: not counted
    t = step_times(recs)
    assert t[2]["steps"] == 10 and t[2]["mean_s"] == pytest.approx(0.2)
    assert t[3]["steps"] == 4 and t[3]["mean_s"] == pytest.approx(0.3)  # 102.0 -> 103.0 is not


def test_the_model_is_measured_from_the_status_and_the_steps() -> None:
    recs = _ends(105.0, 0, 11, 0.2, 2) + _ends(107.5, 11, 6, 0.1, 1)
    status = {
        "created": 100.0,
        "step": 17,
        "generations": [
            {"id": 1, "world_size": 2, "pause_s": None},
            {"id": 2, "world_size": 1, "pause_s": 0.6},  # 0.5 s stalled + the new size's step
        ],
        "events": [{"time": 109.0, "kind": "job", "message": "job ended: succeeded at step 17"}],
    }
    m = measured_model(status, recs, global_batch=64)
    assert m["step_s"] == {2: pytest.approx(0.2), 1: pytest.approx(0.1)}
    assert m["pause_s"] == pytest.approx(0.5)
    assert m["first_step_s"] == pytest.approx(5.0)  # created to the first step's end
    assert m["winddown_s"] == pytest.approx(1.0)  # the last step (108.0) to the job's end
    assert m["startup_s"] == pytest.approx(6.0)
    assert m["sample_time"] == pytest.approx(0.1 / 64)
    assert m["steps"] == 17


def test_the_rows_are_sim_over_live_and_the_goal_is_ten_percent() -> None:
    sim, live = {"completion_s": 66.0, "cost": 0.19}, {"completion_s": 60.0, "cost": 0.2}
    t, c = rows(sim, live, {"trace": "x"})
    assert (t["name"], t["tidal"], t["peer"], t["peer_name"]) == ("sim_vs_live", 66, 60, "live")
    assert t["ratio"] == pytest.approx(1.1) and c["ratio"] == pytest.approx(0.95)
    assert c["name"] == "sim_vs_live_cost" and c["peer_config"] == {"trace": "x"}
    assert within(t["ratio"] - 1e-9) and within(c["ratio"]) and not within(1.2)
    assert not within(0.85) and within(None) is None
    from bench.__main__ import met

    assert met(t, {}) is True and met({**c, "ratio": 0.8}, {}) is False


def test_the_simulator_replays_the_measured_model(tmp_path: Path) -> None:
    """One cycle of 40 s: 2 workers (0.2 s steps) for 10 s, 3 (0.25 s) for 10, 1 (0.1 s)
    for 10, then 2. Start-up 4 s, pause 0.5 s a change: 30 steps by 10 s, 68 by 20, 163 by
    30, then 5 a second from 30.5 s."""
    trace = tmp_path / "trace.csv"
    trace.write_text(trace_csv(40.0, cycles=1))
    model = {"step_s": {1: 0.1, 2: 0.2, 3: 0.25}, "pause_s": 0.5, "startup_s": 4.0,
             "sample_time": 0.1 / 64, "global_batch": 64, "steps": 183}  # fmt: skip
    sim = run_simulate(simulate_args(trace, model))
    assert sim["completion_s"] == pytest.approx(30.5 + 20 * 0.2)
    price_s = [(10, 2, 3.0), (10, 3, 1.5), (10, 1, 6.0), (4.5, 2, 3.0)]
    assert sim["cost"] == pytest.approx(sum(d * n * p for d, n, p in price_s) / 3600)
    assert sim["rescales"] == 3


def test_measured_steps_replace_the_formula_at_their_sizes() -> None:
    base = PRESETS["resnet50-v100"]
    job = base.with_overrides(measured_step_s=((2, 5.0),))
    assert job.step_s(2) == 5.0 and job.step_s(3) == base.step_s(3)
    assert job.compute_s(2) + job.comm_s(2) == pytest.approx(5.0)
    fast = base.with_overrides(measured_step_s=((2, 0.01),))  # below the formula's compute
    assert fast.compute_s(2) == 0.01 and fast.comm_s(2) == 0.0
    with pytest.raises(ValueError, match="measured step"):
        base.with_overrides(measured_step_s=((2, 0.0),))
    with pytest.raises(ValueError, match="start-up"):
        base.with_overrides(startup_s=-1.0)


def test_the_oracle_rates_a_measured_size_as_the_simulator_does() -> None:
    import numpy as np

    from tidal.sim.oracle import rates

    job = PRESETS["resnet50-v100"].with_overrides(measured_step_s=((1, 2.0), (3, 0.5)))
    x = rates(job, np.array([0, 1, 2, 3]))
    assert x[0] == 0.0
    assert list(x[1:]) == pytest.approx([job.samples_per_s(n) for n in (1, 2, 3)])
    assert x[1] == pytest.approx(1024 / 2.0) and x[3] == pytest.approx(1024 / 0.5)


def test_the_start_up_is_paid_and_trains_nothing() -> None:
    trace = parse_trace("time_s,capacity,price_per_worker_hour\n0,2,3.6\n")
    job = PRESETS["resnet50-v100"].with_overrides(measured_step_s=((2, 1.0),), total_steps=10)
    config = SimConfig(workers_max=2, workers=2)
    bare = simulate(job, trace, "static", config)
    slow = simulate(job.with_overrides(startup_s=5.0), trace, "static", config)
    assert bare.completion_s == pytest.approx(10.0)
    assert slow.completion_s == pytest.approx(15.0)
    assert slow.cost == pytest.approx(2 * 15 * 3.6 / 3600)
    assert slow.rescales == 0


def test_simulate_cli_reads_step_s_and_refuses_a_bad_one(tmp_path: Path, capsys) -> None:
    from tidal.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("time_s,capacity,price_per_worker_hour\n0,1,1\n")
    args = ["simulate", "--trace", str(trace), "--policy", "static", "--steps", "10"]
    assert main([*args, "--step-s", "1=0.5", "--startup", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["completion_s"] == pytest.approx(7.0)
    assert main([*args, "--step-s", "1:0.5"]) == 1
    assert "--step-s: expected N=SECONDS, got '1:0.5'" in capsys.readouterr().err


@pytest.mark.bench
@pytest.mark.timeout(600)
def test_sim_vs_live_runs_end_to_end(tmp_path: Path) -> None:
    """A live job on a 20 s cycle and the simulator on the same trace (~1-2 min on 2 cores:
    ``pytest -m bench``). No accuracy is asserted: a loaded machine moves the live run."""
    from bench.sim_vs_live import measure

    res = measure(20.0, tmp_path)
    assert res["live"]["state"] == "succeeded" and res["sim"]["completed"]
    assert set(res["model"]["step_s"]) <= {1, 2, 3} and res["model"]["startup_s"] > 0
    print(json.dumps({k: res[k] for k in ("live", "sim")}), file=sys.stderr)
