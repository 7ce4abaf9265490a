"""A training loop that carries everything issue 12 names: a warmup + cosine LR scheduler, an
EMA model, gradient clipping, a GradScaler (enabled, on CPU), and a counter of its own, in
float64. Test fixture of tests/test_tracked_e2e.py, not an example.

Each member that finishes writes ``OUT/worker-ID.safetensors`` (parameters and EMA
parameters) and ``OUT/worker-ID.json`` (scheduler, scaler, counter, step), so a test can
compare every member with a one-worker run, not only rank 0.

``--ema-in-body`` updates the EMA in the step body, after the micro-batches (before the
step's optimizer update, as tutorials write it), instead of in ``trainer.after_step``: a
step that fails has then changed the EMA in place, and the Trainer must rewind it.

``--inf-at S`` poisons the micro-batch that holds the first sample of step S's global batch
with an infinite loss (whatever the split, exactly one micro-batch holds it): the GradScaler
must skip step S on every member.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset

import tidal

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)


class Counter:
    """The script's own state: the job's samples (moved inside the step, before it is known
    to succeed) and steps committed (moved in ``after_step``)."""

    def __init__(self) -> None:
        self.samples = 0
        self.steps = 0

    def state_dict(self) -> dict:
        return {"samples": self.samples, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.samples, self.steps = state["samples"], state["steps"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument("--out", required=True)
    p.add_argument("--inf-at", type=int, default=None)
    p.add_argument("--slow", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument("--ema-in-body", action="store_true")
    args = p.parse_args()

    g = torch.Generator().manual_seed(7)
    x = torch.randn(768, 12, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    ids = torch.arange(len(x))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    warmup = 10

    def schedule(e: int) -> float:  # linear warmup, then cosine to 10%
        if e < warmup:
            return (e + 1) / warmup
        t = min(1.0, (e - warmup) / max(1, args.max_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=25)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.95))
    counter = Counter()
    trainer = tidal.Trainer(
        model,
        opt,
        TensorDataset(x, y, ids),
        global_batch_size=48,
        micro_batch_size=16,
        lr_scheduler=sched,
        grad_scaler=scaler,
        clip_grad_norm=1.0,
        state={"ema": ema, "counter": counter},
    )

    @trainer.after_step
    def _(index: int) -> None:
        if not args.ema_in_body:
            ema.update_parameters(model)
        counter.steps += 1

    poison = None
    if args.inf_at is not None:
        poison = int(trainer.sampler.shard(args.inf_at, 0, 1)[0])
    for step in trainer.run(max_steps=args.max_steps):
        for xb, yb, ib in step.micro_batches():
            loss = F.cross_entropy(trainer.model(xb), yb)
            if step.index == args.inf_at and bool((ib == poison).any()):
                loss = loss * float("inf")
            step.backward(loss)
        # Moved inside the step, before the step is known to have succeeded: a step that
        # fails must leave it as it was (the Trainer rewinds it), else it counts twice.
        counter.samples += trainer.sampler.global_batch_size
        if args.ema_in_body:  # in place, before the step is known to have succeeded
            ema.update_parameters(model)
        time.sleep(args.slow)
    if not trainer.completed:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wid = trainer.worker_id if trainer.worker_id is not None else os.getpid()
    tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    tensors |= {f"ema.{k}": v.contiguous() for k, v in ema.state_dict().items()}
    safetensors.torch.save_file(tensors, str(out / f"worker-{wid}.safetensors"))
    facts = {
        "step": trainer.step,
        "last_epoch": sched.last_epoch,
        "lr": sched.get_last_lr()[0],
        "scale": scaler.get_scale(),
        "growth_tracker": scaler.state_dict()["_growth_tracker"],
        "counter": counter.state_dict(),
    }
    (out / f"worker-{wid}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
