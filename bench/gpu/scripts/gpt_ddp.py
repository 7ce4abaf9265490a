"""The peer of ``bench.gpu`` part (c): ``examples/gpt.py``'s training loop in plain PyTorch
DDP, run under ``torchrun``. The same model, data, global batch, optimizer (AdamW),
learning-rate schedule, gradient clipping and EMA as the example (imported from it), fed by
a ``DataLoader`` with a ``DistributedSampler``; NCCL on CUDA, gloo on the CPU.

Writes ``B wall_time step generation backend device_bytes`` to ``OUT/steps-PID.txt`` as each
step begins, the format of ``bench/gpu/hooks`` for the Tidal side, so both sides are
measured alike (``bench.gpu.speed.samples_per_s``).
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler

ROOT = Path(__file__).resolve().parents[3]


def load_example():
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    gpt = load_example()  # sets torch's threads to 1, as the example does
    parser = gpt.arguments()  # the example's own flags and defaults: the same run
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from tidal.data import TokenShards

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_path, val_path = gpt.token_files(args.data_dir, args.files)
    train_set = TokenShards(train_path, args.context)
    val_all = TokenShards(val_path, args.context)
    pick = torch.linspace(0, len(val_all) - 1, min(args.val_windows, len(val_all))).long()
    val = torch.stack([val_all[i] for i in pick]).to(device)

    torch.manual_seed(args.seed)
    model = gpt.GPT(dim=args.dim, layers=args.layers, heads=args.heads, context=args.context)
    model.to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, gpt.warmup_cosine(args.warmup, args.max_steps)
    )
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema))
    ddp = DistributedDataParallel(model, device_ids=[local] if cuda else None)
    sampler = DistributedSampler(
        train_set, world, rank, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(
        train_set,
        batch_size=args.global_batch_size // world,
        sampler=sampler,
        drop_last=True,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )

    args.out.mkdir(parents=True, exist_ok=True)
    backend = dist.get_backend()
    with open(args.out / f"steps-{os.getpid()}.txt", "a", buffering=1) as rec:
        index, epoch = 0, 0
        while index < args.max_steps:
            sampler.set_epoch(epoch)
            for chunk in loader:
                if index >= args.max_steps:
                    break
                used = torch.cuda.memory_allocated(device) if cuda else 0
                rec.write(f"B {time.time():.6f} {index} 0 {backend} {used}\n")
                chunk = chunk.to(device, non_blocking=True)
                logits = ddp(chunk[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                ema.update_parameters(model)
                if index % args.eval_every == 0 and rank == 0:
                    val_loss = gpt.evaluate(model, val)
                    print(
                        f"step {index}: loss {loss.item():.4f}, val_loss {val_loss:.4f}", flush=True
                    )
                index += 1
            epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
