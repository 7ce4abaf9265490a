"""The bench's training script: a ~5 M parameter MLP on synthetic data, two ways.

``--mode ddp``: plain PyTorch DDP, run under ``torchrun`` (reads RANK/WORLD_SIZE from it).
``--mode tidal``: the same model, data and global batch through ``tidal.Trainer``, run
under ``tidal run``.

Both write one line per step event to ``OUT/steps-PID.txt``:
``B|E wall_time step_index world_size rank`` where ``B`` is written as a step begins and
``E`` once its gradients are synchronised across the members (the end of backward; the
optimizer update follows in both modes). A torchrun restart starts again at step 0.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

torch.set_num_threads(1)  # several workers share two cores

IN, HIDDEN, OUT = 512, 2048, 10  # 5.27 M parameters


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, TensorDataset]:
    g = torch.Generator().manual_seed(1234)
    n = 64 * 50
    data = TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), data


class Recorder:
    def __init__(self, out: Path | None) -> None:
        self.fh = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self.fh = open(out / f"steps-{os.getpid()}.txt", "a", buffering=1)  # noqa: SIM115

    def __call__(self, kind: str, index: int, world: int, rank: int) -> None:
        if self.fh is not None:
            self.fh.write(f"{kind} {time.time():.6f} {index} {world} {rank}\n")


def run_ddp(args: argparse.Namespace, rec: Recorder) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, data = build(args.seed)
    ddp = DistributedDataParallel(model)
    x_all, y_all = data.tensors
    g = args.global_batch_size
    per_epoch = len(data) // g
    perm = None
    for index in range(args.steps):
        epoch, i = divmod(index, per_epoch)
        if i == 0 or perm is None:
            perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        rec("B", index, world, rank)
        batch = perm[i * g : (i + 1) * g]
        share = batch.tensor_split(world)[rank]  # contiguous shares, as Tidal's sampler
        loss = F.cross_entropy(ddp(x_all[share]), y_all[share])
        loss.backward()  # DDP averages: the mean gradient over the global batch
        rec("E", index, world, rank)
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


def run_tidal(args: argparse.Namespace, rec: Recorder) -> None:
    import tidal

    model, opt, data = build(args.seed)
    trainer = tidal.Trainer(
        model, opt, data, global_batch_size=args.global_batch_size, seed=args.seed
    )
    for step in trainer.run(max_steps=args.steps):
        rec("B", step.index, trainer.world_size, trainer.rank)
        for x, y in step.micro_batches():
            step.backward(F.cross_entropy(trainer.model(x), y))
        rec("E", step.index, trainer.world_size, trainer.rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ddp", "tidal"), required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for the per-process step records")
    args = parser.parse_args()
    rec = Recorder(args.out)
    (run_ddp if args.mode == "ddp" else run_tidal)(args, rec)


if __name__ == "__main__":
    main()
