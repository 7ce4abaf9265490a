"""The loop of ``examples/plain_loop.py`` written for ``tidal.Trainer`` instead: the Trainer
owns the loop's steps (``trainer.run``), the batches (``step.micro_batches()``), the
optimizer's and scheduler's steps and the clipping (``lr_scheduler=``, ``clip_grad_norm=``).
``examples/prepared_loop.py`` keeps the plain loop and adds one ``tidal.prepare`` line
instead (docs/porting.md compares the three). All three train the same parameters alone.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import tidal

torch.set_num_threads(1)  # several workers may share a few cores
torch.set_default_dtype(torch.float64)


def blobs(n: int = 1200, classes: int = 6, features: int = 16) -> TensorDataset:
    """Points around one centre per class, with overlapping noise (made here: no download)."""
    g = torch.Generator().manual_seed(0)
    centres = 0.6 * torch.randn(classes, features, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centres[labels] + torch.randn(n, features, generator=g), labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--save", metavar="PATH", help="write the final parameters here")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 6))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loader = DataLoader(blobs(), batch_size=args.batch_size)
    total, warmup = args.epochs * len(loader), 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * s / total)),
    )

    trainer = tidal.Trainer(
        model,
        opt,
        loader,
        global_batch_size=args.batch_size,
        shuffle=False,
        lr_scheduler=sched,
        clip_grad_norm=1.0,
    )
    for step in trainer.run(max_steps=total):
        for x, y in step.micro_batches():
            loss = F.cross_entropy(trainer.model(x), y)
            step.backward(loss)
        if (step.index + 1) % len(loader) == 0:
            epoch = step.index // len(loader)
            print(f"epoch {epoch}: loss {loss.item():.4f}")

    if args.save and trainer.completed and trainer.rank == 0:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.save)


if __name__ == "__main__":
    main()
