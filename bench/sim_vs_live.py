"""Simulator against reality: ``tidal simulate`` against a live job on the same trace.

A capacity trace (``TRACE``: capacity 2, 3, 1, 2 in four equal parts of ``length_s``, each at
its own price, the cycle repeated ``CYCLES`` times: a job slowed by a loaded machine still
meets changes to its end) drives a live job, ``tidal run --workers 3 --max-workers 3 --capacity TRACE``
on the bench's MLP (``bench/train_mlp.py``): the static policy at 3 workers, its world size
``min(3, capacity)`` as the trace moves (a drop is a preemption notice, a rise a new worker).
Its steps are sized from a step of the model timed in this process, so the job lasts about
the trace at the machine's speed now. Live: the completion time, from the job's creation
(the trace's time 0) to its end (its ``job ended`` event), and the cost ``tidal status
--json`` reports at the end.

The job model is measured on that same run (``measured_model``): the mean step time at each
world size it trained at (rank 0's step records, the intervals between consecutive steps of
one generation), the rescale pause (the generations' ``pause_s`` less the step each of them
includes), the start-up (creation to the first step) and the wind-down (the last step to
the end: a fixed overhead the simulator charges with the start-up). ``tidal simulate
--policy static --workers 3`` runs that model (``--step-s``, ``--pause``, ``--startup``)
over the same trace. Rows: ``sim_vs_live`` (completion time) and ``sim_vs_live_cost``,
``tidal`` the simulator's, ``peer`` the live run's, ``ratio`` sim / live (goal: within
0.9 to 1.1).
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import TRAIN, Procs, Rec, ends, log, read_records, tidal_cmd
from bench.rows import row

#: (fraction of the trace's length, capacity, dollars per worker-hour)
TRACE = ((0.0, 2, 3.0), (0.25, 3, 1.5), (0.5, 1, 6.0), (0.75, 2, 3.0))
WORKERS = 3
POLICY = "static"
BATCH = 64
#: a step at 2 members over a step in this process (measured here: ws2's 44 ms against
#: ws1's 31 ms, docs/benchmarks.md; 3 workers share 2 cores): the job's mean.
SLOWDOWN = 1.6
CYCLES = 4
GOAL = (0.9, 1.1)


# -- pure parts -----------------------------------------------------------------------------
def trace_csv(
    length_s: float, points: Sequence[tuple[float, int, float]] = TRACE, cycles: int = CYCLES
) -> str:
    """The trace's CSV: ``points`` over ``length_s``, ``cycles`` times over (the last row
    holds for ever)."""
    lines, last = ["time_s,capacity,price_per_worker_hour"], None
    for k in range(cycles):
        for f, cap, price in points:
            if (cap, price) != last:  # a row equal to the one before it is no change
                lines.append(f"{round((k + f) * length_s, 3):g},{cap},{price:g}")
            last = (cap, price)
    return "\n".join(lines) + "\n"


def describe_trace(
    length_s: float, points: Sequence[tuple[float, int, float]] = TRACE, cycles: int = CYCLES
) -> str:
    one = "; ".join(f"{f * length_s:g} s: {cap} @ ${price:g}/h" for f, cap, price in points)
    return f"{one}; every {length_s:g} s, {cycles} times, then {points[-1][1]} for ever"


def size_steps(length_s: float, step_s: float, slowdown: float = SLOWDOWN) -> int:
    """Steps that last about ``length_s`` at ``slowdown`` x a step timed in one process."""
    return max(50, int(0.9 * length_s / (slowdown * step_s)))


def step_times(recs: Sequence[Rec]) -> dict[int, dict]:
    """Per world size: rank 0's ``mean_s`` between consecutive step ends of one process at
    that size (the first step after a change, which holds the pause, is not counted) and
    the ``steps`` counted."""
    by_pid: dict[int, list[Rec]] = {}
    for r in ends(list(recs)):
        if r.rank == 0:
            by_pid.setdefault(r.pid, []).append(r)
    diffs: dict[int, list[float]] = {}
    for rs in by_pid.values():
        rs.sort(key=lambda r: r.time)
        for a, b in zip(rs, rs[1:], strict=False):
            if a.world == b.world and b.index == a.index + 1:
                diffs.setdefault(b.world, []).append(b.time - a.time)
    return {w: {"mean_s": statistics.fmean(d), "steps": len(d)} for w, d in sorted(diffs.items())}


def end_time(status: dict) -> float:
    """When the job ended: its ``job ended`` event (the last event otherwise)."""
    events = status.get("events") or []
    ended = [e["time"] for e in events if e["kind"] == "job" and "ended" in e["message"]]
    if ended:
        return max(ended)
    if not events:
        raise ValueError("the job recorded no events")
    return max(e["time"] for e in events)


def live_result(status: dict) -> dict:
    """The live run's outcome from its final ``tidal status --json``."""
    return {
        "state": status["state"],
        "steps": status["step"],
        "completion_s": end_time(status) - status["created"],
        "cost": status["cost"],
    }


