"""Part (e): AMP through the Trainer's hooks. ``examples/gpt.py`` under ``tidal run`` with
one worker, twice at once: ``--autocast bf16`` (bfloat16 forward passes) and ``--autocast
fp16`` (float16 with the ``torch.amp.GradScaler`` the example hands to the Trainer). Each
must succeed with a finite final ``val_loss`` below its step-0 value (both from ``tidal
status --json --history``). The fp16 job checkpoints every few steps and its only worker is
SIGKILLed mid-run; ``tidal resume`` must carry the GradScaler's state from the checkpoint
and complete the job."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.common import tidal_cmd
from bench.gpu.harness import (
    GPT,
    HOOKS,
    Ctx,
    Part,
    finished,
    formed,
    job_logs,
    tail,
    tidal_history,
    tidal_status,
)
from bench.gpu.reform import RESUMING, resume_cmd
from bench.gpu.speed import step_records

TITLE = "AMP: bf16 autocast, fp16 with a GradScaler, a SIGKILL and tidal resume"
# (steps, --checkpoint-every, the step whose start SIGKILLs the fp16 worker); --quick: fewer
SIZES = {False: (30, 10, 25), True: (20, 5, 17)}


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def scaler_state(path: str | Path) -> dict | None:
    """The GradScaler's ``scale`` and ``_growth_tracker`` a checkpoint holds (None: none)."""
    from tidal.checkpoint.layout import TRACKED_JSON

    try:
        skeleton = json.loads((Path(path) / TRACKED_JSON).read_text())["skeleton"]
    except (OSError, ValueError, KeyError):
        return None
    state = skeleton.get("grad_scaler")
    if not isinstance(state, dict):
        return None
    return {"scale": state.get("scale"), "growth_tracker": state.get("_growth_tracker")}


def job(ctx: Ctx, part: Part, mode: str, steps: int, every: int, kill: int):
    """The ``(cmd, log, env, what)`` of one job, its home and step records' folder."""
    home, name, records = part.dir / f"home-{mode}", f"gpt-{mode}", part.dir / f"steps-{mode}"
    opts = ["--workers", "1", "--max-restarts", "0"]
    faults = None
    if mode == "fp16":
        opts += ["--checkpoint-every", str(every)]
        faults = f"sigkill@worker=0,step={kill}"
    env = ctx.env(gpus=1, hooks=HOOKS, faults=faults)
    env["TIDAL_BENCH_GPU_STEPS"] = str(records)
    cmd = tidal_cmd(home, name, *opts) + [str(GPT), *ctx.gpt_args(steps), "--autocast", mode]
    what = f"examples/gpt.py --autocast {mode} under tidal run"
    return (cmd, f"tidal-run-{mode}.log", env, what), home, name, records


def learned(part: Part, status: dict, home: Path, name: str, steps: int) -> dict:
    """The job's final ``val_loss`` (its metrics) is finite and below its step-0 value
    (its history), and the final one was logged at the last step."""
    series = tidal_history(home, name).get("val_loss", {"step": [], "value": []})
    logged = dict(zip(series["step"], series["value"], strict=True))
    first, final = logged.get(0), status["metrics"].get("val_loss")
    part.check(
        f"{name} logged val_loss at step 0 and at step {steps}",
        first is not None and max(logged) == steps and logged[steps] == final,
        f"val_loss logged at steps {sorted(logged)}; metrics {final}",
    )
    part.check(
        f"{name}'s final val_loss is finite and below step 0's",
        finite(first) and finite(final) and final < first,
        f"step 0: {first}, final: {final}",
    )
    return {"val_loss_first": round(first, 4), "val_loss_final": round(final, 4)}


def on_device(part: Part, records: Path, name: str) -> None:
    recs = step_records(records)
    part.check(f"{name}'s step starts were recorded", bool(recs), str(records))
    if part.ctx.cuda:
        part.check(f"{name}'s worker held its tensors on the GPU", max(r[4] for r in recs) > 0)


