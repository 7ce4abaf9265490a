"""The GPU check's harness: the context every part runs in (``Ctx``), a part's record and
deadline (``Part``: its checks, numbers, and the commands it runs within its own timeout),
the check's budget and limits, and the helpers that read a job's status and logs."""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import ROOT, Procs

HERE = ROOT / "bench" / "gpu"
TRAIN = HERE / "scripts" / "train.py"  # parts a, b, d
GPT_PEER = HERE / "scripts" / "gpt_ddp.py"  # part c's torchrun peer
HOOKS = HERE / "hooks"  # the step records of parts c and e
GPT = ROOT / "examples" / "gpt.py"
NO_CUDA = "no CUDA device: the GPU check needs one; `--device cpu` runs its logic on CPU"

BUDGET_S = 480.0  # the whole check: 8 minutes
# Each part's own limit; together they fit the budget, whichever parts run.
TIMEOUT_S = {"a": 100.0, "b": 100.0, "c": 300.0, "d": 80.0, "e": 60.0, "f": 120.0}
REL_BOUND = 1e-4  # float32 elastic vs one worker; an H200 measured 1.22e-7 (docs/gpu.md)
REFORM_BOUND_S = 30.0  # a failed collective to the first step of the next generation
COLLECTIVE_TIMEOUT_S = "20"  # tidal run --collective-timeout for the NCCL parts
# examples/gpt.py (parts c and e): the example's own sizes on the GPU, a small GPT on the CPU.
GPT_GPU_ARGS: list[str] = []
GPT_CPU_ARGS = "--files 20 --dim 64 --layers 2 --heads 2 --context 32 --global-batch-size 16"


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
        step hooks, which also install the faults, then the fault hooks), ``gpus`` GPUs
        visible (none on the CPU run)."""
        path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}
        if faults is not None:
            from tidal.testing import fault_env

            env.update(fault_env(faults, env))
        if hooks is not None:  # its sitecustomize shadows tidal.testing's, and does its work
            path = [str(hooks), *env["PYTHONPATH"].split(os.pathsep)]
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus[:gpus]) if self.cuda else ""
        return env

    def gpt_args(self, steps: int) -> list[str]:
        """``examples/gpt.py``'s arguments for ``steps`` steps on the check's device, the
        held-out loss at step 0 only (and at the end), the token files shared by the parts."""
        sizes = GPT_GPU_ARGS if self.cuda else GPT_CPU_ARGS.split()
        args = ["--max-steps", str(steps), *sizes, "--data-dir", str(self.work / "gpt-data")]
        args += ["--eval-every", "1000000"]
        return args + ([] if self.cuda else ["--num-workers", "0", "--val-windows", "8"])


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
        return self.run_all([(cmd, logname, env, what)])[0]

    def run_all(self, runs: list[tuple[list[str], str, dict, str]]) -> list[tuple[int, float]]:
        """Run the commands ``(cmd, logname, env, what)`` at once, each to its end within the
        part's time (one still running past it is a hang): their (exit status, seconds)."""
        procs = Procs()
        t0 = time.monotonic()
        ended: dict[int, tuple[int, float]] = {}
        try:
            started = [procs.start(cmd, self.dir / log, env) for cmd, log, env, _ in runs]
            self.left(runs[0][3])
            while len(ended) < len(started):
                for i, proc in enumerate(started):
                    if i not in ended and proc.poll() is not None:
                        ended[i] = (proc.returncode, time.monotonic() - t0)
                waiting = [i for i in range(len(started)) if i not in ended]
                if waiting and time.monotonic() >= self.deadline:
                    _, log, _, what = runs[waiting[0]]
                    raise PartFailed(
                        f"{what} still ran when part {self.key}'s {self.timeout_s:.0f} s were "
                        f"up (a hang); {self.dir / log}:\n{tail(self.dir / log)}"
                    )
                if waiting:
                    time.sleep(0.02)
        finally:
            procs.cleanup()
        return [ended[i] for i in range(len(runs))]


# -- what the check reads ------------------------------------------------------------------
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
    from tidal.lookup import get_status

    return json.loads(get_status(home, name).model_dump_json())


def tidal_history(home: Path, name: str) -> dict[str, dict]:
    """The per-step series of ``tidal.log`` (``tidal status --json --history``'s
    ``history``: ``{metric: {"step": [...], "value": [...]}}``), read in this process from
    the home's records as the CLI reads them."""
    from tidal.lookup import database as _database

    db = _database(home)
    try:
        return {k: s.model_dump(mode="json") for k, s in db.step_history(name).items()}
    finally:
        db.close()


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


def finished(part: Part, rc: int, home: Path, name: str, log_name: str, steps: int) -> dict:
    """The job's status, once it is checked: the command exited 0, the job succeeded at
    ``steps``."""
    status = tidal_status(home, name)
    part.check(
        f"`tidal run` of {name} exited 0 and the job succeeded",
        rc == 0 and status["state"] == "succeeded" and status["step"] == steps,
        f"exit {rc}, state {status['state']} at step {status['step']}\n"
        f"{tail(part.dir / log_name, 5)}\n{job_logs(home, name)}",
    )
    return status


def formed(status: dict) -> list[dict]:
    """Generations that trained (one opened and abandoned has no ``start_step``)."""
    return [g for g in status["generations"] if g["start_step"] is not None]


def gens_summary(status: dict) -> list[dict]:
    keys = ("id", "world_size", "start_step", "reason", "pause_s", "recovery")
    return [{k: g.get(k) for k in keys} for g in status["generations"]]