def measured_model(status: dict, recs: Sequence[Rec], *, global_batch: int = BATCH) -> dict:
    """The job model measured on the live run: ``step_s`` per world size, the net rescale
    ``pause_s`` (the mean of the generations' ``pause_s`` less the new size's step, which
    the interval includes), ``startup_s`` (creation to the first step end, plus the
    wind-down from the last step end to the job's end), ``sample_time`` (size 1's step
    over the batch, else the smallest size's times its size), ``global_batch``, ``steps``."""
    times = step_times(recs)
    if not times:
        raise ValueError("no consecutive steps recorded")
    step_s = {w: t["mean_s"] for w, t in times.items()}
    net = []
    for g in status["generations"][1:]:
        if g.get("pause_s") is not None and g["world_size"] in step_s:
            net.append(max(0.0, g["pause_s"] - step_s[g["world_size"]]))
    e = ends(list(recs))
    if not e:
        raise ValueError("no steps recorded")
    first, last = min(r.time for r in e), max(r.time for r in e)
    startup = first - status["created"]
    winddown = max(0.0, end_time(status) - last)
    smallest = min(step_s)
    return {
        "step_s": step_s,
        "steps_timed": {w: t["steps"] for w, t in times.items()},
        "pause_s": statistics.fmean(net) if net else 0.0,
        "pauses_s": [g.get("pause_s") for g in status["generations"][1:]],
        "startup_s": startup + winddown,
        "first_step_s": startup,
        "winddown_s": winddown,
        "sample_time": step_s[smallest] * smallest / global_batch,
        "global_batch": global_batch,
        "steps": status["step"],
    }


def simulate_args(trace: Path, model: dict) -> list[str]:
    """``tidal simulate`` with the measured model, the live job's policy and bounds."""
    step_s = ",".join(f"{w}={s:.6g}" for w, s in sorted(model["step_s"].items()))
    return [
        "simulate", "--trace", str(trace), "--policy", POLICY,
        "--workers", str(WORKERS), "--workers-max", str(WORKERS),
        "--global-batch", str(model["global_batch"]), "--steps", str(model["steps"]),
        "--sample-time", f"{model['sample_time']:.6g}", "--step-s", step_s,
        "--pause", f"{model['pause_s']:.6g}", "--startup", f"{model['startup_s']:.6g}",
        "--json",
    ]  # fmt: skip


def within(ratio: float | None, goal: tuple[float, float] = GOAL) -> bool | None:
    return None if ratio is None else goal[0] <= ratio <= goal[1]


def rows(sim: dict, live: dict, config: dict) -> list[dict]:
    """``sim_vs_live`` and ``sim_vs_live_cost``: the simulator's number as ``tidal``, the
    live run's as ``peer``; ``ratio`` sim / live (higher_is_better: Tidal / peer)."""
    peer = {"peer_name": "live", "peer_config": config, "higher_is_better": True}
    return [
        row("sim_vs_live", sim.get("completion_s"), live["completion_s"], "s", **peer),
        row("sim_vs_live_cost", sim.get("cost"), live["cost"], "$", **peer),
    ]


