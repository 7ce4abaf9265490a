"""Checkpoint stall: what a checkpoint costs the training step, async against sync.

``python -m bench.checkpoint_stall [--quick] [--json FILE]``

A ~100 MB MLP (25 M float32 parameters) with SGD momentum (another 100 MB of state) trains
on synthetic data. Three phases in one process: no checkpoints (the baseline step time),
Tidal's asynchronous checkpoint every ``--every`` steps, and the peer: DCP's
``async_save`` of the same state at its best on this host (``bench.peers.DCP_ASYNC``: one
``DefaultStager`` for the run, so its staging buffers are reused; staging in its thread; the
training waits for the staging before the next optimizer update and for the previous upload
before the next save, as DCP's users do). The stall is the time the training thread waits
for the checkpoint (the save call plus the waits before the next optimizer step) or how much
longer the steps it overlaps get, whichever is larger, as a percentage of the baseline step;
the three phases run three times, interleaved, and each figure is the median of its rounds.
The floor (``stall_floor``): the CPU of one memcpy and page-cache write of the same bytes,
spread over the cores, in % of the same step; ``checkpoint_stall_floor_pct`` compares
Tidal's stall with it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import log
from bench.peers import DCP_ASYNC
from tidal.checkpoint.writer import AsyncCheckpointer

#: Checkpoints written before the measured steps (``--keep-checkpoints 2``: the third prunes
#: the first): as in a job that has run a while, the writer's snapshot memory is allocated
#: and the next write reuses a pruned checkpoint's page cache. Without it, the first two
#: checkpoints in a fresh folder touch page cache this VM's guest never used, ~7 CPU-s per
#: GB (whoever writes it), and that dominated the mean over 10 checkpoints.
WARMUP = 3


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 10),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def step_fn(model, opt, x, y, before_update=lambda: None) -> None:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    before_update()
    opt.step()
    opt.zero_grad(set_to_none=True)


class DcpAsync:
    """DCP's ``async_save`` as ``DCP_ASYNC`` configures it, with Tidal's writer's shape:
    ``save`` starts one (after the previous upload), ``quiesce`` waits for its staging
    before the next update, ``last_stall_s`` is what both cost the training thread."""

    def __init__(self, directory: Path) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.directory = directory
        self.stager = DefaultStager(StagingOptions(**DCP_ASYNC["staging_options"]))
        self.pending = None
        self.last_stall_s = 0.0

    def save(self, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        if self.pending is not None:
            self.pending.upload_completion.result()
        state = {"model": module.state_dict(), "optim": optimizer.state_dict()}
        self.pending = dcp.async_save(
            state, checkpoint_id=str(self.directory / f"ckpt{step % 2}"),
            async_stager=self.stager, no_dist=True,
        )  # fmt: skip
        self.last_stall_s = time.perf_counter() - t0

    def quiesce(self) -> None:
        if self.pending is not None and not self.pending.staging_completion.done():
            t0 = time.perf_counter()
            self.pending.staging_completion.result()
            self.last_stall_s += time.perf_counter() - t0

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.upload_completion.result()

    def close(self) -> None:
        self.wait()
        self.stager.close()


def run(steps: int, every: int, batch: int, mode: str, directory: Path) -> dict:
    """``mode``: ``none`` (no checkpoints), ``async`` (Tidal's writer) or ``dcp``."""
    import warnings

    warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
    model, opt = build()
    x, y = torch.randn(batch, 2048), torch.randint(0, 10, (batch,))
    step_fn(model, opt, x, y)  # warm up allocations and momentum buffers
    if mode == "dcp":
        (directory / mode).mkdir(parents=True, exist_ok=True)
        writer = DcpAsync(directory / mode)
    else:
        writer = AsyncCheckpointer(directory / mode, keep=2, on_written=lambda w: None)

    def save(step: int) -> None:
        if mode == "dcp":
            writer.save(step, model, opt)
        else:
            writer.save(step=step, module=model, optimizer=opt, meta={})

    if mode != "none":
        for i in range(-WARMUP, 0):  # a job's steady state: see ``WARMUP``
            save(WARMUP + i)
            writer.wait()
    times, blocked = [], []
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        step_fn(model, opt, x, y, writer.quiesce)
        if mode != "none" and i % every == 1 and i > 1:
            blocked.append(writer.last_stall_s)  # save() plus the wait before this update
        if mode != "none" and i % every == 0:
            save(WARMUP + i)
        times.append(time.perf_counter() - t0)
    writer.wait()
    if mode == "dcp":
        writer.close()
    size = sum(p.numel() * 4 for p in model.parameters())
    return {"mode": mode, "step_s": times, "blocked_s": blocked, "params_mb": size / 1e6}


def summarize(steps: list[float], every: int, baseline: float) -> tuple[float, float]:
    """(extra seconds per checkpoint, as % of the baseline step)."""
    extra = sum(steps) - baseline * len(steps)
    per_ckpt = extra / max(1, len(steps) // every)
    return per_ckpt, 100 * per_ckpt / baseline


def measure(
    *,
    quick: bool = False,
    every: int = 4,
    batch: int = 128,
    steps: int | None = None,
    rounds: int | None = None,
) -> dict:
    """Run the three phases ``rounds`` times, interleaved (none, async, dcp, none, ...), and
    return the ``checkpoint_stall_pct`` row (plus details): each round's stall against its
    own baseline, and the median over rounds. A hiccup of the machine (a second of another
    process) lands in one phase of one round, not in the figure: one such second in a
    40-step phase read as ~250% of a step on the 2026-12-07 run."""
    steps = steps or (12 if quick else 40)
    rounds = rounds or (1 if quick else 3)
    torch.set_num_threads(2)
    per_round: dict[str, list[float]] = {"async": [], "dcp": []}
    blocked_all: dict[str, list[float]] = {"async": [], "dcp": []}
    baselines = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            base = run(steps, every, batch, "none", Path(tmp))
            baseline = statistics.median(base["step_s"])
            baselines.append(baseline)
            for mode in ("async", "dcp"):
                res = run(steps, every, batch, mode, Path(tmp))
                per, _ = summarize(res["step_s"], every, baseline)
                blocked = statistics.mean(res["blocked_s"]) if res["blocked_s"] else 0.0
                # The stall: the training thread's wait, or the steps' slowdown if larger.
                stall = max(blocked, per, 0.0)
                per_round[mode].append(100 * stall / baseline)
                blocked_all[mode] += res["blocked_s"]
                log(
                    f"round {r}: {mode:>5}: waits {blocked * 1000:7.1f} ms, steps slower by "
                    f"{per * 1000:7.1f} ms per checkpoint: stall {per_round[mode][-1]:6.2f}% "
                    f"of a {baseline * 1000:.0f} ms step"
                )
    baseline = statistics.median(baselines)
    log(
        f"model {base['params_mb']:.0f} MB of parameters + as much optimizer state; "
        f"baseline step {baseline * 1000:.0f} ms; a checkpoint every {every} steps"
    )
    out = {mode: statistics.median(pcts) for mode, pcts in per_round.items()}
    ratio = out["dcp"] / max(out["async"], 0.01)
    log(f"dcp.async_save stall / Tidal's = {ratio:.1f}x (median of {rounds} rounds)")
    floor = stall_floor(baseline)
    log(
        f"floor: a memcpy + page-cache write of the same bytes takes {floor['cpu_s'] * 1000:.0f} "
        f"ms of CPU; on {floor['cores']} cores that training keeps busy, at least "
        f"{floor['pct']:.0f}% of a step"
    )
    return {
        "name": "checkpoint_stall_pct",
        "tidal": out["async"],
        "peer": out["dcp"],
        "ratio": ratio,
        "unit": "% of step",
        "peer_name": "dcp.async_save",
        "peer_config": DCP_ASYNC,
        "baseline_step_s": baseline,
        "rounds_pct": per_round,
        "blocked_s": blocked_all,
        "floor": floor,
    }


def stall_floor(baseline_s: float, repeats: int = 5) -> dict:
    """The least any asynchronous checkpoint can stall a step whose compute keeps every core
    busy: the CPU of a memcpy and a page-cache write of the same bytes
    (``checkpoint_cpu.floor_cpu``, steady state), spread over the cores, against the step."""
    from bench.checkpoint_cpu import floor_cpu, tensors_of

    model, opt = build()
    step_fn(model, opt, torch.randn(8, 2048), torch.randint(0, 10, (8,)))
    tensors = tensors_of(model, opt)
    into = [torch.zeros_like(t) for t in tensors]
    cores = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        floor_cpu(tensors, into, Path(tmp) / "f")  # its page cache, reused after (``WARMUP``)
        cpu = statistics.median(floor_cpu(tensors, into, Path(tmp) / "f") for _ in range(repeats))
    return {"cpu_s": cpu, "cores": cores, "pct": 100 * cpu / cores / baseline_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    result = measure(quick=args.quick, every=args.every, batch=args.batch)
    keys = ("name", "tidal", "peer", "ratio", "unit", "peer_name", "peer_config")
    if args.json:
        args.json.write_text(json.dumps([{k: result[k] for k in keys}], indent=2))


if __name__ == "__main__":
    main()
