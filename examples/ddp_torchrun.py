"""A plain DDP training script written for torchrun, nothing of Tidal in it: it runs the same
under ``torchrun --nproc-per-node 2 examples/ddp_torchrun.py`` and under ``tidal run
--torchrun --workers 2 examples/ddp_torchrun.py`` (docs/porting.md, "Unmodified: --torchrun").

As torchrun's fault-tolerance tutorial has it: the process group from ``env://``, a
``DistributedSampler``, and a snapshot of its own (the step, the model's and the
optimizer's state) that rank 0 saves every ``--save-every`` steps and every start loads,
so a restarted world (after a failure, or a change of size) resumes where it was.

``--record FILE``: each worker appends one JSON line when it starts (``rank``, ``world``,
``restart_count``, ``resumed_step``) and rank 0 one per step (``step``, ``t``, ``world``):
what the tests and ``bench`` read.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--snapshot", default="snapshot.pt", help="the snapshot file")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds added to each step")
    p.add_argument("--record", help="append JSON lines here (see the docstring)")
    return p.parse_args()


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(4096, 1, generator=g)
    return TensorDataset(x, y)


def note(path: str | None, **record: object) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def save(path: str, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    tmp = f"{path}.tmp"
    torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, path)  # a reader never sees half a snapshot


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    step = 0
    if os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot, weights_only=True)
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        step = snap["step"]
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    note(args.record, rank=rank, world=world, restart_count=restarts, resumed_step=step)
    ddp = DDP(model)
    dataset = data()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    per_epoch = len(loader)
    while step < args.max_steps:
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        for x, y in itertools.islice(loader, skip, None):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if args.sleep:
                time.sleep(args.sleep)
            if rank == 0:
                note(args.record, step=step, t=time.time(), world=world, loss=loss.item())
                if step % args.save_every == 0 or step == args.max_steps:
                    save(args.snapshot, step, model, opt)
            if step >= args.max_steps:
                break
    dist.barrier()  # rank 0's last snapshot is written before anyone leaves
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
