"""Part (b): one NCCL worker (``--comm nccl``): checkpoints, a ``raise`` fault inside the
all-reduce that must re-form the group (a new generation, in a bounded time) rather than
hang, then the loss of the job (its only worker SIGKILLed) and ``tidal resume`` from the
newest checkpoint to the end, equal to the reference."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from bench.gpu.harness import (
    COLLECTIVE_TIMEOUT_S,
    REFORM_BOUND_S,
    Ctx,
    Part,
    formed,
    gens_summary,
    job_logs,
    tail,
    tidal_status,
)
from bench.gpu.mlp import check_members, finished, reference, train_job

TITLE = "one NCCL worker: a failed collective re-forms, checkpoint, resume"
FAULTS = "raise@worker=0,phase=allreduce,step=30;sigkill@worker=0,step=50"
RESUMING = re.compile(r"resuming from \S+ \(step (\d+)\)")  # what `tidal resume` says


def resume_cmd(home, name: str) -> list[str]:
    return [sys.executable, "-m", "tidal.cli", "resume", "--home", str(home), name, "--quiet"]


def first_run(
    ctx: Ctx, part: Part, name: str, *, what: str, script_args: tuple[str, ...] = ()
) -> tuple[dict, Path, Path]:
    """The first run of parts (b) and (f): one worker checkpointing every 20 steps, armed
    with ``FAULTS``, and its checks: the raise fired in step 30's collective and a new
    generation trained after it, within ``REFORM_BOUND_S``; the SIGKILL ended the job.
    Returns its status, home and output folder; the numbers are recorded on ``part``."""
    opts = ["--workers", "1", "--max-restarts", "0", "--checkpoint-every", "20"]
    opts += ["--collective-timeout", COLLECTIVE_TIMEOUT_S, *ctx.comm("nccl")]
    rc, secs, home, out = train_job(
        ctx, part, name, opts, faults=FAULTS, gpus=1, what=what, script_args=script_args
    )
    status = tidal_status(home, name)
    part.numbers.update(first_run_s=round(secs, 2), first_run_exit=rc)
    events = [e["message"] for e in status["events"]]
    part.check(
        "the raise fault fired inside step 30's collective",
        any("injected fault at step 30 (allreduce)" in m for m in events),
        f"events: {events[-6:]}\n{job_logs(home, name)}",
    )
    reform = [g for g in formed(status) if "failed collective" in g["reason"]]
    part.check(
        "the failed collective re-formed the group (a new generation trained)",
        bool(reform),
        f"generations {gens_summary(status)}\n{job_logs(home, name)}",
    )
    pause = reform[0]["pause_s"]
    part.numbers.update(reform_pause_s=pause, reform_phases_s=reform[0].get("pause_phases"))
    part.check(
        f"the re-form took under {REFORM_BOUND_S:.0f} s",
        pause is not None and pause < REFORM_BOUND_S,
        f"pause_s {pause}",
    )
    part.check(
        "the SIGKILL ended the job (its only worker, no restarts)",
        status["state"] in ("failed", "interrupted") and rc != 0,
        f"exit {rc}, state {status['state']}\n{job_logs(home, name)}",
    )
    return status, home, out


def run(ctx: Ctx, part: Part) -> None:
    ref = reference(ctx, part)
    name, backend = "nccl1", "nccl" if ctx.cuda else "gloo"
    status, home, out = first_run(
        ctx, part, name, what="the first run (a raise in the all-reduce, then a SIGKILL)"
    )
    ckpts = status["checkpoints"]
    part.numbers["checkpoints"] = [
        {k: c.get(k) for k in ("step", "bytes", "seconds_to_write")} for c in ckpts
    ]
    part.check("checkpoints were written", bool(ckpts), str(status["checkpoints"]))

    rc, secs = part.run(resume_cmd(home, name), "tidal-resume.log", ctx.env(gpus=1), "tidal resume")
    status = finished(part, rc, home, name, "tidal-resume.log")
    said = RESUMING.search(tail(part.dir / "tidal-resume.log", 50))
    part.check(
        "`tidal resume` named its checkpoint", bool(said), tail(part.dir / "tidal-resume.log")
    )
    start = int(said.group(1))
    last = formed(status)[-1]
    part.numbers.update(resume_s=round(secs, 2), resumed_from_step=start)
    part.check(
        "the resumed generation started at the checkpoint's step",
        last["start_step"] == start and start >= 20,
        f"generation {last}",
    )
    rels = check_members(part, out, ref, backend)
    part.numbers.update(
        rel_l2=rels, max_rel_l2=max(rels.values()), generations=gens_summary(status)
    )
