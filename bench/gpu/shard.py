"""Part (f): ``sharding="fsdp"`` on the check's device, one worker (over NCCL on a GPU).

The MLP job of parts a, b and d under ``Trainer(sharding="fsdp")``, checkpointing every 20
steps: a ``raise`` in the step's collective must re-form the group (FSDP2 skips the
reduce-scatter of a one-member group and copies the gradients, so the fault goes into the
step's control all-reduce, the one collective a one-member sharded step runs), then a SIGKILL
loses the job. Its home is copied, and ``tidal resume`` continues from the newest sharded
checkpoint twice, once in each home: at the same sharding, and at the other (``ddp``, which
loads the sharded checkpoint as whole tensors). Both must end with the one-process
reference's parameters within the float32 bound.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.gpu.harness import (
    Ctx,
    Part,
    formed,
    gens_summary,
    tail,
)
from bench.gpu.mlp import check_members, finished, reference
from bench.gpu.reform import RESUMING, first_run, resume_cmd

TITLE = "sharding='fsdp', one worker: a failed collective re-forms, resume at fsdp and at ddp"


def layout(checkpoint: dict) -> str | None:
    """The layout its manifest names (``sharded`` for an FSDP job's)."""
    manifest = Path(checkpoint["path"]) / "MANIFEST.json"
    try:
        return json.loads(manifest.read_text()).get("layout")
    except (OSError, ValueError):
        return None


def resume(
    ctx: Ctx, part: Part, home: Path, name: str, sharding: str, ref: Path, lost_at: int
) -> dict:
    """``tidal resume`` of the job in ``home`` with the script at ``sharding``: the numbers of
    that resume, once its checks held (``lost_at``: the step of the lost job's newest
    checkpoint, which each resume must start from)."""
    (part.dir / "sharding").write_text(sharding + "\n")
    out = part.dir / "out"
    shutil.rmtree(out, ignore_errors=True)  # the results of the run before, same --out
    log_name = f"tidal-resume-{sharding}.log"
    rc, secs = part.run(resume_cmd(home, name), log_name, ctx.env(gpus=1), f"resume at {sharding}")
    status = finished(part, rc, home, name, log_name)
    said = RESUMING.search(tail(part.dir / log_name, 50))
    part.check(
        f"`tidal resume` at {sharding} named its checkpoint", bool(said), tail(part.dir / log_name)
    )
    start = int(said.group(1))
    last = formed(status)[-1]
    part.check(
        f"the resumed generation at {sharding} started at the lost job's newest checkpoint",
        last["start_step"] == start == lost_at,
        f"generation {last}, the lost job's newest checkpoint at step {lost_at}",
    )
    newest = max(status["checkpoints"], key=lambda c: c["step"], default={"path": "/"})["path"]
    part.check(
        f"the resume at {sharding} wrote its checkpoints in its own home",
        Path(newest).resolve().is_relative_to(home.resolve()),
        newest,
    )
    members = [json.loads(p.read_text()) for p in sorted(out.glob("w*.json"))]
    part.check(
        f"the members after the resume trained at {sharding}",
        bool(members) and all(m.get("sharding") == sharding for m in members),
        str(members),
    )
    rels = check_members(part, out, ref, "nccl" if ctx.cuda else "gloo")
    return {"resume_s": round(secs, 2), "resumed_from_step": start, "rel_l2": rels}


def run(ctx: Ctx, part: Part) -> None:
    ref = reference(ctx, part)
    name = "fsdp1"
    (part.dir / "sharding").write_text("fsdp\n")
    status, home, _ = first_run(
        ctx,
        part,
        name,
        what="the sharded run (a raise in the step's collective, then a SIGKILL)",
        script_args=("--sharding-file", str(part.dir / "sharding")),
    )
    part.numbers["generations"] = gens_summary(status)
    ckpts = status["checkpoints"]
    part.check(
        "sharded checkpoints were written",
        bool(ckpts) and all(layout(c) == "sharded" for c in ckpts),
        str([(c["step"], layout(c)) for c in ckpts]),
    )
    part.numbers["checkpoints"] = [c["step"] for c in ckpts]

    other = part.dir / "home-ddp"
    shutil.copytree(home, other)  # the lost job, twice: one resume in each home
    lost_at = max(c["step"] for c in ckpts)
    resumes = {"fsdp": resume(ctx, part, home, name, "fsdp", ref, lost_at)}
    resumes["ddp"] = resume(ctx, part, other, name, "ddp", ref, lost_at)
    part.numbers.update(
        resumes=resumes,
        resumed_from_step=resumes["fsdp"]["resumed_from_step"],
        max_rel_l2=max(max(r["rel_l2"].values()) for r in resumes.values()),
    )
