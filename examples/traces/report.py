"""Print the tables of docs/policies.md: every policy on every trace of the set.

    python examples/traces/report.py            # the set, the default job (tidal simulate
                                                # --compare on each trace)
    python examples/traces/report.py --sweep    # and the robustness sweep: every preset,
                                                # the job starting at 5 points of the week

Deterministic: the same tables every run.
"""

from __future__ import annotations

import itertools
import sys
from multiprocessing import Pool
from pathlib import Path

from tidal.sim import DEFAULT_JOB, SimConfig, compare, get_job, load_trace

HERE = Path(__file__).resolve().parent
SET = ("spot", "diurnal", "price-steps", "cheap-then-dear", "spikes", "scarcity", "flat", "outage")
JOBS = ("resnet50-v100", "resnet50-v100-fp32", "tinyllama-1.1b-a100", "llama2-7b-a100")
STARTS_H = (0, 9, 38, 75, 132)  # Monday 00:00, Monday 09:00, Tuesday 14:00, ...


def run(name: str, job: str = DEFAULT_JOB, start_h: float = 0.0) -> dict:
    trace = load_trace(HERE / f"{name}.csv")
    config = SimConfig(workers_max=trace.max_capacity, start_s=start_h * 3600)
    return {r.policy: r for r in compare(get_job(job), trace, config)}


def _ratio(r) -> str:
    return "-" if r.vs_oracle is None else f"{r.vs_oracle:.3f}"


def main_table() -> list[str]:
    out = [
        "| trace | static-min | static-max | throughput | cost | oracle $/M | cost: deadline met,"
        " vs static-max | oracle's gap to its bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in SET:
        rows = run(name)
        best, top, ref = rows["cost"], rows["static-max"], rows["oracle"]
        met = best.completed and best.completion_s <= best.deadline_s
        gap = ref.cost / ref.oracle["lower_bound"] - 1
        out.append(
            f"| {name} | {_ratio(rows['static-min'])} | {_ratio(top)} | "
            f"{_ratio(rows['throughput'])} | **{_ratio(best)}** | "
            f"${ref.cost_per_sample * 1e6:.3f} | {'yes' if met else 'NO'}, "
            f"{best.cost_per_sample / top.cost_per_sample - 1:+.1%} | {gap:.2%} |"
        )
    return out


def _sweep_one(args: tuple[str, str, float]) -> tuple[str, str, float, float, float, bool, bool]:
    job, name, start = args
    rows = run(name, job, start)
    best, top = rows["cost"], rows["static-max"]
    met = best.completed and best.completion_s <= best.deadline_s
    above = best.cost_per_sample > top.cost_per_sample
    return job, name, start, best.vs_oracle or float("inf"), top.vs_oracle, met, above


def sweep_table() -> list[str]:
    cases = list(itertools.product(JOBS, SET, STARTS_H))
    with Pool(2) as pool:
        results = pool.map(_sweep_one, cases)
    out = [
        "| job | trace | cost vs oracle, worst of 5 starts | static-max vs oracle, worst |"
        " deadline missed at | above static-max at |",
        "|---|---|---|---|---|---|",
    ]
    for job, name in itertools.product(JOBS, SET):
        mine = [r for r in results if r[0] == job and r[1] == name]
        worst = max(r[3] for r in mine)
        top = max(r[4] for r in mine)
        missed = ", ".join(f"{r[2]:g} h" for r in mine if not r[5]) or "-"
        above = ", ".join(f"{r[2]:g} h" for r in mine if r[6]) or "-"
        mark = "**" if worst > 1.10 else ""
        out.append(f"| {job} | {name} | {mark}{worst:.3f}{mark} | {top:.3f} | {missed} | {above} |")
    return out


if __name__ == "__main__":
    print("\n".join(main_table()))
    if "--sweep" in sys.argv[1:]:
        print()
        print("\n".join(sweep_table()))
