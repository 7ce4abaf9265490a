"""``tidal simulate``: replay a capacity trace through the scaling policies (no job runs).

    tidal simulate --trace examples/traces/spot.csv --policy cost --deadline 3h
    tidal simulate --trace examples/traces/spot.csv --compare [--json]
    tidal simulate --trace examples/traces/spot.csv --policy oracle --deadline 3h

Bad input raises ``ValueError``; ``tidal.cli.main`` prints it as one ``tidal: error:`` line.
"""

from __future__ import annotations

import argparse
import json
import math

from tidal.policy.inputs import PolicyParams, parse_duration
from tidal.policy.registry import known_policies
from tidal.sim.compare import compare, oracle, with_vs_oracle
from tidal.sim.job import DEFAULT_JOB, PRESETS, JobModel, get_job
from tidal.sim.simulate import STATIC_ALIASES, SimConfig, SimResult, simulate
from tidal.sim.trace import load_trace


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``simulate`` on the ``tidal`` subparsers."""
    sim = sub.add_parser(
        "simulate",
        help="replay a capacity trace through a scaling policy against a job model",
        description=(
            "Replay a capacity trace (CSV: time_s,capacity,price_per_worker_hour) through "
            "a scaling policy against a model of a data-parallel job; print completion "
            "time, cost, $/sample and worker-hours."
        ),
    )
    sim.add_argument("--trace", metavar="FILE", help="capacity trace (CSV), required")
    what = sim.add_mutually_exclusive_group()
    names = ", ".join([*known_policies(), *STATIC_ALIASES, "oracle"])
    what.add_argument("--policy", metavar="NAME", help=f"one of: {names}")
    what.add_argument(
        "--compare",
        action="store_true",
        help="every policy, static allocations at --workers-min and --workers-max, and the "
        "oracle (the cheapest schedule by the same deadline)",
    )
    sim.add_argument("--job", default=DEFAULT_JOB, help=f"job preset (default {DEFAULT_JOB})")
    sim.add_argument("--list-jobs", action="store_true", help="print the job presets and exit")
    sim.add_argument("--workers-min", type=int, default=1, metavar="N", help="default 1")
    sim.add_argument(
        "--workers-max", type=int, metavar="N", help="default: the trace's largest capacity"
    )
    sim.add_argument("--workers", type=int, metavar="N", help="initial target (default min)")
    sim.add_argument(
        "--start", metavar="DURATION", help="start the job this far into the trace (default 0)"
    )
    sim.add_argument("--deadline", metavar="DURATION", help="cost policy: e.g. 3h, 90m, 5400")
    sim.add_argument("--budget", type=float, metavar="DOLLARS", help="cost policy: job budget")
    sim.add_argument("--min-efficiency", type=float, default=0.7, help="default 0.7")
    sim.add_argument("--cooldown", type=float, default=30.0, metavar="S", help="default 30 s")
    job = sim.add_argument_group("job model (override the preset)")
    job.add_argument("--sample-time", type=float, metavar="S", help="compute s per sample")
    job.add_argument("--grad-bytes", type=float, metavar="B", help="gradient bytes per step")
    job.add_argument("--bandwidth-gbit", type=float, metavar="G", help="Gbit/s per worker")
    job.add_argument("--latency-ms", type=float, metavar="MS", help="all-reduce latency")
    job.add_argument("--pause", type=float, metavar="S", help="rescale pause in seconds")
    job.add_argument("--global-batch", type=int, metavar="N", help="samples per step")
    job.add_argument("--steps", type=int, metavar="N", help="total steps")
    job.add_argument(
        "--startup", type=float, metavar="S", help="seconds from the job's start to its first step"
    )
    job.add_argument(
        "--step-s",
        metavar="N=S,...",
        help="measured seconds per step at these world sizes (e.g. 1=0.031,2=0.044): they "
        "replace the formula at those sizes",
    )
    sim.add_argument("--json", action="store_true", help="a JSON list of results")
    sim.set_defaults(fn=cmd_simulate)
    return sim


def _job(args: argparse.Namespace) -> JobModel:
    base = get_job(args.job)

    def scaled(value: float | None, factor: float) -> float | None:
        return None if value is None else value * factor

    return base.with_overrides(
        compute_s_per_sample=args.sample_time,
        grad_bytes=args.grad_bytes,
        bandwidth_bytes_s=scaled(args.bandwidth_gbit, 1e9 / 8),
        latency_s=scaled(args.latency_ms, 1e-3),
        rescale_pause_s=args.pause,
        global_batch=args.global_batch,
        total_steps=args.steps,
        startup_s=args.startup,
        measured_step_s=parse_step_s(args.step_s) if args.step_s else None,
    )


def parse_step_s(text: str) -> tuple[tuple[int, float], ...]:
    """``"1=0.031,2=0.044"`` -> ``((1, 0.031), (2, 0.044))``; a ValueError naming the bad
    item otherwise."""
    out: dict[int, float] = {}
    for item in text.split(","):
        n, sep, s = item.strip().partition("=")
        try:
            if not sep:
                raise ValueError
            size, seconds = int(n), float(s)
        except ValueError:
            raise ValueError(f"--step-s: expected N=SECONDS, got {item.strip()!r}") from None
        out[size] = seconds
    return tuple(sorted(out.items()))


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.list_jobs:
        _print_jobs()
        return 0
    if not args.trace:
        raise ValueError("simulate needs --trace FILE (e.g. examples/traces/spot.csv)")
    if args.policy is None and not args.compare:
        raise ValueError("simulate needs --policy NAME or --compare")
    names = sorted([*known_policies(), *STATIC_ALIASES, "oracle"])
    if args.policy is not None and args.policy not in names:
        raise ValueError(f"unknown policy {args.policy!r}; known policies: {', '.join(names)}")
    trace = load_trace(args.trace)
    job = _job(args)
    workers_max = args.workers_max if args.workers_max is not None else trace.max_capacity
    if workers_max < 1:
        raise ValueError(f"{args.trace}: the trace never has capacity: give --workers-max")
    params = PolicyParams(
        min_efficiency=args.min_efficiency,
        cooldown_s=args.cooldown,
        deadline_s=parse_duration(args.deadline) if args.deadline else None,
        budget=args.budget,
    )
    config = SimConfig(
        workers_min=args.workers_min,
        workers_max=workers_max,
        workers=args.workers,
        params=params,
        start_s=_duration_or_zero(args.start),
    )
    if args.compare:
        results = compare(job, trace, config)
    elif args.policy == "oracle":
        best = oracle(job, trace, config)
        if best is None:
            raise ValueError(
                f"no schedule finishes within the deadline {_hours(params.deadline_s)} on "
                f"{args.trace}: give a later --deadline"
            )
        results = with_vs_oracle([best])
    else:
        results = [simulate(job, trace, args.policy, config)]
    if args.json:
        print(json.dumps([_row(r, job, args.trace) for r in results], indent=2))
    else:
        _print(results, job, args.trace, workers_max)
    return 0


def _duration_or_zero(text: str | None) -> float:
    if text is None or text.strip() in ("0", "0s"):
        return 0.0
    return parse_duration(text)


def _row(r: SimResult, job: JobModel, trace: str) -> dict:
    return {**r.to_dict(), "job": job.name, "trace": trace}


def _hours(s: float | None) -> str:
    return "unfinished" if s is None else f"{s / 3600:,.2f} h"


def _short_hours(s: float | None) -> str:
    if s is None:
        return "-"
    h = s / 3600
    return f"{h:,.2f}h" if h < 10 else f"{h:,.1f}h" if h < 100 else f"{h:,.0f}h"


def _money(x: float) -> str:
    """Dollars in at most 7 characters: $262.68, $1,744, $17.4k, $934k, $1.34M."""
    if x < 1000:
        return f"${x:,.2f}"
    if x < 10_000:
        return f"${x:,.0f}"
    if x < 100_000:
        return f"${x / 1e3:,.1f}k"
    if x < 1e6:
        return f"${x / 1e3:,.0f}k"
    return f"${x / 1e6:,.2f}M"


def _count(x: float, digits: int = 1) -> str:
    """At most 5 characters: 26.7, 282.3, 1.2k, 965k, 1.2M."""
    if x < 1000:
        return f"{x:,.{digits}f}"
    if x < 10_000:
        return f"{x / 1e3:,.1f}k"
    if x < 1e6:
        return f"{x / 1e3:,.0f}k"
    return f"{x / 1e6:,.1f}M"


def _print(results: list[SimResult], job: JobModel, trace: str, workers_max: int) -> None:
    """The table fits 80 columns: short headers and abbreviated units, the policy names
    never cut, the long values (job, trace path, limits, the oracle's bound) below it."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"[bold]{job.name}[/]: {job.description or 'custom job'}")
    console.print(
        f"{job.total_steps:,} steps of {job.global_batch:,} samples; up to {workers_max} "
        f"workers; trace:"
    )
    console.print(trace, overflow="fold", soft_wrap=False)
    base = next((r for r in results if r.policy == "static-max"), None)
    ref = next((r for r in results if r.policy == "oracle"), None)
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    width = max(len(r.policy) for r in results)
    table.add_column("policy", no_wrap=True, min_width=width)
    cols = ["time", "cost", "$/M", "wk-h", "resc"]
    if ref is not None:
        cols.append("vs or")
    if base is not None:
        cols += ["Δ$/s", "Δtime"]
    for col in cols:  # numbers fold rather than being cut, should a value be wider
        table.add_column(col, justify="right", overflow="fold")
    for r in results:
        row = [
            r.policy,
            _short_hours(r.completion_s),
            _money(r.cost),
            "-" if r.cost_per_sample is None else f"${r.cost_per_sample * 1e6:,.2f}",
            _count(r.worker_hours),
            _count(r.rescales, 0),
        ]
        if ref is not None:
            row.append("-" if r.vs_oracle is None else f"{r.vs_oracle:.2f}x")
        if base is not None:
            row += [
                _ratio(r.cost_per_sample, base.cost_per_sample),
                _ratio(r.completion_s, base.completion_s),
            ]
        table.add_row(*row)
    console.print(table)
    for r in results:
        if r.deadline_s is not None or r.budget is not None:
            limits = [f"deadline {_hours(r.deadline_s)}" if r.deadline_s else ""]
            limits.append(f"budget ${r.budget:,.2f}" if r.budget else "")
            console.print(f"{r.policy}: {', '.join(x for x in limits if x)}")
    if ref is not None and ref.oracle is not None:
        bound = ref.oracle.get("lower_bound")
        gap = f", {ref.cost / bound - 1:.2%} above its lower bound" if bound else ""
        console.print(
            f"oracle: the cheapest schedule by the deadline ({ref.oracle['method']}, "
            f"{ref.oracle['slots']:,} slots{gap})"
        )
    console.print(
        "time: to finish; $/M: dollars per million samples; wk-h: worker-hours; resc: "
        "rescales"
        + ("; vs or: $/sample over the oracle's" if ref is not None else "")
        + ("; Δ: against static-max" if base is not None else "")
    )


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0 or not math.isfinite(a / b):
        return "-"
    change = a / b - 1
    return f"{change:+.1%}" if abs(change) < 1 else f"{change:+.0%}"


def _print_jobs() -> None:
    for name, j in sorted(PRESETS.items()):
        print(
            f"{name}: {j.description}; {1 / j.compute_s_per_sample:,.0f} samples/s on one "
            f"worker, {j.grad_bytes / 1e6:,.1f} MB gradients, "
            f"{j.bandwidth_bytes_s * 8 / 1e9:g} Gbit/s, latency {j.latency_s * 1e3:g} ms, "
            f"pause {j.rescale_pause_s:g} s, batch {j.global_batch}, {j.total_steps:,} steps"
        )
