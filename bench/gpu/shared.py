"""Part (a): two workers sharing one GPU over gloo with CUDA tensors (``tidal run --comm
gloo --share-gpus``): 2 -> 3 -> 1 workers (``--schedule``) with a SIGKILL inside a gradient
all-reduce at 3; every finishing member's final parameters against the one-worker
reference, relative L2 within ``--rel-bound``."""

from __future__ import annotations

from bench.gpu.harness import Ctx, Part, formed, gens_summary
from bench.gpu.mlp import check_members, finished, reference, train_job

TITLE = "two workers sharing one GPU over gloo: 2 -> 3 -> 1, a SIGKILL, invariance"
SCHEDULE = "20:3,60:1"  # 2 -> 3 at step 20, a kill at 40 (3 -> 2), -> 1 at 60
KILL = "sigkill@worker=1,step=40,phase=allreduce"  # parts a and d


def run(ctx: Ctx, part: Part) -> None:
    ref = reference(ctx, part)
    name = "shared"
    opts = ["--workers", "2", "--max-workers", "3", "--max-restarts", "0"]
    opts += ["--schedule", SCHEDULE, *ctx.comm("gloo"), *ctx.share_gpus()]
    rc, secs, home, out = train_job(
        ctx, part, name, opts, faults=KILL, gpus=1, what="the shared job (2 -> 3 -> 1)", pin=True
    )
    status = finished(part, rc, home, name, "tidal-run.log")
    sizes = [g["world_size"] for g in formed(status)]
    part.numbers.update(job_s=round(secs, 2), world_sizes=sizes, generations=gens_summary(status))
    part.check(
        "the job went 2 -> 3 -> ... -> 1",
        len(sizes) >= 3 and sizes[0] == 2 and 3 in sizes and sizes[-1] == 1,
        f"world sizes {sizes}",
    )
    killed = [g for g in status["generations"] if "SIGKILL" in g["reason"]]
    part.check("worker 1's SIGKILL opened a generation", bool(killed), str(gens_summary(status)))
    part.numbers["kill_pause_s"] = killed[0]["pause_s"]
    rels = check_members(part, out, ref, "gloo")
    part.numbers.update(rel_l2=rels, max_rel_l2=max(rels.values()), rel_bound=ctx.rel_bound)
