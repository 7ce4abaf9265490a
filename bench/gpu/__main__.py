"""The GPU check (issue 14): CUDA workers and NCCL process groups, end to end, in under
8 minutes on a machine with one GPU.

``python -m bench.gpu [--quick] [--json FILE] [--workdir DIR] [--only a,b,c,d,e,f]``
``python -m bench.gpu --device cpu [--quick]``: the same logic on the CPU (gloo instead of
NCCL, CPU tensors, parts (c) and (e) small), so the check's own code runs in CI.

Parts (each with its own wall-clock timeout; a part that runs past it has hung and failed),
one module each: (a) ``shared``, (b) ``reform``, (c) ``speed``, (d) ``nccl2``, (e) ``amp``,
(f) ``shard``;
their docstrings say what each checks, ``harness`` holds what they share.

Exits 0 when every part that ran passed, 1 otherwise, 2 when there is no CUDA device (and no
``--device cpu``). Prints one JSON object on stdout (``--json FILE`` writes it too): the
parts with their checks and numbers, and ``rows`` in the bench suite's
``{name, tidal, peer, ratio, unit}`` form; the human summary goes to stderr. See
``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import log
from bench.gpu import amp, nccl2, reform, shard, shared, speed
from bench.gpu.harness import (
    BUDGET_S,
    NO_CUDA,
    REL_BOUND,
    Ctx,
    Part,
    PartFailed,
    run_options,
    visible_gpus,
)

PARTS = {
    "a": (shared.TITLE, shared.run),
    "b": (reform.TITLE, reform.run),
    "c": (speed.TITLE, speed.run),
    "d": (nccl2.TITLE, nccl2.run),
    "e": (amp.TITLE, amp.run),
    "f": (shard.TITLE, shard.run),
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
    for mode, run in r.get("runs", {}).items():  # part e
        if "val_loss_final" in run:
            bits.append(
                f"{mode} val_loss {run['val_loss_first']:.2f} -> {run['val_loss_final']:.2f}"
            )
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
    parser.add_argument("--quick", action="store_true", help="fewer steps in parts (c) and (e)")
    parser.add_argument("--json", metavar="FILE", help="write the result here too")
    parser.add_argument("--workdir", metavar="DIR", help="keep every log and file here")
    parser.add_argument("--only", metavar="PARTS", help="a subset, e.g. a,b (default: all)")
    parser.add_argument("--rel-bound", type=float, default=REL_BOUND)
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else set(PARTS)
    if only - set(PARTS):
        print(
            f"bench.gpu: unknown part(s) {sorted(only - set(PARTS))}; known: {', '.join(PARTS)}",
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
