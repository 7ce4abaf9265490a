"""A plain PyTorch training loop, no Tidal: a classifier trained with AdamW, a warm-up and
cosine learning-rate schedule, and gradient clipping, over a DataLoader, epoch by epoch.

``examples/prepared_loop.py`` is this file with two lines added (``import tidal`` and
``tidal.prepare(...)``): ``diff examples/plain_loop.py examples/prepared_loop.py``. Both
train in float64 so that runs can be compared exactly (tests/test_prepare_e2e.py).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

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

    for epoch in range(args.epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        print(f"epoch {epoch}: loss {loss.item():.4f}, lr {sched.get_last_lr()[0]:.5f}")

    if args.save:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.save)


if __name__ == "__main__":
    main()
