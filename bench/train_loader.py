"""The input-pipeline bench's training script: the bench MLP fed by a map-style dataset whose
samples cost ~2 ms of CPU each (a decode/augment stand-in), two ways.

``--mode ddp``: plain PyTorch under ``torchrun``: ``DistributedSampler`` and a
``DataLoader(batch_size=G / world, num_workers=N)``, DDP. ``--mode tidal``: the same model,
dataset and global batch through ``tidal.Trainer(..., num_workers=N)`` under ``tidal run``.

Both write ``B|E wall_time step_index world_size rank`` lines to ``OUT/steps-PID.txt`` as
``train_mlp.py`` does: ``B`` before the step's data is fetched, ``E`` once its gradients are
synchronised. The dataset is large enough that no run reaches a second epoch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from train_mlp import IN, OUT, Recorder, build  # the sibling script (sys.path[0] is bench/)

torch.set_num_threads(1)  # several workers share two cores

ROUNDS = 180  # tanh rounds on 512 floats: ~2 ms of one core on the bench machine


class Decoded(Dataset):
    """Sample ``i``: 512 features drawn from a generator seeded ``i``, then ``ROUNDS`` rounds
    of elementwise work folded into them (deterministic; ~2 ms), and the label ``i % 10``."""

    def __init__(self, n: int, rounds: int = ROUNDS) -> None:
        self.n, self.rounds = n, rounds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = np.random.default_rng(int(i)).standard_normal(IN).astype(np.float32)
        y = x
        for _ in range(self.rounds):
            y = np.tanh(y * 1.5 + 0.1)
        return torch.from_numpy(x + 1e-3 * y), int(i) % OUT


def run_ddp(args: argparse.Namespace, rec: Recorder) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, _ = build(args.seed)
    ddp = DistributedDataParallel(model)
    data = Decoded(args.global_batch_size * (args.steps + 1))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(
        data,
        batch_size=args.global_batch_size // world,
        sampler=sampler,
        num_workers=args.num_workers,
        persistent_workers=args.persistent_workers,
        drop_last=True,
    )
    batches = iter(loader)
    for index in range(args.steps):
        rec("B", index, world, rank)
        x, y = next(batches)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        rec("E", index, world, rank)
        opt.step()
        opt.zero_grad(set_to_none=True)
    del batches
    dist.destroy_process_group()


def run_tidal(args: argparse.Namespace, rec: Recorder) -> None:
    import tidal

    model, opt, _ = build(args.seed)
    data = Decoded(args.global_batch_size * (args.steps + 1))
    trainer = tidal.Trainer(
        model,
        opt,
        data,
        global_batch_size=args.global_batch_size,
        seed=args.seed,
        num_workers=args.num_workers,
        persistent_workers=args.persistent_workers,
    )
    for step in trainer.run(max_steps=args.steps):
        rec("B", step.index, trainer.world_size, trainer.rank)
        for x, y in step.micro_batches():
            step.backward(F.cross_entropy(trainer.model(x), y))
        rec("E", step.index, trainer.world_size, trainer.rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ddp", "tidal"), required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--persistent-workers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for the per-process step records")
    args = parser.parse_args()
    rec = Recorder(args.out)
    (run_ddp if args.mode == "ddp" else run_tidal)(args, rec)


if __name__ == "__main__":
    main()
