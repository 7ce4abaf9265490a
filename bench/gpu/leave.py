"""Where the time of leaving an NCCL generation goes, and whether the abort can run beside
the next generation (docs/gpu.md, Record: "On an H200, the second task").

``python -m bench.gpu.leave [--cycles N] [--json FILE]``: one process, its GPU, world size
1 (a machine with one GPU has no other NCCL shape: NCCL refuses two ranks on one device).
Each cycle forms a default NCCL group as a generation does (``init_process_group`` on a
prefix of one store), runs its first all-reduce (NCCL connects there) and a few more, and
leaves it one of three ways, timed apart:

- ``abort``: the group's ``abort()``, then its unregistering: what
  ``c10d._abort_process_group()`` does, and a worker's leave did until 20f001d;
- ``destroy``: ``dist.destroy_process_group()`` (a shutdown, which waits for pending work);
- ``detached``: the group unregistered from c10d at once, its ``abort()`` and its release
  on a thread while the next cycle forms its group and runs its first all-reduce (a
  worker's leave since 20f001d: ``group.abort_group``).

Each cycle also reports ``pg.abort()`` and the release of the last reference (the
destructor joins the group's threads) separately. Checks (exit 1 on any failure): every
all-reduce's result is right, no abort takes more than ``--limit-s``, and the detached
aborts end. ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` as in a worker. Timing is reported, not
asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

from tidal.worker.membership import group as grp

WAYS = ("abort", "destroy", "detached")
BACKEND = ["nccl", "cuda"]  # ``--cpu``: gloo on the CPU, to run the probe's own logic


def sync() -> None:
    if BACKEND[1] == "cuda":
        torch.cuda.synchronize()


def ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def form(store: dist.Store, name: str, numel: int) -> tuple[torch.Tensor, float]:
    """A generation's group and its first all-reduces; (a result, the first one's ms)."""
    dist.init_process_group(
        BACKEND[0],
        store=dist.PrefixStore(name, store),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    x = torch.full((numel,), 2.0, device=BACKEND[1])
    t0 = time.perf_counter()
    dist.all_reduce(x)
    sync()
    first = ms(t0)
    for _ in range(4):
        dist.all_reduce(x)
    return x, first


def unregister() -> dist.ProcessGroup:
    """Take the default group out of c10d's registry without touching its communicators
    (what a worker's leave does: ``group.unregister``); returns the group."""
    (pg,) = grp.unregister()  # world size 1: the default group is the only one
    return pg


def cycle(store: dist.Store, way: str, i: int, numel: int, behind: list) -> dict:
    row: dict = {"way": way, "cycle": i}
    t0 = time.perf_counter()
    x, row["first_allreduce_ms"] = form(store, f"{way}/{i}", numel)
    row["form_and_first_ms"] = ms(t0)
    sync()
    row["ok"] = bool(torch.all(x == 2.0).item())
    for th in behind:  # the previous cycle's detached abort ran beside this formation
        th.join(30)
        row["previous_abort_done"] = not th.is_alive()
    behind.clear()
    t0 = time.perf_counter()
    if way == "abort":
        pg = dist.group.WORLD
        t1 = time.perf_counter()
        pg.abort()
        row["pg_abort_ms"] = ms(t1)
        unregister()
        t1 = time.perf_counter()
        del pg
        row["release_ms"] = ms(t1)
    elif way == "destroy":
        dist.destroy_process_group()
    else:
        box = [unregister()]

        def finish(box=box, row=row) -> None:
            t1 = time.perf_counter()
            box[0].abort()
            row["pg_abort_ms"] = ms(t1)
            t1 = time.perf_counter()
            box.clear()
            row["release_ms"] = ms(t1)

        th = threading.Thread(target=finish, name="detached-abort")
        th.start()
        behind.append(th)
    row["leave_ms"] = ms(t0)  # what the training thread waits
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.leave")
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--limit-s", type=float, default=20.0)
    ap.add_argument("--json")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (the logic only)")
    args = ap.parse_args(argv)
    if args.cpu:
        BACKEND[:] = ["gloo", "cpu"]
    elif not torch.cuda.is_available():
        print("no CUDA device: the NCCL leave probe needs one", file=sys.stderr)
        return 2
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    if not args.cpu:
        torch.cuda.set_device(0)
    store = dist.HashStore()
    rows: list[dict] = []
    behind: list[threading.Thread] = []
    for way in WAYS:
        for i in range(args.cycles):
            rows.append(cycle(store, way, i, args.numel, behind))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for th in behind:
        th.join(args.limit_s)
    summary = {}
    for way in WAYS:
        mine = [r for r in rows if r["way"] == way]
        summary[way] = {
            k: round(statistics.median(r[k] for r in mine if k in r), 3)
            for k in ("leave_ms", "pg_abort_ms", "release_ms", "first_allreduce_ms")
            if any(k in r for r in mine)
        }
    checks = {
        "every result right": all(r["ok"] for r in rows),
        "every detached abort ended": all(not th.is_alive() for th in behind)
        and all(r.get("previous_abort_done", True) for r in rows),
        "no abort past the limit": all(r.get("pg_abort_ms", 0) <= args.limit_s * 1e3 for r in rows),
    }
    cuda = BACKEND[1] == "cuda"
    out = {
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "numel": args.numel,
        "summary_median": summary,
        "checks": checks,
        "passed": all(checks.values()),
        "rows": rows,
    }
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(json.dumps({"summary_median": summary, "checks": checks}), file=sys.stderr)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
