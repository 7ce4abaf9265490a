"""A small training loop that ends early or evaluates long: the fixture of
tests/test_loop_control.py, not an example.

``--stop-at S``: in the body of step S, after its backward, the script leaves the loop
(``--how break``) or calls ``trainer.stop()`` (``--how stop``); ``--stop-before`` leaves
before the step's forward instead. ``--who all`` does it on every member, ``--who rank0`` /
``--who rank1`` on the member of that rank only. ``--eval-at S --eval-s T``: rank 0 spends T
seconds in its step S body after the backward (a sleep loop: the GIL stays free, as in real
evaluation compute). Each worker writes ``OUT/worker-ID.json`` with its committed step when
its loop ends.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import tidal

torch.set_num_threads(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--out", required=True)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--how", choices=("break", "stop"), default="break")
    p.add_argument("--who", choices=("all", "rank0", "rank1"), default="all")
    p.add_argument("--stop-before", action="store_true")
    p.add_argument("--eval-at", type=int, default=None)
    p.add_argument("--eval-s", type=float, default=0.0)
    p.add_argument("--step-s", type=float, default=0.0, help="seconds to sleep per step")
    args = p.parse_args()

    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 8, generator=g)
    y = (x[:, :2].sum(1) > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = tidal.Trainer(model, opt, TensorDataset(x, y), global_batch_size=16, seed=0)

    def mine() -> bool:
        return args.who == "all" or args.who == f"rank{trainer.rank}"

    for step in trainer.run(args.max_steps):
        if args.stop_at == step.index and args.stop_before and mine():
            break
        for xb, yb in step.micro_batches():
            step.backward(F.cross_entropy(trainer.model(xb), yb))
        if args.step_s:
            time.sleep(args.step_s)
        if args.eval_at == step.index and trainer.rank == 0:
            deadline = time.monotonic() + args.eval_s
            while time.monotonic() < deadline:  # "evaluation": the GIL stays free
                time.sleep(0.05)
            tidal.log(evaluated=float(step.index))
        if args.stop_at == step.index and mine():
            if args.how == "break":
                break
            trainer.stop()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wid = os.environ.get("TIDAL_WORKER_ID", "alone")
    (out / f"worker-{wid}.json").write_text(
        json.dumps({"step": trainer.step, "completed": trainer.completed, "rank": trainer.rank})
    )


if __name__ == "__main__":
    main()
