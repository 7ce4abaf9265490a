"""Where the CPU goes in a steady job, Tidal against the peer, thread by thread.

``python -m bench.cpu_split [--world 2] [--steps 900] [--runs 2] [--json FILE]``

Each run starts one job of each tool, in turn (the order swapped every run), with the
training of ``bench.throughput`` (``bench/train_mlp.py``: the same model, data and global
batch). Between rank 0's step at 20% of the run and its step at 90%, it reads every
thread's CPU time (``/proc/PID/task/TID/stat``: user and kernel) of every process the
measurement started, and reports, in % of one core:

- ``training``: the workers' main threads (forward, backward, update, and, in Tidal, the
  elastic loop's own Python);
- ``worker_other``: the workers' other threads (gloo's, and Tidal's heartbeat and abort
  watch);
- ``beside``: the processes beside the workers (torchrun's agent; Tidal's CLI, host and
  coordinator);

and the step's two phases from the records of every worker: ``to_sync_ms`` (a step's start
to its gradients' synchronisation) and ``after_sync_ms`` (from there to the next step's
start: the update and the loop). A per-step tax shows here as CPU (a thread at work) or as
a longer phase (a wait), each tool against its own steps, without the throughput row's
spread between runs a minute apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Procs, log, read_records, wait_until
from bench.throughput import start_peer, start_tidal

TICK = os.sysconf("SC_CLK_TCK")


def cpu_by_thread(pids: list[int]) -> dict[tuple[int, int], float]:
    """CPU-seconds so far of every thread of ``pids``, by (pid, tid)."""
    found = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            found[(pid, int(tid))] = (int(fields[11]) + int(fields[12])) / TICK
    return found


def split(
    before: dict[tuple[int, int], float],
    after: dict[tuple[int, int], float],
    workers: set[int],
    seconds: float,
) -> dict[str, float]:
    """% of one core used between two readings, by part (module doc); a thread seen only
    in the second reading counts from zero."""
    parts = {"training": 0.0, "worker_other": 0.0, "beside": 0.0}
    for (pid, tid), cpu in after.items():
        used = cpu - before.get((pid, tid), 0.0)
        if pid not in workers:
            parts["beside"] += used
        elif tid == pid:
            parts["training"] += used
        else:
            parts["worker_other"] += used
    return {k: round(100 * v / seconds, 2) for k, v in parts.items()}


def phases(out: Path, first: int, last: int) -> dict[str, float]:
    """Median of each step phase (ms) over steps ``first``..``last`` of every worker."""
    marks: dict[tuple[int, int], dict[str, float]] = {}
    for r in read_records(out):
        if first <= r.index <= last + 1:
            marks.setdefault((r.pid, r.index), {})[r.kind] = r.time
    to_sync, after_sync = [], []
    for (pid, index), m in marks.items():
        if index > last:
            continue
        if "B" in m and "E" in m:
            to_sync.append(m["E"] - m["B"])
        nxt = marks.get((pid, index + 1), {})
        if "E" in m and "B" in nxt:
            after_sync.append(nxt["B"] - m["E"])
    return {
        "to_sync_ms": round(1000 * statistics.median(to_sync), 2),
        "after_sync_ms": round(1000 * statistics.median(after_sync), 2),
    }


def rank0_step(out: Path) -> int:
    steps = [r.index for r in read_records(out) if r.rank == 0 and r.kind == "E"]
    return max(steps, default=-1)


def measure_one(start, world: int, steps: int, tmp: Path) -> dict:  # noqa: ANN001
    first, last = steps // 5, steps * 9 // 10
    procs = Procs()
    try:
        proc, out = start(procs, world, steps, tmp)

        def reached(step: int):  # noqa: ANN202
            if proc.poll() is not None:
                raise RuntimeError(f"the job exited {proc.returncode} early; see {tmp}")
            return rank0_step(out) >= step

        wait_until(lambda: reached(first), 300, f"step {first}", interval=0.02)
        t0, before = time.monotonic(), cpu_by_thread(procs.marked())
        wait_until(lambda: reached(last), 300, f"step {last}", interval=0.02)
        t1, after = time.monotonic(), cpu_by_thread(procs.marked())
        workers = {int(p.stem.split("-")[1]) for p in out.glob("steps-*.txt")}
        if proc.wait(timeout=300) != 0:
            raise RuntimeError(f"the job exited {proc.returncode}; see {tmp}")
    finally:
        procs.cleanup()
    parts = split(before, after, workers, t1 - t0)
    return parts | {"total": round(sum(parts.values()), 2)} | phases(out, first, last)


def measure(world: int, steps: int, runs: int, tmp: Path) -> dict:
    found: dict[str, list[dict]] = {"tidal": [], "peer": []}
    for run in range(runs):
        for tool in ("tidal", "peer") if run % 2 == 0 else ("peer", "tidal"):
            d = tmp / f"run{run}-{tool}"
            d.mkdir(parents=True)
            start = start_tidal if tool == "tidal" else start_peer
            found[tool].append(measure_one(start, world, steps, d))
            log(f"cpu_split ws{world} run {run} {tool}: {found[tool][-1]}")
    return {
        tool: {k: statistics.median(r[k] for r in rs) for k in rs[0]} | {"runs": rs}
        for tool, rs in found.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if args.world < 1 or args.steps < 50 or args.runs < 1:
        p.error("--world >= 1, --steps >= 50 and --runs >= 1")
    with tempfile.TemporaryDirectory(prefix="tidal-cpu-split-") as t:
        res = measure(args.world, args.steps, args.runs, Path(t))
    print(f"{'':14s} {'Tidal':>9s} {'peer':>9s}   (medians of {args.runs} runs)")
    for key in ("training", "worker_other", "beside", "total", "to_sync_ms", "after_sync_ms"):
        unit = "ms" if key.endswith("_ms") else "% core"
        print(f"{key:14s} {res['tidal'][key]:9.2f} {res['peer'][key]:9.2f}   {unit}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