def scaler_carried(part: Part, numbers: dict, status: dict, start: int, steps: int) -> None:
    """The checkpoint resumed from holds the GradScaler's state, and (where the scale did
    not move since: no inf/NaN) the final checkpoint's growth tracker went on from it."""
    ckpts = {c["step"]: c["path"] for c in status["checkpoints"]}
    at_resume = scaler_state(ckpts[start]) if start in ckpts else None
    final = scaler_state(ckpts[steps]) if steps in ckpts else None
    numbers.update(
        checkpoints=sorted(ckpts), grad_scaler_at_resume=at_resume, grad_scaler_final=final
    )
    part.check(
        f"the checkpoint of step {start} carries the GradScaler's state",
        at_resume is not None and finite(at_resume["scale"]) and at_resume["scale"] > 0,
        f"{ckpts.get(start)}: {at_resume}",
    )
    if final is not None and final["scale"] == at_resume["scale"]:
        part.check(
            "the resumed GradScaler went on from the checkpoint's (its growth tracker)",
            final["growth_tracker"] == at_resume["growth_tracker"] + steps - start,
            f"at step {start}: {at_resume}; at step {steps}: {final}",
        )


def killed_then_resumed(
    part: Part, numbers: dict, rc: int, home: Path, name: str, records: Path
) -> None:
    """The fp16 job: its SIGKILL ended it after checkpoints; ``tidal resume`` completes it
    from the newest, with the GradScaler's state."""
    steps, every, kill = SIZES[part.ctx.quick]
    status = tidal_status(home, name)
    numbers["first_run_exit"] = rc
    part.check(
        f"the SIGKILL at step {kill} ended {name} (its only worker, no restarts)",
        status["state"] in ("failed", "interrupted") and rc != 0 and status["step"] < steps,
        f"exit {rc}, state {status['state']} at step {status['step']}\n{job_logs(home, name)}",
    )
    part.check(f"{name} wrote checkpoints", bool(status["checkpoints"]))
    log = "tidal-resume-fp16.log"
    env = {**part.ctx.env(gpus=1, hooks=HOOKS), "TIDAL_BENCH_GPU_STEPS": str(records)}
    rc, secs = part.run(resume_cmd(home, name), log, env, f"tidal resume of {name}")
    numbers["resume_s"] = round(secs, 2)
    status = finished(part, rc, home, name, log, steps)
    said = RESUMING.search(tail(part.dir / log, 50))
    part.check("`tidal resume` named its checkpoint", bool(said), tail(part.dir / log))
    start = int(said.group(1))
    last = formed(status)[-1]
    part.numbers["resumed_from_step"] = start
    part.check(
        "the resumed generation started at the checkpoint's step",
        last["start_step"] == start and start >= every,
        f"generation {last}",
    )
    scaler_carried(part, numbers, status, start, steps)
    on_device(part, records, name)
    numbers.update(learned(part, status, home, name, steps))


def run(ctx: Ctx, part: Part) -> None:
    import torch

    steps, every, kill = SIZES[ctx.quick]
    part.numbers.update(steps=steps, checkpoint_every=every, kill_step=kill, runs={})
    modes = ["bf16", "fp16"]
    if ctx.cuda and not torch.cuda.is_bf16_supported():
        modes.remove("bf16")
        part.numbers["runs"]["bf16"] = {"skipped": "this GPU has no bfloat16"}
    jobs = {mode: job(ctx, part, mode, steps, every, kill) for mode in modes}
    ended = part.run_all([jobs[m][0] for m in modes])  # both at once

    for mode, (rc, secs) in zip(modes, ended, strict=True):
        (_, log, _, _), home, name, records = jobs[mode]
        numbers = part.numbers["runs"][mode] = {"wall_s": round(secs, 2)}
        if mode == "fp16":
            killed_then_resumed(part, numbers, rc, home, name, records)
            continue
        status = finished(part, rc, home, name, log, steps)
        on_device(part, records, name)
        numbers.update(learned(part, status, home, name, steps))
