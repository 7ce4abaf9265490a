"""The GPU check (issue 14): CUDA workers and NCCL process groups, end to end, in under
8 minutes on a machine with one GPU.

``python -m bench.gpu [--quick] [--json FILE] [--workdir DIR] [--only a,b,c,d]``
``python -m bench.gpu --device cpu [--quick]``: the same logic on the CPU (gloo instead of
NCCL, CPU tensors, part (c) small), so the check's own code runs in CI.

Parts (each with its own wall-clock timeout; a part that runs past it has hung and failed):

- (a) two workers sharing one GPU over gloo with CUDA tensors (``tidal run --comm gloo
  --share-gpus``): 2 -> 3 -> 1 workers (``--schedule``) with a SIGKILL inside a gradient
  all-reduce at 3; every finishing member's final parameters against a one-worker run of
  the same script (``bench/gpu_train.py``), relative L2 within ``--rel-bound``;
- (b) one NCCL worker (``--comm nccl``): checkpoints, a ``raise`` fault inside the
  all-reduce that must re-form the group (a new generation, in a bounded time) rather than
  hang, then the loss of the job (its only worker SIGKILLed) and ``tidal resume`` from the
  newest checkpoint to the end, equal to the reference;
- (c) ``examples/gpt.py`` on the GPU: samples/s under ``tidal run`` (1 worker, the default
  ``--comm``) against the same model and batch in plain DDP under ``torchrun`` (1 process,
  ``bench/gpu_gpt_ddp.py``), measured alike from the step starts (``bench/gpu_hooks``);
- (d) with two GPUs or more: NCCL at world size 2, one worker SIGKILLed inside the
  all-reduce; the survivor's collective must fail in a bounded time and train on alone to
  the reference's parameters.

Exits 0 when every part that ran passed, 1 otherwise, 2 when there is no CUDA device (and no
``--device cpu``). Prints one JSON object on stdout (``--json FILE`` writes it too): the
parts with their checks and numbers, and ``rows`` in the bench suite's
``{name, tidal, peer, ratio, unit}`` form; the human summary goes to stderr. See
``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import ROOT, TORCHRUN_ENV, Procs, log, median, row, tidal_cmd, torchrun_cmd

TRAIN = ROOT / "bench" / "gpu_train.py"
GPT = ROOT / "examples" / "gpt.py"
GPT_PEER = ROOT / "bench" / "gpu_gpt_ddp.py"
HOOKS = ROOT / "bench" / "gpu_hooks"
NO_CUDA = "no CUDA device: the GPU check needs one; `--device cpu` runs its logic on CPU"

BUDGET_S = 480.0  # the whole check: 8 minutes
TIMEOUT_S = {"a": 120.0, "b": 120.0, "c": 150.0, "d": 90.0}  # each part's own limit
REL_BOUND = 1e-4  # float32 elastic vs one worker; to be confirmed by the first GPU run
REFORM_BOUND_S = 30.0  # a failed collective to the first step of the next generation
COLLECTIVE_TIMEOUT_S = "20"  # tidal run --collective-timeout for the NCCL parts
STEPS = 80  # parts a, b, d (gpu_train.py)
SCHEDULE = "20:3,60:1"  # part a: 2 -> 3 at step 20, a kill at 40 (3 -> 2), -> 1 at 60
KILL_A = "sigkill@worker=1,step=40,phase=allreduce"
FAULTS_B = "raise@worker=0,phase=allreduce,step=30;sigkill@worker=0,step=50"
GPT_GPU = dict(steps=300, quick_steps=150, args=[])  # the example's own sizes
GPT_CPU = dict(
    steps=100,
    quick_steps=40,
    args="--files 20 --dim 64 --layers 2 --heads 2 --context 32 --global-batch-size 16".split(),
)


class PartFailed(Exception):
    """A check of a part did not hold (the message says which)."""


@dataclass
class Ctx:
    device: str  # "cuda" or "cpu"
    quick: bool
    work: Path
    rel_bound: float
    run_flags: set[str]
    budget_end: float
    gpus: list[str] = field(default_factory=list)  # visible GPU ids (CUDA_VISIBLE_DEVICES)
    reference_s: float = 0.0

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def comm(self, backend: str) -> list[str]:
        """``--comm BACKEND`` where ``tidal run`` takes it; on the CPU it may be left out
        (before the option exists, every job is gloo anyway)."""
        if "--comm" in self.run_flags:
            return ["--comm", backend if self.cuda else "gloo"]
        if self.cuda:
            raise PartFailed("`tidal run` does not accept --comm (needed on CUDA)")
        return []

    def share_gpus(self) -> list[str]:
        if not self.cuda:
            return []  # nothing to share on the CPU
        if "--share-gpus" not in self.run_flags:
            raise PartFailed("`tidal run` does not accept --share-gpus (needed for part a)")
        return ["--share-gpus"]

    def env(self, gpus: int = 1, hooks: Path | None = None, faults: str | None = None) -> dict:
        """The environment of a job's processes: this checkout on ``PYTHONPATH`` (first the
        fault or step hooks), ``gpus`` GPUs visible (none on the CPU run)."""
        path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        if hooks is not None:
            path.insert(0, str(hooks))
        env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}
        if faults is not None:
            from tidal.testing import fault_env

            env.update(fault_env(faults, env))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus[:gpus]) if self.cuda else ""
        return env


# -- small helpers ------------------------------------------------------------------------
def run_options() -> set[str]:
    """The option strings ``tidal run`` accepts, from the CLI's own parser."""
    from tidal.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices["run"]._option_string_actions)


