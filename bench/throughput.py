"""Steady-state throughput: the same MLP, data and global batch under torchrun (plain DDP)
and under ``tidal run``, at one world size. Wall-clock samples/s over a fixed window of
steps (the first fifth of the steps is skipped, every later step counted:
``bench.rows.wall_clock_rate``), with the median step beside it, from rank 0's step
records."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from subprocess import Popen

from bench.common import (
    TORCHRUN_ENV,
    TRAIN,
    Procs,
    log,
    read_records,
    tidal_cmd,
    torchrun_cmd,
)
from bench.rows import wall_clock_rate

GLOBAL_BATCH = 64


def samples_per_s(directory: Path, world: int) -> dict:
    """``wall_clock_rate`` of rank 0's records in ``directory``: every step of the window
    counts (a slow step is the tool's as much as a fast one), the median step kept beside."""
    try:
        return wall_clock_rate(read_records(directory), world, GLOBAL_BATCH)
    except ValueError as exc:
        raise RuntimeError(f"{exc} in {directory}") from None


def start_peer(procs: Procs, world: int, steps: int, tmp: Path) -> tuple[Popen, Path]:
    """Start plain DDP under torchrun at ``world`` workers; (its process, its records)."""
    out = tmp / f"peer-ws{world}"
    proc = procs.start(
        torchrun_cmd(
            "--standalone",
            f"--nproc-per-node={world}",
            str(TRAIN),
            *("--mode", "ddp", "--steps", str(steps), "--out", str(out)),
            *("--global-batch-size", str(GLOBAL_BATCH)),
        ),
        tmp / f"peer-ws{world}.log",
        TORCHRUN_ENV,
    )
    return proc, out


def start_tidal(procs: Procs, world: int, steps: int, tmp: Path) -> tuple[Popen, Path]:
    """Start the same training under ``tidal run`` at ``world`` workers."""
    out = tmp / f"tidal-ws{world}"
    proc = procs.start(
        tidal_cmd(tmp / "home", f"tput-ws{world}", "--workers", str(world))
        + [str(TRAIN), "--mode", "tidal", "--steps", str(steps), "--out", str(out)]
        + ["--global-batch-size", str(GLOBAL_BATCH)],
        tmp / f"tidal-ws{world}.log",
    )
    return proc, out


def _run(start, tool: str, world: int, steps: int, tmp: Path, timeout: float) -> dict:  # noqa: ANN001
    procs = Procs()
    try:
        proc, out = start(procs, world, steps, tmp)
        if proc.wait(timeout=timeout) != 0:
            raise RuntimeError(f"{tool} exited {proc.returncode}; see {tmp}")
    finally:
        procs.cleanup()
    return samples_per_s(out, world)


def run_peer(world: int, steps: int, tmp: Path, timeout: float) -> dict:
    return _run(start_peer, "torchrun", world, steps, tmp, timeout)


def run_tidal(world: int, steps: int, tmp: Path, timeout: float) -> dict:
    return _run(start_tidal, "tidal run", world, steps, tmp, timeout)


def measure(world: int, steps: int, tmp: Path, reps: int = 1, timeout: float = 300) -> dict:
    """Run Tidal and the peer ``reps`` times each, in pairs back to back, the order swapped
    every pair (Tidal first, then the peer first: a drift of the machine's speed during the
    measurement favours neither); each tool's rate is the median of its runs. Not the best
    of each: on this shared VM one run of either tool moves by 10 to 25% between two runs a
    minute apart, and the best of a few picks whichever tool drew the quietest minute."""
    tidal, peer = [], []
    for rep in range(reps):
        d = tmp / f"rep{rep}"
        d.mkdir(parents=True, exist_ok=True)
        for which in ("tidal", "peer") if rep % 2 == 0 else ("peer", "tidal"):
            if which == "tidal":
                tidal.append(run_tidal(world, steps, d, timeout))
            else:
                peer.append(run_peer(world, steps, d, timeout))
        log(
            f"throughput ws{world} rep {rep}: tidal {tidal[-1]['samples_per_s']:.0f}, ddp "
            f"{peer[-1]['samples_per_s']:.0f} samples/s (wall clock)"
        )
    rate = [t["samples_per_s"] for t in tidal], [p["samples_per_s"] for p in peer]
    step = [t["median_step_s"] for t in tidal], [p["median_step_s"] for p in peer]
    return {
        "tidal": statistics.median(rate[0]),
        "peer": statistics.median(rate[1]),
        "tidal_step_s": statistics.median(step[0]),
        "peer_step_s": statistics.median(step[1]),
        "tidal_all": rate[0],
        "peer_all": rate[1],
        "tidal_step_all": step[0],
        "peer_step_all": step[1],
        "windows": {"tidal": tidal, "peer": peer},
        "pair_ratios": [t / p for t, p in zip(*rate, strict=True)],
    }


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        print(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 1, 100, Path(t)))
