"""Checkpoint stall: what a checkpoint costs the training step, async against sync.

``python -m bench.checkpoint_stall [--quick] [--json FILE]``

A ~100 MB MLP (25 M float32 parameters) with SGD momentum (another 100 MB of state) trains
on synthetic data, in one process, with Tidal's asynchronous checkpoint every ``--every``
steps, with the peer's and with the floor's, each in blocks alternating with blocks of no
checkpoints (the baseline, seconds away), the three writers taking turns (``run``). The peer is DCP's
``async_save`` of the same state at its best on this host (``bench.peers.DCP_ASYNC``: one
``DefaultStager`` for the run, so its staging buffers are reused; staging in its thread; the
training waits for the staging before the next optimizer update and for the previous upload
before the next save, as DCP's users do). The stall is the time the training thread waits
for the checkpoint (the save call plus the waits before the next optimizer step) or how much
longer the steps it overlaps get, whichever is larger, as a percentage of the baseline step.
Measured twice: with the training on two threads (every core busy: ``checkpoint_stall_pct``)
and on one (a core to spare: ``checkpoint_stall_spare_core_pct``, the 3.5% goal).
The floor (``FloorWriter``): a thread that copies the same bytes into memory allocated once
and writes them to one file, measured as the writers are, in the same run;
``checkpoint_stall_floor_pct`` compares Tidal's stall with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
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

#: Tidal's writer, the peer, and the floor, measured the same way, by turns (``run``).
MODES = ("async", "dcp", "floor")


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


class FloorWriter:
    """The floor, measured as the writers are: at a save, one thread copies the same tensors
    into memory allocated once, then writes them to one file and fsyncs it
    (``checkpoint_cpu.floor_cpu``'s work, no format, no checksum); the update waits for the
    copy (``quiesce``), a save for the previous write."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "floor.bin"
        self.into: list[torch.Tensor] | None = None
        self.thread: threading.Thread | None = None
        self.copied = threading.Event()
        self.last_stall_s = 0.0

    def save(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from bench.checkpoint_cpu import tensors_of

        t0 = time.perf_counter()
        self.wait()
        tensors = tensors_of(module, optimizer)
        if self.into is None:
            self.into = [torch.empty_like(t) for t in tensors]
        self.copied.clear()
        self.thread = threading.Thread(target=self._write, args=(tensors, self.into))
        self.thread.start()
        self.last_stall_s = time.perf_counter() - t0

    def _write(self, tensors: list[torch.Tensor], into: list[torch.Tensor]) -> None:
        for src, dst in zip(tensors, into, strict=True):
            dst.copy_(src)
        self.copied.set()
        with open(self.path, "wb", buffering=0) as f:
            for dst in into:
                f.write(memoryview(dst.reshape(-1).view(torch.uint8).numpy()))
            os.fsync(f.fileno())

    def quiesce(self) -> None:
        if self.thread is not None and not self.copied.is_set():
            t0 = time.perf_counter()
            self.copied.wait()
            self.last_stall_s += time.perf_counter() - t0

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def _writer(mode: str, directory: Path):  # noqa: ANN202 - one of three writer shapes
    (directory / mode).mkdir(parents=True, exist_ok=True)
    if mode == "dcp":
        return DcpAsync(directory / mode)
    if mode == "floor":
        return FloorWriter(directory / mode)
    return AsyncCheckpointer(directory / mode, keep=2, on_written=lambda w: None)


def run(pairs: int, every: int, batch: int, directory: Path) -> dict[str, dict]:
    """Every writer of ``MODES`` (``async``: Tidal's, ``dcp``, ``floor``) measured in one
    training. The steps run in blocks of ``2 * every``; each writer gets ``pairs`` pairs of
    a block without a checkpoint and one with its checkpoint saved as the block starts (the
    order swapped every pair), and the writers take turns pair by pair (the order rotated
    every round), so all three meet the same minutes of this VM. The write has the whole
    block to end (~2 s here; the wait for one that has not, the disk's latency, is recorded
    as ``tail_s``, not counted), so none of its work lands in the next block. Each writer's
    plain blocks, seconds from its checkpoint blocks, are its baseline: this shared VM's
    speed drifts by 10 to 20% over tens of seconds, and the cost of writing 200 MB with it
    (page cache reclaimed or not): writers measured one after the other read 62% against the
    floor's 76% in one run and 147% against 83% in the next."""
    import warnings

    warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
    model, opt = build()
    x, y = torch.randn(batch, 2048), torch.randint(0, 10, (batch,))
    step_fn(model, opt, x, y)  # warm up allocations and momentum buffers
    writers = {mode: _writer(mode, directory) for mode in MODES}
    saves = 0

    def save(mode: str) -> None:
        nonlocal saves
        saves += 1
        writer = writers[mode]
        if mode == "dcp":
            writer.save(saves, model, opt)
        elif mode == "floor":
            writer.save(model, opt)
        else:
            writer.save(step=saves, module=model, optimizer=opt, meta={})

    for mode, writer in writers.items():
        for _ in range(WARMUP):  # a job's steady state: see ``WARMUP``
            save(mode)
            writer.wait()
    res = {
        m: {"plain": [], "checkpoint": [], "plain_steps": [], "blocked": [], "tails": []}
        for m in MODES
    }
    for pair in range(pairs):
        turn = MODES[pair % len(MODES) :] + MODES[: pair % len(MODES)]
        for mode in turn:
            writer, r = writers[mode], res[mode]
            for on in (False, True) if pair % 2 == 0 else (True, False):
                t_block = time.perf_counter()
                if on:
                    save(mode)
                for _ in range(2 * every):
                    t0 = time.perf_counter()
                    step_fn(model, opt, x, y, writer.quiesce)
                    if not on:
                        r["plain_steps"].append(time.perf_counter() - t0)
                r["checkpoint" if on else "plain"].append(time.perf_counter() - t_block)
                if on:
                    r["blocked"].append(writer.last_stall_s)  # save() + the wait before the update
                    t0 = time.perf_counter()
                    writer.wait()  # not counted: the disk's latency, not the training's loss
                    r["tails"].append(time.perf_counter() - t0)
    for mode, writer in writers.items():
        writer.wait()
        if mode == "dcp":
            writer.close()
    size = sum(p.numel() * 4 for p in model.parameters())
    out = {}
    for mode, r in res.items():
        diffs = [c - p for c, p in zip(r["checkpoint"], r["plain"], strict=True)]
        out[mode] = {
            "mode": mode,
            "baseline_s": statistics.median(r["plain_steps"]),
            "extra_s": statistics.mean(diffs),
            # what the machine's noise leaves of ``extra_s``: the pairs' spread over sqrt(n)
            "extra_se_s": statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None,
            "blocked_s": r["blocked"],
            "tail_s": r["tails"],
            "blocks_s": {"plain": r["plain"], "checkpoint": r["checkpoint"]},
            "params_mb": size / 1e6,
        }
    return out


def measure(
    *, quick: bool = False, every: int = 4, batch: int = 128, steps: int | None = None
) -> dict:
    """Measure the writers and the floor (``MODES``, ``run``: about ``steps`` steps each) and
    return the ``checkpoint_stall_pct`` row plus details: ``floor_pct``, the floor's stall
    measured the same way, and ``spare_core``, all three with the training on one thread (a
    core left to the writer)."""
    steps = steps or (16 if quick else 192)
    pairs = max(1, steps // (4 * every))
    out, details = {}, {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        with tempfile.TemporaryDirectory() as tmp:
            results = run(pairs, every, batch, Path(tmp))
        pct = {}
        for mode, res in results.items():
            blocked = statistics.mean(res["blocked_s"]) if res["blocked_s"] else 0.0
            # The stall: the training thread's wait, or the steps' slowdown if that is larger.
            stall = max(blocked, res["extra_s"], 0.0)
            pct[mode] = 100 * stall / res["baseline_s"]
            log(
                f"{threads} training thread(s), {mode:>5}: waits {blocked * 1000:7.1f} ms, steps "
                f"slower by {res['extra_s'] * 1000:7.1f} ms (+-{(res['extra_se_s'] or 0) * 1000:.0f}) "
                f"per checkpoint: stall "
                f"{pct[mode]:6.2f}% of a {res['baseline_s'] * 1000:.0f} ms step (write ended "
                f"{statistics.median(res['tail_s']) * 1000:.0f} ms after its block, median)"
            )
        out[threads], details[threads] = pct, results
    torch.set_num_threads(2)
    baseline = details[2]["async"]["baseline_s"]
    log(
        f"model {details[2]['async']['params_mb']:.0f} MB of parameters + as much optimizer "
        f"state; baseline step {baseline * 1000:.0f} ms; a checkpoint every {every} steps; "
        f"{pairs} pairs of blocks"
    )
    ratio = out[2]["dcp"] / max(out[2]["async"], 0.01)
    log(
        f"dcp.async_save stall / Tidal's = {ratio:.1f}x; Tidal's / the floor's = "
        f"{out[2]['async'] / max(out[2]['floor'], 0.01):.2f}x"
    )
    cpu = cpu_floor(baseline)
    log(
        f"the floor's CPU: a memcpy + page-cache write of the same bytes takes "
        f"{cpu['cpu_s'] * 1000:.0f} ms, {cpu['pct']:.0f}% of a step if spread over "
        f"{cpu['cores']} cores"
    )

    def by_mode(key: str, threads: int) -> dict:
        return {m: r[key] for m, r in details[threads].items()}

    return {
        "name": "checkpoint_stall_pct",
        "tidal": out[2]["async"],
        "peer": out[2]["dcp"],
        "ratio": ratio,
        "unit": "% of step",
        "peer_name": "dcp.async_save",
        "peer_config": DCP_ASYNC,
        "baseline_step_s": baseline,
        "floor_pct": out[2]["floor"],
        "blocked_s": by_mode("blocked_s", 2),
        "blocks_s": {t: by_mode("blocks_s", t) for t in details},
        "extra_se_s": {t: by_mode("extra_se_s", t) for t in details},
        "spare_core": {
            **{m: out[1][m] for m in MODES},
            "baseline_step_s": details[1]["async"]["baseline_s"],
            "blocked_s": by_mode("blocked_s", 1),
        },
        "cpu_floor": cpu,
    }


def cpu_floor(baseline_s: float, repeats: int = 5) -> dict:
    """The floor's CPU (``checkpoint_cpu.floor_cpu``, steady state): a memcpy and a page-cache
    write of the same bytes, and what it would be in % of a step if it were spread evenly over
    the cores the training keeps busy (it is not: the training's threads wait for the one
    the writer displaced, so a measured stall is closer to the whole CPU)."""
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
