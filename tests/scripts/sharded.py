"""A float64 (or ``--dtype float32``) transformer-like model trained with ``sharding="fsdp"`` (or ``"ddp"`` for the
reference), AdamW, a warmup LR scheduler and gradient clipping. Test fixture of
tests/test_fsdp_e2e.py, not an example.

Each member that finishes writes ``OUT/worker-ID.safetensors``, the rows it holds of every
parameter (``p.NAME``) and of every optimizer state tensor (``o.NAME.KEY``), and
``OUT/worker-ID.json`` (its layout: world size and rank; step; lr). A DDP member holds every
row (world 1, rank 0). Rank 0 also writes ``OUT/full.safetensors`` from
``trainer.full_state_dict()``. So a test compares every member's shard with the same rows
of a one-worker run, not only rank 0's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import tidal

torch.set_num_threads(1)

VOCAB, WIDTH, SEQ, HEADS = 29, 16, 8, 2


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.ln2 = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Progressions(Dataset):
    """Sample ``i``: SEQ + 1 tokens of an arithmetic progression mod VOCAB, from ``i``."""

    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        a, b = i % VOCAB, 1 + (i // VOCAB) % (VOCAB - 1)
        return (a + b * torch.arange(SEQ + 1)) % VOCAB, i


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--sharding", default="fsdp")
    p.add_argument("--out", required=True)
    p.add_argument("--slow", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    args = p.parse_args()
    torch.set_default_dtype(getattr(torch, args.dtype))

    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 10))
    trainer = tidal.Trainer(
        model,
        opt,
        Progressions(),
        global_batch_size=24,
        micro_batch_size=8,
        lr_scheduler=sched,
        clip_grad_norm=0.5,
        sharding=args.sharding,
    )
    for step in trainer.run(max_steps=args.max_steps):
        for seq, _ids in step.micro_batches():
            logits = trainer.model(seq[:, :-1])
            step.backward(F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1)))
        time.sleep(args.slow)
    if not trainer.completed:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wid = trainer.worker_id if trainer.worker_id is not None else os.getpid()
    if trainer._parts.sharded.fsdp is not None:  # a test reads the member's own rows
        held = trainer._parts.sharded.fsdp.sharded.held()
        world, rank = held.layout.world, held.layout.rank
        tensors = {".".join(k): v.contiguous() for k, v in held.rows.items()}
    else:
        world, rank = 1, 0
        tensors = {f"p.{n}": v.detach().contiguous() for n, v in model.named_parameters()}
        names = {id(v): n for n, v in model.named_parameters()}
        for param, state in opt.state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim():
                    tensors[f"o.{names[id(param)]}.{k}"] = v.contiguous()
    safetensors.torch.save_file(tensors, str(out / f"worker-{wid}.safetensors"))
    facts = {"world": world, "rank": rank, "step": trainer.step, "lr": sched.get_last_lr()[0]}
    (out / f"worker-{wid}.json").write_text(json.dumps(facts))
    full = trainer.full_state_dict()
    if full is not None:
        safetensors.torch.save_file(
            {k: v.contiguous() for k, v in full.items()}, str(out / "full.safetensors")
        )


if __name__ == "__main__":
    main()
