"""Part (c): ``examples/gpt.py`` on the GPU: samples/s under ``tidal run`` (1 worker, the
default ``--comm``) against the same model and batch in plain DDP under ``torchrun`` (1
process, ``scripts/gpt_ddp.py``), measured alike from the step starts (``hooks``)."""

from __future__ import annotations

from pathlib import Path

from bench.common import TORCHRUN_ENV, median, row, tidal_cmd, torchrun_cmd
from bench.gpu.harness import (
    GPT,
    GPT_PEER,
    HOOKS,
    Ctx,
    Part,
    PartFailed,
    job_logs,
    tail,
    tidal_status,
)

TITLE = "examples/gpt.py: tidal run against torchrun DDP, samples/s"
STEPS = {"cuda": (300, 150), "cpu": (100, 40)}  # (steps, with --quick)


def step_records(directory: Path) -> list[tuple[float, int, str, str, int]]:
    """(time, step, generation, backend, device bytes) of every step start, by time."""
    found = []
    for path in directory.glob("steps-*.txt"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 6 and parts[0] == "B":
                found.append((float(parts[1]), int(parts[2]), parts[3], parts[4], int(parts[5])))
    return sorted(found)


def samples_per_s(recs: list, batch: int) -> float:
    """The global batch over the median time between consecutive step starts, past the
    first fifth (start-up, compilation of kernels, the first evaluation)."""
    recs = recs[len(recs) // 5 :]
    gaps = [
        b[0] - a[0]
        for a, b in zip(recs, recs[1:], strict=False)
        if b[1] == a[1] + 1 and a[2] == b[2]
    ]
    if len(gaps) < 3:
        raise PartFailed(f"too few consecutive steps recorded ({len(recs)})")
    return batch / median(gaps)


def run(ctx: Ctx, part: Part) -> None:
    full, quick = STEPS[ctx.device]
    steps = quick if ctx.quick else full
    args = ctx.gpt_args(steps)
    batch = (
        int(args[args.index("--global-batch-size") + 1]) if "--global-batch-size" in args else 32
    )
    expected = "nccl" if ctx.cuda else "gloo"

    home, name, tidal_out = part.dir / "home", "gpt", part.dir / "tidal-steps"
    env = ctx.env(gpus=1, hooks=HOOKS)
    env["TIDAL_BENCH_GPU_STEPS"] = str(tidal_out)
    rc, tidal_s = part.run(
        tidal_cmd(home, name, "--workers", "1") + [str(GPT), *args],
        "tidal-run.log",
        env,
        "examples/gpt.py under tidal run",
    )
    status = tidal_status(home, name)
    part.check(
        "examples/gpt.py under `tidal run` succeeded",
        rc == 0 and status["state"] == "succeeded",
        f"exit {rc}, state {status['state']}\n{tail(part.dir / 'tidal-run.log', 5)}\n"
        f"{job_logs(home, name, 20)}",
    )
    recs = step_records(tidal_out)
    backends = sorted({r[3] for r in recs})
    part.check(
        f"Tidal's steps ran over {expected} (the default --comm)",
        backends == [expected],
        str(backends),
    )
    if ctx.cuda:
        part.check("Tidal's worker held its tensors on the GPU", max(r[4] for r in recs) > 0)
    tidal = samples_per_s(recs, batch)

    peer_out = part.dir / "peer-steps"
    cmd = torchrun_cmd("--standalone", "--nproc-per-node=1", str(GPT_PEER), *args)
    cmd += ["--out", str(peer_out)]
    rc, peer_s = part.run(cmd, "torchrun.log", {**ctx.env(gpus=1), **TORCHRUN_ENV}, "torchrun DDP")
    part.check("the DDP peer under torchrun succeeded", rc == 0, tail(part.dir / "torchrun.log"))
    peer_recs = step_records(peer_out)
    peer = samples_per_s(peer_recs, batch)
    r = row("gpu_gpt_samples_per_s", tidal, peer, "samples/s", higher_is_better=True)
    part.numbers.update(
        tidal_samples_per_s=round(tidal, 1),
        peer_samples_per_s=round(peer, 1),
        ratio=round(r["ratio"], 3),
        steps=steps,
        global_batch=batch,
        tidal_backend=backends[0],
        peer_backend=sorted({x[3] for x in peer_recs}),
        tidal_wall_s=round(tidal_s, 1),
        peer_wall_s=round(peer_s, 1),
    )
    part.rows = [r]