def visible_gpus() -> list[str]:
    import torch

    n = torch.cuda.device_count()
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed[:n] if listed else [str(i) for i in range(n)]


def tidal_status(home: Path, name: str) -> dict:
    """``tidal status --json``, computed in this process (the CLI's code path)."""
    from tidal.cli import get_status

    return json.loads(get_status(home, name).model_dump_json())


def relative_l2(a_path: Path, b_path: Path) -> float:
    """||a - b|| / ||b|| over all tensors of two safetensors files (the same names)."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(a_path)), load_file(str(b_path))
    if a.keys() != b.keys() or not a:
        raise PartFailed(f"{a_path.name} and {b_path.name} hold different tensors")
    names = sorted(a)
    va = torch.cat([a[n].flatten().double() for n in names])
    vb = torch.cat([b[n].flatten().double() for n in names])
    return (torch.linalg.vector_norm(va - vb) / torch.linalg.vector_norm(vb)).item()


def tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def job_logs(home: Path, name: str, lines: int = 12) -> str:
    logs = home / "jobs" / name / "logs"
    parts = [f"--- {p.name}\n{tail(p, lines)}" for p in sorted(logs.glob("*.log"))]
    return "\n".join(parts)


def formed(status: dict) -> list[dict]:
    """Generations that trained (one opened and abandoned has no ``start_step``)."""
    return [g for g in status["generations"] if g["start_step"] is not None]


def gens_summary(status: dict) -> list[dict]:
    keys = ("id", "world_size", "start_step", "reason", "pause_s", "recovery")
    return [{k: g.get(k) for k in keys} for g in status["generations"]]


def members(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("w*.json"))]


class Part:
    """One part's record: its checks, numbers, time, and the deadline it runs under."""

    def __init__(self, ctx: Ctx, key: str, title: str) -> None:
        self.ctx, self.key, self.title = ctx, key, title
        self.dir = ctx.work / f"part-{key}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.timeout_s = min(TIMEOUT_S[key], max(0.0, ctx.budget_end - time.monotonic()))
        self.deadline = time.monotonic() + self.timeout_s
        self.checks: list[dict] = []
        self.numbers: dict = {}
        self.rows: list[dict] = []

    def left(self, what: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 1:
            raise PartFailed(f"part {self.key}'s {self.timeout_s:.0f} s ran out before {what}")
        return left

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        self.checks.append({"what": what, "ok": bool(ok), **({"detail": detail} if detail else {})})
        if not ok:
            raise PartFailed(f"{what}" + (f": {detail}" if detail else ""))

    def run(self, cmd: list[str], logname: str, env: dict, what: str) -> tuple[int, float]:
        """Run ``cmd`` to its end within the part's time; a run past it is a hang."""
        procs = Procs()
        t0 = time.monotonic()
        try:
            proc = procs.start(cmd, self.dir / logname, env)
            try:
                rc = proc.wait(timeout=self.left(what))
            except subprocess.TimeoutExpired:
                raise PartFailed(
                    f"{what} still ran when part {self.key}'s {self.timeout_s:.0f} s were up "
                    f"(a hang); {self.dir / logname}:\n{tail(self.dir / logname)}"
                ) from None
        finally:
            procs.cleanup()
        return rc, time.monotonic() - t0


# -- the one-worker reference (parts a, b, d) ----------------------------------------------
def reference(ctx: Ctx, part: Part) -> Path:
    """``bench/gpu_train.py`` alone (no ``tidal run``) on the check's device, once."""
    out = ctx.work / "reference"
    params = out / "params-walone.safetensors"
    if not params.is_file():
        cmd = [sys.executable, str(TRAIN), "--max-steps", str(STEPS), "--out", str(out)]
        cmd += ["--expect-device", ctx.device]
        rc, secs = part.run(cmd, "reference.log", ctx.env(), "the one-worker reference")
        if rc != 0 or not params.is_file():
            raise PartFailed(
                f"the one-worker reference exited {rc}:\n{tail(part.dir / 'reference.log')}"
            )
        ctx.reference_s = secs
    return params


def check_members(part: Part, out: Path, ref: Path, backend: str) -> dict[str, float]:
    """Every member that finished ran on the check's device and backend; the ones that
    completed the job hold the reference's parameters within the bound."""
    ctx = part.ctx
    found = members(out)
    part.check("a member's result files exist", bool(found), str(out))
    for m in found:
        part.check(
            f"worker {m['worker_id']} trained on {ctx.device}",
            m["device"].startswith(ctx.device) and m["batch_devices"] == [ctx.device],
            f"model on {m['device']}, batches on {m['batch_devices']}",
        )
        part.check(
            f"worker {m['worker_id']} ran its steps over {backend}",
            m["backends"] == [backend],
            f"backends {m['backends']}",
        )
    rels = {}
    for m in found:
        if m["completed"]:
            rels[m["worker_id"]] = relative_l2(out / f"params-w{m['worker_id']}.safetensors", ref)
    part.check("a member completed the job", bool(rels))
    worst = max(rels.values())
    part.check(
        f"every finishing member's parameters within rel L2 {ctx.rel_bound:g} of one worker",
        worst <= ctx.rel_bound,
        ", ".join(f"worker {w}: {v:.3e}" for w, v in rels.items()),
    )
    return rels


def finished(part: Part, rc: int, home: Path, name: str, log_name: str) -> dict:
    status = tidal_status(home, name)
    part.check(
        f"`tidal run` of {name} exited 0 and the job succeeded",
        rc == 0 and status["state"] == "succeeded" and status["step"] == STEPS,
        f"exit {rc}, state {status['state']} at step {status['step']}\n"
        f"{tail(part.dir / log_name, 5)}\n{job_logs(home, name)}",
    )
    return status


def train_job(
    ctx: Ctx,
    part: Part,
    name: str,
    opts: list[str],
    *,
    faults: str,
    gpus: int,
    what: str,
    pin: bool = False,
) -> tuple[int, float, Path, Path]:
    """``tidal run OPTS bench/gpu_train.py`` armed with ``faults``, ``gpus`` GPUs visible
    (``pin``: the Trainer's pinned host memory, on CUDA only): (exit status, seconds, the
    job's home, the members' result folder)."""
    home, out = part.dir / "home", part.dir / "out"
    script = [str(TRAIN), "--max-steps", str(STEPS), "--out", str(out)]
    script += ["--expect-device", ctx.device] + (["--pin-memory"] if pin and ctx.cuda else [])
    rc, secs = part.run(
        tidal_cmd(home, name, *opts) + script, "tidal-run.log", ctx.env(gpus, faults=faults), what
    )
    return rc, secs, home, out


# -- part a --------------------------------------------------------------------------------
def part_a(ctx: Ctx, part: Part) -> None:
    ref = reference(ctx, part)
    name = "shared"
    opts = ["--workers", "2", "--max-workers", "3", "--max-restarts", "0"]
    opts += ["--schedule", SCHEDULE, *ctx.comm("gloo"), *ctx.share_gpus()]
    rc, secs, home, out = train_job(
        ctx, part, name, opts, faults=KILL_A, gpus=1, what="the shared job (2 -> 3 -> 1)", pin=True
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


# -- part b --------------------------------------------------------------------------------
def part_b(ctx: Ctx, part: Part) -> None:
    ref = reference(ctx, part)
    name, backend = "nccl1", "nccl" if ctx.cuda else "gloo"
    opts = ["--workers", "1", "--max-restarts", "0", "--checkpoint-every", "20"]
    opts += ["--collective-timeout", COLLECTIVE_TIMEOUT_S, *ctx.comm("nccl")]
    rc, secs, home, out = train_job(
        ctx,
        part,
        name,
        opts,
        faults=FAULTS_B,
        gpus=1,
        what="the first run (a raise in the all-reduce, then a SIGKILL)",
    )
    status = tidal_status(home, name)
    part.numbers.update(first_run_s=round(secs, 2), first_run_exit=rc)
    events = [e["message"] for e in status["events"]]
    part.check(
        "the raise fault fired inside step 30's all-reduce",
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
    ckpts = status["checkpoints"]
    part.numbers["checkpoints"] = [
        {k: c.get(k) for k in ("step", "bytes", "seconds_to_write")} for c in ckpts
    ]
    part.check("checkpoints were written", bool(ckpts), str(status["checkpoints"]))

    cmd = [sys.executable, "-m", "tidal.cli", "resume", "--home", str(home), name, "--quiet"]
    rc, secs = part.run(cmd, "tidal-resume.log", ctx.env(gpus=1), "tidal resume")
    status = finished(part, rc, home, name, "tidal-resume.log")
    said = re.search(r"resuming from \S+ \(step (\d+)\)", tail(part.dir / "tidal-resume.log", 50))
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


# -- part c --------------------------------------------------------------------------------
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


def part_c(ctx: Ctx, part: Part) -> None:
    sizes = GPT_GPU if ctx.cuda else GPT_CPU
    steps = sizes["quick_steps"] if ctx.quick else sizes["steps"]
    args = ["--max-steps", str(steps), *sizes["args"], "--data-dir", str(ctx.work / "gpt-data")]
    args += ["--eval-every", "1000000"]  # step 0 only: the measurement skips it
    args += [] if ctx.cuda else ["--num-workers", "0", "--val-windows", "8"]
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


# -- part d --------------------------------------------------------------------------------
def part_d(ctx: Ctx, part: Part) -> None:
    ref = reference(ctx, part)
    name = "nccl2"
    opts = ["--workers", "2", "--max-restarts", "0", "--collective-timeout", COLLECTIVE_TIMEOUT_S]
    rc, secs, home, out = train_job(
        ctx,
        part,
        name,
        opts + ctx.comm("nccl"),
        faults=KILL_A,
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


PARTS = {
    "a": ("two workers sharing one GPU over gloo: 2 -> 3 -> 1, a SIGKILL, invariance", part_a),
    "b": ("one NCCL worker: a failed collective re-forms, checkpoint, resume", part_b),
    "c": ("examples/gpt.py: tidal run against torchrun DDP, samples/s", part_c),
    "d": ("NCCL at world size 2: a SIGKILL in the all-reduce", part_d),
}


def run_part(ctx: Ctx, key: str, skip: str | None) -> tuple[dict, list[dict]]:
    title, fn = PARTS[key]
    if skip:
        return {"title": title, "passed": None, "skipped": skip}, []
    part = Part(ctx, key, title)
    t0 = time.monotonic()
    error = None
    log(f"part {key}: {title} (timeout {part.timeout_s:.0f} s)")
    try:
        if part.timeout_s <= 1:
            raise PartFailed("the check's 8-minute budget was spent before this part")
        fn(ctx, part)
    except PartFailed as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a bug or a surprise: the part failed, say why
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    result = {
        "title": title,
        "passed": error is None,
        "seconds": round(time.monotonic() - t0, 2),
        "timeout_s": round(part.timeout_s, 1),
        "checks": part.checks,
        **part.numbers,
    }
    if error is not None:
        result["error"] = error
    return result, part.rows


def summary_line(key: str, r: dict) -> str:
    if r.get("skipped"):
        return f"  ({key}) SKIPPED {r['title']}: {r['skipped']}"
    state = "PASS" if r["passed"] else "FAIL"
    bits = [f"{r['seconds']:.0f} s of {r['timeout_s']:.0f}"]
    if "max_rel_l2" in r:
        bits.append(f"max rel L2 {r['max_rel_l2']:.2e}")
    for k, label in (("kill_pause_s", "kill pause"), ("reform_pause_s", "re-form pause")):
        if r.get(k) is not None:
            bits.append(f"{label} {r[k] * 1000:.0f} ms")
    if "resumed_from_step" in r:
        bits.append(f"resumed from step {r['resumed_from_step']}")
    if "tidal_samples_per_s" in r:
        bits.append(
            f"Tidal {r['tidal_samples_per_s']:.0f} vs torchrun {r['peer_samples_per_s']:.0f} "
            f"samples/s (ratio {r['ratio']:.2f})"
        )
    line = f"  ({key}) {state} {r['title']}: " + ", ".join(bits)
    if not r["passed"]:
        line += "\n      " + r["error"].replace("\n", "\n      ")
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="fewer steps in part (c)")
    parser.add_argument("--json", metavar="FILE", help="write the result here too")
    parser.add_argument("--workdir", metavar="DIR", help="keep every log and file here")
    parser.add_argument("--only", metavar="PARTS", help="a subset, e.g. a,b (default: all)")
    parser.add_argument("--rel-bound", type=float, default=REL_BOUND)
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else set(PARTS)
    if only - set(PARTS):
        print(
            f"bench.gpu: unknown part(s) {sorted(only - set(PARTS))}; known: a, b, c, d",
            file=sys.stderr,
        )
        return 2

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    t0 = time.monotonic()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tidal-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(
        device=args.device,
        quick=args.quick,
        work=work,
        rel_bound=args.rel_bound,
        run_flags=run_options(),
        budget_end=t0 + BUDGET_S,
        gpus=visible_gpus() if args.device == "cuda" else [],
    )
    result: dict = {
        "check": "gpu",
        "device": args.device,
        "quick": args.quick,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": len(ctx.gpus),
        "gpu_name": torch.cuda.get_device_name(0) if ctx.cuda else None,
        "tidal_run_flags": sorted(f for f in ("--comm", "--share-gpus") if f in ctx.run_flags),
        "budget_s": BUDGET_S,
        "parts": {},
        "rows": [],
    }
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanups run on SIGTERM
    try:
        for key in PARTS:
            if key not in only:
                skip = "not selected (--only)"
            elif key == "d" and ctx.cuda and len(ctx.gpus) < 2:
                skip = f"needs two GPUs; {len(ctx.gpus)} visible"
            elif key == "d" and not ctx.cuda and args.only is None:
                skip = "needs two GPUs (`--device cpu --only d` runs its logic on CPU)"
            else:
                skip = None
            part, rows = run_part(ctx, key, skip)
            result["parts"][key] = part
            result["rows"] += rows
    finally:
        signal.signal(signal.SIGTERM, old)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    ran = [p for p in result["parts"].values() if not p.get("skipped")]
    result["passed"] = bool(ran) and all(p["passed"] for p in ran)
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    result["reference_s"] = round(ctx.reference_s, 2)

    verdict = "PASSED" if result["passed"] else "FAILED"
    lines = [
        f"GPU check on {args.device} ({result['gpu_name'] or 'no GPU'}): {verdict} in "
        f"{result['elapsed_s']:.0f} s (budget {BUDGET_S:.0f} s)"
    ]
    lines += [summary_line(k, p) for k, p in result["parts"].items()]
    print("\n".join(lines), file=sys.stderr, flush=True)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text, flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
