"""The GPU check's training script (``bench.gpu`` parts a, b, d and f): a small MLP on
synthetic data in float32, through ``tidal.Trainer``, on the worker's device.

Run under ``tidal run`` or alone (``python bench/gpu/scripts/train.py``: the one-worker
reference, the same mathematics). The Trainer picks the device (``Trainer(device=None)``:
the worker's GPU where CUDA exists, else the CPU); ``--device`` forces one, and
``--expect-device`` makes the script fail unless the model ended up on that kind of
device (``cuda`` or ``cpu``), so a run that silently trained on the CPU is not mistaken for
a GPU run.

With ``--out DIR`` every worker that finishes writes ``DIR/w{ID}.json`` (its id, device,
the process-group backends its steps ran under, the committed steps) and, when the job
completed, ``DIR/params-w{ID}.safetensors`` (its final parameters, on the CPU); alone, the
id is ``alone``.

``--sharding`` is the Trainer's (``ddp`` or ``fsdp``); ``--sharding-file FILE`` reads it
from FILE instead, when the script starts: part (f) resumes one job's sharded checkpoint at
another sharding, and ``tidal resume`` runs the script with the arguments it was started
with.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import tidal

torch.set_num_threads(1)  # several workers may share a few cores

IN, HIDDEN, OUT = 64, 256, 10


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, TensorDataset]:
    g = torch.Generator().manual_seed(1234)
    n = 48 * 40
    x = torch.randn(n, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, OUT, generator=g)).argmax(1)  # a learnable target
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=80)
    parser.add_argument("--global-batch-size", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="force a device (default: the Trainer's choice)")
    parser.add_argument("--expect-device", choices=("cuda", "cpu"))
    parser.add_argument("--pin-memory", action="store_true", help="Trainer(pin_memory=True)")
    parser.add_argument("--out", type=Path, help="folder for the result files")
    parser.add_argument("--sharding", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--sharding-file", type=Path, help="read --sharding from this file")
    args = parser.parse_args()
    if args.sharding_file is not None:
        args.sharding = args.sharding_file.read_text().strip()

    model, opt, data = build(args.seed)
    kwargs = {"device": args.device} if args.device else {}  # tidal: the default picks the GPU
    trainer = tidal.Trainer(
        model,
        opt,
        data,
        global_batch_size=args.global_batch_size,
        seed=args.seed,
        pin_memory=args.pin_memory,
        sharding=args.sharding,
        **kwargs,
    )
    # where the Trainer put the model (under fsdp the module passed becomes the template)
    device = trainer.device if args.sharding == "fsdp" else next(model.parameters()).device
    if args.expect_device and device.type != args.expect_device:
        raise SystemExit(
            f"gpu_train: the model is on {device}, expected {args.expect_device} "
            f"(Trainer.device: {getattr(trainer, 'device', 'not there')})"
        )
    backends: set[str] = set()
    batch_devices: set[str] = set()
    for step in trainer.run(max_steps=args.max_steps):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            backends.add(str(torch.distributed.get_backend()))
        for x, y in step.micro_batches():
            batch_devices.add(x.device.type)
            loss = F.cross_entropy(trainer.model(x), y)
            step.backward(loss)
        if step.index % 20 == 0 and trainer.rank == 0:
            tidal.log(loss=loss.item())
    if args.expect_device and batch_devices - {args.expect_device}:
        raise SystemExit(f"gpu_train: batches arrived on {sorted(batch_devices)}")

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        wid = "alone" if trainer.worker_id is None else str(trainer.worker_id)
        info = {
            "worker_id": wid,
            "pid": os.getpid(),
            "device": str(device),
            "trainer_device": str(getattr(trainer, "device", device)),
            "backends": sorted(backends),
            "batch_devices": sorted(batch_devices),
            "completed": trainer.completed,
            "step": trainer.step,
            "sharding": args.sharding,
        }
        final = trainer.full_state_dict() if trainer.completed else None  # rank 0's
        if final is not None:
            state = {k: v.detach().cpu().contiguous() for k, v in final.items()}
            safetensors.torch.save_file(state, str(args.out / f"params-w{wid}.safetensors"))
        (args.out / f"w{wid}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
