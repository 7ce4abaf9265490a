"""Part (d), with two GPUs or more: NCCL at world size 2, one worker SIGKILLed inside the
all-reduce; the survivor's collective must fail in a bounded time and train on alone to the
reference's parameters."""

from __future__ import annotations

from bench.gpu.harness import COLLECTIVE_TIMEOUT_S, REFORM_BOUND_S, Ctx, Part, formed, gens_summary
from bench.gpu.mlp import check_members, finished, reference, train_job
from bench.gpu.shared import KILL

TITLE = "NCCL at world size 2: a SIGKILL in the all-reduce"


def run(ctx: Ctx, part: Part) -> None:
    ref = reference(ctx, part)
    name = "nccl2"
    opts = ["--workers", "2", "--max-restarts", "0", "--collective-timeout", COLLECTIVE_TIMEOUT_S]
    rc, secs, home, out = train_job(
        ctx,
        part,
        name,
        opts + ctx.comm("nccl"),
        faults=KILL,
        gpus=2,
        what="the NCCL job at world size 2 (a SIGKILL in the all-reduce)",
    )
    status = finished(part, rc, home, name, "tidal-run.log")
    sizes = [g["world_size"] for g in formed(status)]
    killed = [g for g in formed(status) if "SIGKILL" in g["reason"]]
    part.numbers.update(job_s=round(secs, 2), world_sizes=sizes, generations=gens_summary(status))
    part.check(
        "the job went 2 -> 1 after the SIGKILL", sizes == [2, 1] and bool(killed), str(sizes)
    )
    pause = killed[0]["pause_s"]
    part.numbers["kill_pause_s"] = pause
    part.check(
        f"the survivor's collective failed and it trained on within {REFORM_BOUND_S:.0f} s",
        pause is not None and pause < REFORM_BOUND_S,
        f"pause_s {pause}",
    )
    rels = check_members(part, out, ref, "nccl" if ctx.cuda else "gloo")
    part.numbers.update(rel_l2=rels, max_rel_l2=max(rels.values()))
