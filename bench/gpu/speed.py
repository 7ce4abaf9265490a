"""Part (c): ``examples/gpt.py`` on the GPU: samples/s under ``tidal run`` (1 worker, the
default ``--comm``) against the same model and batch in plain DDP under ``torchrun`` (1
process, ``scripts/gpt_ddp.py``), measured alike from the step starts (``hooks``).

Decisive in one call: the two sides run in ``PAIRS`` back-to-back pairs, the order swapped
every pair (a drift of the machine's speed favours neither), and the row's ratio is the
median of the pairs' ratios, its spread beside it (``pair_ratios``). One pair on the H200
read anywhere from 0.74 to 1.24 between calls minutes apart (docs/gpu.md).
"""

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
STEPS = {"cuda": (200, 120), "cpu": (100, 40)}  # (steps a run, with --quick)
PEER_CONFIG = (
    "torchrun --standalone --nproc-per-node=1, plain DDP (scripts/gpt_ddp.py): the same "
    "model, data and global batch, the same step-start records"
)
PAIRS = {"cuda": (6, 6), "cpu": (2, 2)}  # (pairs of runs, with --quick)


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
    pairs = PAIRS[ctx.device][1 if ctx.quick else 0]
    args = ctx.gpt_args(steps)
    batch = (
        int(args[args.index("--global-batch-size") + 1]) if "--global-batch-size" in args else 32
    )
    expected = "nccl" if ctx.cuda else "gloo"
    tidal_rates, peer_rates, walls = [], [], {"tidal": [], "peer": []}
    backends, peer_backends = set(), set()

    def run_tidal(i: int) -> float:
        home, name, out = part.dir / f"home-{i}", "gpt", part.dir / f"tidal-steps-{i}"
        env = ctx.env(gpus=1, hooks=HOOKS)
        env["TIDAL_BENCH_GPU_STEPS"] = str(out)
        log = f"tidal-run-{i}.log"
        rc, wall = part.run(
            tidal_cmd(home, name, "--workers", "1") + [str(GPT), *args], log, env,
            f"examples/gpt.py under tidal run (pair {i})",
        )  # fmt: skip
        status = tidal_status(home, name)
        part.check(
            f"examples/gpt.py under `tidal run` succeeded (pair {i})",
            rc == 0 and status["state"] == "succeeded",
            f"exit {rc}, state {status['state']}\n{tail(part.dir / log, 5)}\n"
            f"{job_logs(home, name, 20)}",
        )
        recs = step_records(out)
        backends.update(r[3] for r in recs)
        if ctx.cuda:
            part.check(
                f"Tidal's worker held its tensors on the GPU (pair {i})",
                max(r[4] for r in recs) > 0,
            )
        walls["tidal"].append(round(wall, 1))
        return samples_per_s(recs, batch)

    def run_peer(i: int) -> float:
        out, log = part.dir / f"peer-steps-{i}", f"torchrun-{i}.log"
        cmd = torchrun_cmd("--standalone", "--nproc-per-node=1", str(GPT_PEER), *args)
        cmd += ["--out", str(out)]
        env = {**ctx.env(gpus=1), **TORCHRUN_ENV}
        rc, wall = part.run(cmd, log, env, f"torchrun DDP (pair {i})")
        part.check(
            f"the DDP peer under torchrun succeeded (pair {i})", rc == 0, tail(part.dir / log)
        )
        recs = step_records(out)
        peer_backends.update(r[3] for r in recs)
        walls["peer"].append(round(wall, 1))
        return samples_per_s(recs, batch)

    for i in range(pairs):
        if i % 2 == 0:
            tidal_rates.append(run_tidal(i))
            peer_rates.append(run_peer(i))
        else:
            peer_rates.append(run_peer(i))
            tidal_rates.append(run_tidal(i))
    part.check(
        f"Tidal's steps ran over {expected} (the default --comm)",
        sorted(backends) == [expected],
        str(sorted(backends)),
    )
    ratios = [t / p for t, p in zip(tidal_rates, peer_rates, strict=True)]
    tidal, peer = median(tidal_rates), median(peer_rates)
    r = row("gpu_gpt_samples_per_s", tidal, peer, "samples/s", higher_is_better=True,
            peer_name="torchrun", peer_config=PEER_CONFIG)  # fmt: skip
    r["ratio"] = median(ratios)  # the pairs' median: each pair shares its minute of the machine
    part.numbers.update(
        tidal_samples_per_s=round(tidal, 1),
        peer_samples_per_s=round(peer, 1),
        ratio=round(r["ratio"], 3),
        pair_ratios=[round(x, 3) for x in ratios],
        ratio_spread=[round(min(ratios), 3), round(max(ratios), 3)],
        pairs=pairs,
        steps=steps,
        global_batch=batch,
        tidal_backend=sorted(backends)[0],
        peer_backend=sorted(peer_backends),
        tidal_wall_s=walls["tidal"],
        peer_wall_s=walls["peer"],
    )
    part.rows = [r]
