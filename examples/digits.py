"""Train an MLP on scikit-learn's bundled digits data set (no download) with Tidal.

This is a plain PyTorch training script; the lines marked ``# tidal`` are the only ones that
differ from an ordinary loop:

- ``tidal.Trainer(...)`` takes the model, optimizer and dataset instead of a DataLoader;
- ``trainer.run(max_steps)`` yields the steps, ``step.micro_batches()`` this worker's share
  of the global batch, and ``step.backward(loss)`` replaces ``loss.backward()`` (the optimizer
  step and zero_grad happen inside ``trainer.run``);
- ``trainer.model`` is the module to call in the loop (the DDP wrapper under ``tidal run``);
- ``tidal.log(...)`` records metrics for the step in flight (the job's status keeps the latest,
  the dashboard and TensorBoard one point per step).

Run alone (``python examples/digits.py``) it trains on one process with the same mathematics;
under ``tidal run`` workers may join, leave or fail while it trains.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import tidal

torch.set_num_threads(1)  # several workers may share a few cores

TEST_SIZE = 297


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (1,797 images of 8x8 pixels and their labels), what
    ``sklearn.datasets.load_digits`` returns, read from the file scikit-learn ships without
    importing scikit-learn: that import costs ~1.5 s in every worker process that starts."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():  # another layout: ask scikit-learn itself
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.data, bunch.target
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def load_data() -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """The train set, and a held-out test set fixed whatever ``--seed`` is."""
    data, target = digits()
    x = torch.tensor(data, dtype=torch.get_default_dtype()) / 16.0
    y = torch.tensor(target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    train, test = order[:-TEST_SIZE], order[-TEST_SIZE:]
    return TensorDataset(x[train], y[train]), x[test], y[test]


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Held-out (loss, accuracy)."""
    logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", metavar="PATH", help="write the final parameters here")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument(
        "--double", action="store_true", help="train in float64 (exactness tests compare runs)"
    )
    parser.add_argument(
        "--device", default=None, help="cpu or cuda (default: the worker's GPU where CUDA exists)"
    )
    args = parser.parse_args()
    if args.double:
        torch.set_default_dtype(torch.float64)

    train_set, x_test, y_test = load_data()
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    # SGD with momentum: well conditioned, so runs that differ only in float32 summation
    # order (1 worker or 3) stay within 1e-6 of each other. Adam with eps=1e-8 amplifies
    # that rounding once gradients get tiny (1e-3 apart after 300 steps here).
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    trainer = tidal.Trainer(  # tidal
        model,
        optimizer,
        train_set,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        seed=args.seed,
        device=args.device,
    )
    x_test, y_test = x_test.to(trainer.device), y_test.to(trainer.device)
    for step in trainer.run(max_steps=args.max_steps):  # tidal
        for x, y in step.micro_batches():  # tidal
            loss = F.cross_entropy(trainer.model(x), y)  # tidal: trainer.model
            step.backward(loss)  # tidal
        if step.index % args.log_every == 0:
            _, acc = evaluate(model, x_test, y_test)
            tidal.log(loss=loss.item(), accuracy=acc)  # tidal
            if trainer.rank == 0:
                print(f"step {step.index}: loss {loss.item():.4f}, accuracy {acc:.4f}", flush=True)

    test_loss, acc = evaluate(model, x_test, y_test)
    # After the loop the step is the final count: these are one more point, at step max_steps
    # (named apart from the loop's: its loss is the training batch's).
    tidal.log(test_accuracy=acc, test_loss=test_loss)  # tidal
    print(f"done after {trainer.step} steps: held-out accuracy {acc:.4f}, loss {test_loss:.4f}")
    if args.save and trainer.completed and trainer.rank == 0:
        state = {name: p.detach().cpu().contiguous() for name, p in model.state_dict().items()}
        safetensors.torch.save_file(state, args.save)


if __name__ == "__main__":
    main()
