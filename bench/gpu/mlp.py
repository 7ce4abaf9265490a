"""The MLP job of parts a, b, d and f (``scripts/train.py``): its one-worker reference, a run
of it under ``tidal run``, and the checks of its members' results against the reference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.common import tidal_cmd
from bench.gpu import harness
from bench.gpu.harness import TRAIN, Ctx, Part, PartFailed, tail

STEPS = 80  # parts a, b, d


def reference(ctx: Ctx, part: Part) -> Path:
    """``scripts/train.py`` alone (no ``tidal run``) on the check's device, once."""
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
    script_args: tuple[str, ...] = (),
) -> tuple[int, float, Path, Path]:
    """``tidal run OPTS scripts/train.py`` armed with ``faults``, ``gpus`` GPUs visible
    (``pin``: the Trainer's pinned host memory, on CUDA only; ``script_args``: more of the
    script's arguments): (exit status, seconds, the job's home, the members' result
    folder)."""
    home, out = part.dir / "home", part.dir / "out"
    script = [str(TRAIN), "--max-steps", str(STEPS), "--out", str(out), *script_args]
    script += ["--expect-device", ctx.device] + (["--pin-memory"] if pin and ctx.cuda else [])
    rc, secs = part.run(
        tidal_cmd(home, name, *opts) + script, "tidal-run.log", ctx.env(gpus, faults=faults), what
    )
    return rc, secs, home, out


def finished(part: Part, rc: int, home: Path, name: str, log_name: str) -> dict:
    return harness.finished(part, rc, home, name, log_name, STEPS)


def members(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("w*.json"))]


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
