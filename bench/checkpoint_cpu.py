"""Checkpoint CPU: the CPU a checkpoint costs, per GB, against its floor in the same run.

``python -m bench.checkpoint_cpu [--quick] [--json FILE]`` (or ``python -m bench --only
checkpoint_cpu``).

The model of ``bench.checkpoint_stall`` (~100 MB of float32 parameters and as much SGD
momentum). Measured with ``time.process_time`` (every thread of the process, user and
kernel time), nothing else running in the process:

- Tidal: ``AsyncCheckpointer.save`` then ``wait`` (the snapshot copies, the files written
  from memory and hashed while written, fsync, rename, prune; ``--keep-checkpoints 2``), in
  the steady state of a training job (after ``WARMUP`` checkpoints: its snapshot memory
  allocated, and an older checkpoint pruned, whose page cache the next write reuses);
- the floor: the same tensors copied into memory allocated beforehand (a memcpy) and written
  to one file in the same folder (the page cache; the file is rewritten, so its pages are
  reused too), then fsynced: what any durable copy of these bytes costs;
- for reference (details only): the writer before this change, a fresh copy of every tensor,
  ``safetensors.torch.save_file`` and sha256 read back from the file.

Row ``checkpoint_cpu``: CPU-seconds per GB, Tidal against the floor (ratio = floor / Tidal;
the goal, at most 2x the floor, is a ratio of at least 0.5). Each is the median of
``--repeats`` checkpoints.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.checkpoint_stall import build
from tidal.checkpoint import store
from tidal.checkpoint.writer import AsyncCheckpointer

WARMUP = 3  # checkpoints before the measured ones (keep=2: the third prunes the first)


def tensors_of(model, opt) -> list[torch.Tensor]:
    """What a checkpoint of ``model`` and ``opt`` holds: parameters, buffers, optimizer state."""
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [*model.state_dict().values(), *state]


def tidal_cpu(writer: AsyncCheckpointer, model, opt, step: int) -> float:
    c0 = time.process_time()
    writer.save(step=step, module=model, optimizer=opt, meta={})
    writer.wait()
    return time.process_time() - c0


def floor_cpu(tensors: list[torch.Tensor], into: list[torch.Tensor], path: Path) -> float:
    c0 = time.process_time()
    with open(path, "wb", buffering=0) as f:
        for src, dst in zip(tensors, into, strict=True):
            dst.copy_(src)
            f.write(memoryview(dst.reshape(-1).view(torch.uint8).numpy()))
        os.fsync(f.fileno())
    return time.process_time() - c0


def previous_cpu(model, opt, directory: Path) -> float:
    """The writer before: fresh copies, safetensors' serialising ``save_file``, sha256 read
    back from the file."""
    from safetensors.torch import save_file

    c0 = time.process_time()
    snap = store.take_snapshot(step=2, module=model, optimizer=opt, meta={})
    for name, held in (("m", snap.model), ("o", snap.optimizer_tensors)):
        path = directory / f"{name}.safetensors"
        save_file(held, str(path))
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return time.process_time() - c0


def measure(*, quick: bool = False, repeats: int | None = None) -> dict:
    repeats = repeats or (3 if quick else 7)
    torch.set_num_threads(2)
    model, opt = build()
    torch.nn.functional.cross_entropy(model(torch.randn(8, 2048)), torch.zeros(8).long()).backward()
    opt.step()  # momentum buffers exist
    tensors = tensors_of(model, opt)
    gb = sum(t.numel() * t.element_size() for t in tensors) / 1e9
    into = [torch.empty_like(t) for t in tensors]
    for t in into:
        t.zero_()  # touched: the floor pays no page faults
    got: dict[str, list[float]] = {"tidal": [], "floor": [], "previous": []}
    with tempfile.TemporaryDirectory(prefix="tidal-bench-ckcpu-") as tmp:
        d = Path(tmp)
        writer = AsyncCheckpointer(d / "tidal", keep=2, on_written=lambda w: None)
        # Steady state, as in training: snapshot memory allocated, and pruned checkpoints'
        # page cache freed for the next write (on this VM, page cache the guest never used
        # costs ~7 CPU-s per GB to touch the first time, whoever writes it).
        for step in range(WARMUP):
            tidal_cpu(writer, model, opt, step)
            floor_cpu(tensors, into, d / "floor.bin")
            previous_cpu(model, opt, d)
        for i in range(repeats):  # interleaved: machine noise lands on each alike
            got["floor"].append(floor_cpu(tensors, into, d / "floor.bin"))
            got["tidal"].append(tidal_cpu(writer, model, opt, WARMUP + i))
            got["previous"].append(previous_cpu(model, opt, d))
    per_gb = {k: statistics.median(v) / gb for k, v in got.items()}
    print(
        f"checkpoint of {gb * 1000:.0f} MB: CPU-s per GB: Tidal {per_gb['tidal']:.2f}, "
        f"floor (memcpy + page-cache write + fsync) {per_gb['floor']:.2f}, "
        f"previous writer {per_gb['previous']:.2f} "
        f"(Tidal / floor = {per_gb['tidal'] / per_gb['floor']:.2f}x; goal <= 2x)"
    )
    return {
        "name": "checkpoint_cpu",
        "tidal": per_gb["tidal"],
        "peer": per_gb["floor"],
        "ratio": per_gb["floor"] / per_gb["tidal"],
        "unit": "CPU-s/GB",
        "details": {"gb": gb, "cpu_s": got, "previous_per_gb": per_gb["previous"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(quick=args.quick, repeats=args.repeats)
    keys = ("name", "tidal", "peer", "ratio", "unit")
    if args.json:
        args.json.write_text(json.dumps([{k: result[k] for k in keys}], indent=2))


if __name__ == "__main__":
    main()