# -- the run --------------------------------------------------------------------------------
def time_one_step(reps: int = 12) -> float:
    """Median seconds of one forward and backward of the bench's MLP on a global batch, in
    this process on one thread (what the job's steps are sized by)."""
    import torch
    import torch.nn.functional as F

    from bench.train_mlp import build

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, opt, data = build()
        x, y = data.tensors[0][:BATCH], data.tensors[1][:BATCH]
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:])
    finally:
        torch.set_num_threads(threads)


def _status(home: Path, name: str) -> dict:
    from tidal.lookup import get_status

    return json.loads(get_status(home, name).model_dump_json())


def run_live(tmp: Path, trace: Path, steps: int, timeout: float) -> tuple[dict, list[Rec]]:
    home, name, out = tmp / "home", "sim-vs-live", tmp / "steps"
    cmd = tidal_cmd(home, name, "--workers", str(WORKERS), "--max-workers", str(WORKERS),
                    "--capacity", str(trace))  # fmt: skip
    cmd += [str(TRAIN), "--mode", "tidal", "--steps", str(steps), "--out", str(out)]
    procs = Procs()
    try:
        rc = procs.start(cmd, tmp / "live.log").wait(timeout=timeout)
    finally:
        procs.cleanup()
    status = _status(home, name)
    if rc != 0 or status["state"] != "succeeded":
        raise RuntimeError(f"the live job ended {status['state']} (exit {rc}), see {tmp}/live.log")
    return status, read_records(out)


def run_simulate(args: list[str]) -> dict:
    from tidal.cli import main as cli_main

    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = cli_main(args)
    if rc != 0:
        raise RuntimeError(f"tidal {' '.join(args)} exited {rc}: {err.getvalue().strip()}")
    return json.loads(buf.getvalue())[0]


def measure(length_s: float, tmp: Path) -> dict:
    trace = tmp / "trace.csv"
    trace.write_text(trace_csv(length_s))
    one = time_one_step()
    steps = size_steps(length_s, one)
    log(
        f"sim_vs_live: a step here {one * 1000:.1f} ms: {steps} steps on {describe_trace(length_s)}"
    )
    status, recs = run_live(tmp, trace, steps, timeout=max(300.0, 6 * length_s))
    live = live_result(status)
    model = measured_model(status, recs)
    args = simulate_args(trace, model)
    sim = run_simulate(args)
    # what the start-up and wind-down are worth: the same model without them
    bare = run_simulate([*args[: args.index("--startup")], "--startup", "0", "--json"])
    log(
        f"sim_vs_live: live {live['completion_s']:.1f} s ${live['cost']:.5f}; simulated "
        f"{sim['completion_s']:.1f} s ${sim['cost']:.5f} (without the start-up "
        f"{bare['completion_s']:.1f} s ${bare['cost']:.5f}); model {model}"
    )
    return {"live": live, "sim": sim, "sim_no_startup": bare, "model": model, "simulate": args, "length_s": length_s,
            "timed_step_s": one, "trace": trace.read_text()}  # fmt: skip


def config_of(res: dict) -> dict:
    """``peer_config``: the trace, the policy, the live command and the model's values."""
    m = res["model"]
    return {
        "trace": describe_trace(res["length_s"]),
        "policy": f"{POLICY}, --workers {WORKERS} --max-workers {WORKERS} (the world size "
        "follows the capacity)",
        "live": f"tidal run --capacity TRACE bench/train_mlp.py --mode tidal --steps "
        f"{m['steps']} (batch {m['global_batch']}); completion: creation to the job's end; "
        "cost: tidal status --json",
        "model": {
            "step_s": {w: round(s, 5) for w, s in m["step_s"].items()},
            "pause_s": round(m["pause_s"], 4),
            "startup_s": round(m["startup_s"], 3),
            "winddown_s": round(m["winddown_s"], 3),
        },
        "simulate": "tidal " + " ".join(res["simulate"]),
    }


def run_sim_vs_live(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    res = measure(size["sim_trace_s"], tmp)
    return rows(res["sim"], res["live"], config_of(res)), res


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        r = measure(float(sys.argv[1]) if len(sys.argv) > 1 else 60.0, Path(t))
        print(json.dumps({k: r[k] for k in ("live", "sim", "model")}, indent=2, default=str))
