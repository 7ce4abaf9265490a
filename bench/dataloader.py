"""Input pipelines with DataLoader workers: ``bench/train_loader.py`` (the bench MLP fed by
a dataset of ~2 ms of CPU per sample) under ``tidal run --workers 2`` with
``Trainer(num_workers=N)`` and under ``torchrun --nproc-per-node 2`` with a plain
``DataLoader(num_workers=N)``, for N = 1 and 0. Samples/s from rank 0's step records, as in
``throughput``; best of ``reps`` alternated repetitions.

``python -m bench.dataloader [STEPS]`` runs it alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.common import (
    ROOT,
    TORCHRUN_ENV,
    Procs,
    ends,
    log,
    median_step,
    read_records,
    tidal_cmd,
    torchrun_cmd,
)

SCRIPT = ROOT / "bench" / "train_loader.py"
GLOBAL_BATCH = 64
WORLD = 2


def samples_per_s(directory: Path) -> float:
    """Global batch over the median time between rank 0's consecutive step ends, past the
    first fifth of the run (the loader's start-up and first prefetch)."""
    recs = [r for r in ends(read_records(directory)) if r.rank == 0 and r.world == WORLD]
    recs = recs[len(recs) // 5 :]
    if len(recs) < 3:
        raise RuntimeError(f"too few step records in {directory}")
    return GLOBAL_BATCH / median_step(recs, WORLD)


def script_args(steps: int, workers: int, out: Path, mode: str) -> list[str]:
    return [str(SCRIPT), "--mode", mode, "--steps", str(steps), "--out", str(out)] + [
        *("--num-workers", str(workers), "--global-batch-size", str(GLOBAL_BATCH))
    ]


def run_one(tool: str, workers: int, steps: int, tmp: Path, timeout: float) -> float:
    name = f"{tool}-nw{workers}"
    out = tmp / name
    procs = Procs()
    try:
        if tool == "tidal":
            cmd = tidal_cmd(tmp / "home", f"loader-nw{workers}", "--workers", str(WORLD))
            proc = procs.start(cmd + script_args(steps, workers, out, "tidal"), tmp / f"{name}.log")
        else:
            cmd = torchrun_cmd("--standalone", f"--nproc-per-node={WORLD}")
            env = TORCHRUN_ENV
            proc = procs.start(
                cmd + script_args(steps, workers, out, "ddp"), tmp / f"{name}.log", env
            )
        if proc.wait(timeout=timeout) != 0:
            raise RuntimeError(f"{tool} exited {proc.returncode}; see {tmp / name}.log")
    finally:
        procs.cleanup()
    return samples_per_s(out)


def measure(steps: int, tmp: Path, reps: int = 1, timeout: float = 300) -> dict:
    """samples/s of each (tool, num_workers), best of ``reps`` (the order of the two tools
    alternating): the other engineers' load on the machine only ever slows a run down."""
    runs: dict[str, list[float]] = {}
    for rep in range(reps):
        d = tmp / f"rep{rep}"
        d.mkdir(parents=True, exist_ok=True)
        for workers in (1, 0):
            tools = ("tidal", "torchrun") if rep % 2 == 0 else ("torchrun", "tidal")
            for tool in tools:  # alternated: neither always runs first
                key = f"{tool}_nw{workers}"
                runs.setdefault(key, []).append(run_one(tool, workers, steps, d, timeout))
                log(f"dataloader {key} rep {rep}: {runs[key][-1]:.0f} samples/s")
    best = {k: max(v) for k, v in runs.items()}
    return {**best, "all": runs, "steps": steps, "world": WORLD, "global_batch": GLOBAL_BATCH}


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        print(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 100, Path(t)))
