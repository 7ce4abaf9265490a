"""Train a small GPT (decoder-only transformer) on the Python standard library's source with Tidal.

The text ships with every Python install: the ``.py`` files at the top of the standard
library's folder, in sorted order, read as bytes (256 tokens). Every tenth file is held out,
so the validation loss is measured on files the model never saw. The unigram baseline is the
loss of predicting each byte by its frequency in the training files; ``val_loss`` and
``unigram_loss`` are measured on the same held-out tokens.

The example tokenizes once, as a language-model job would: it writes ``train.bin`` and
``val.bin`` (flat uint16 token files, nanoGPT's layout) under ``--data-dir``, in a folder named
after the text they hold, and trains on ``tidal.data.TokenShards`` over them: windows read from
the memory-mapped files by global index, fetched by ``--num-workers`` DataLoader worker
processes a step ahead. Every worker of the job finds the files or writes them itself; each
write is atomic, so workers starting at once never read half a file.

The lines marked ``# tidal`` are the ones that differ from a plain PyTorch loop. The learning
rate follows a standard ``torch.optim.lr_scheduler`` (linear warm-up, then cosine decay),
handed to the Trainer, which steps it once per committed step and carries its state to
joiners, checkpoints and resumes; an EMA of the weights (``AveragedModel``, updated in an
``after_step`` hook) is carried the same way through ``state=``, and the held-out loss is
measured with it too. ``--clip`` clips the synchronised gradients' norm. ``--autocast bf16``
runs forward passes under ``torch.autocast`` in bfloat16 (CPU included); the loss and the
weights stay float32. ``--compile`` compiles the model with ``torch.compile``
(``nn.Module.compile``: in place, so the parameter names and DDP's wrapping are unchanged).

The loss is token-weighted: each micro-batch's loss is the SUM of its tokens' losses, passed
as ``step.backward(loss, items=tokens)``, so the update is the mean over every counted token
of the global batch whatever the split. ``--ragged`` makes that matter: each window then
holds a document of its own length (from 8 tokens to the context, fixed by the window's
first bytes), the positions past it padded and labelled -100 (ignored), as a fine-tuning
set of ragged sequences is; a per-micro-batch token mean would make the update depend on
how the global batch was split across the workers.

Run alone (``python examples/gpt.py``) it trains on one process with the same mathematics.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import tidal
from tidal.data import TokenShards, write_tokens
from tidal.devices import resolve_device

torch.set_num_threads(1)  # several workers may share a few cores

VOCAB = 256  # bytes
HELD_OUT_EVERY = 10  # every tenth file (in sorted order) is held out


# -- data ---------------------------------------------------------------------------------
def stdlib_files(limit: int | None = None) -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted: the same list on every run."""
    files = sorted(Path(os.path.dirname(os.__file__)).glob("*.py"))
    return files[:limit] if limit else files


def load_text(files: list[Path]) -> tuple[bytes, bytes]:
    """(train, held-out) bytes; the split is by file."""
    train, held_out = bytearray(), bytearray()
    for i, path in enumerate(files):
        (held_out if i % HELD_OUT_EVERY == 0 else train).extend(path.read_bytes())
    if not train or not held_out:
        raise ValueError(f"{len(files)} files: too few for a training and a held-out part")
    return bytes(train), bytes(held_out)


def token_files(data_dir: Path, limit: int | None = None) -> tuple[Path, Path]:
    """``train.bin`` and ``val.bin`` for these files, written on first use.

    The folder's name is a hash of the Python version and the files' names and sizes, so a
    different ``--files`` or another Python's standard library gets its own token files.
    """
    files = stdlib_files(limit)
    key = hashlib.sha256(sys.version.encode())
    for path in files:
        key.update(f"{path.name}:{path.stat().st_size}\n".encode())
    folder = data_dir / f"stdlib-{key.hexdigest()[:12]}"
    train, val = folder / "train.bin", folder / "val.bin"
    if not (train.is_file() and val.is_file()):
        text = load_text(files)
        for path, part in zip((train, val), text, strict=True):  # bytes are the tokens
            write_tokens(path, np.frombuffer(part, dtype=np.uint8), dtype=np.uint16)
    return train, val


def unigram_loss(train: torch.Tensor, targets: torch.Tensor) -> float:
    """Cross-entropy (nats) of predicting ``targets`` by the training bytes' frequencies."""
    counts = torch.bincount(train, minlength=VOCAB).double() + 1.0  # add-one smoothing
    log_p = (counts / counts.sum()).log()
    return -log_p[targets].mean().item()


# -- model --------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Pre-LayerNorm decoder-only transformer; the output layer shares the token embedding."""

    def __init__(self, *, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)
        for block in self.blocks:  # each block starts as the identity: faster early training
            nn.init.zeros_(block.proj.weight)
            nn.init.zeros_(block.out.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        return self.ln(self.blocks(x)) @ self.tok.weight.T


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, batch: int = 32) -> float:
    """Mean next-byte cross-entropy (nats) over the held-out windows (no dropout here, so
    no eval mode either: a compiled model would recompile for it)."""
    total = 0.0
    for chunk in val.split(batch):
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
    return total.item() / val[:, 1:].numel()


IGNORE = -100  # cross_entropy's ignore_index: padding


def padded_labels(chunk: torch.Tensor) -> torch.Tensor:
    """Next-token labels of ragged documents: each window's document is 8 tokens to the
    whole context long (fixed by its first two bytes, so the same on every worker and run);
    the positions past it are padding, labelled ``IGNORE``."""
    context = chunk.shape[1] - 1
    lengths = 8 + (chunk[:, 0] * 31 + chunk[:, 1]) % max(1, context - 7)
    past = torch.arange(context, device=chunk.device)[None, :] >= lengths[:, None]
    return chunk[:, 1:].masked_fill(past, IGNORE)


def warmup_cosine(warmup: int, total: int):
    """The LR factor of step ``e``: linear warm-up, then cosine decay to a tenth."""

    def factor(e: int) -> float:
        if e < warmup:
            return (e + 1) / warmup
        progress = min(1.0, (e - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def arguments() -> argparse.ArgumentParser:
    """The example's flags (``bench.gpu``'s DDP peer reads the same ones)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--global-batch-size", type=int, default=32, help="windows a step")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--files", type=int, default=None, help="use the first N files only")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(".tidal-data") / "gpt",
        help="where the token files are written once (default: .tidal-data/gpt)",
    )
    parser.add_argument(
        "--num-workers", type=int, default=2, help="DataLoader worker processes per worker"
    )
    parser.add_argument("--val-windows", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", metavar="PATH", help="write the final parameters here")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument(
        "--ragged", action="store_true", help="documents of ragged lengths, padded (-100)"
    )
    parser.add_argument("--ema", type=float, default=0.99, help="EMA decay of the weights")
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    parser.add_argument(
        "--autocast",
        choices=["off", "bf16", "fp16"],
        default="off",
        help="forward in bfloat16, or float16 with a GradScaler",
    )
    parser.add_argument(
        "--device", default=None, help="cpu or cuda (default: the worker's GPU where CUDA exists)"
    )
    return parser


def main() -> None:
    args = arguments().parse_args()
    # tidal: the Trainer's own rule (None: the worker's GPU, else the CPU); resolved first so
    # that the model, the EMA copy and the held-out windows are made on the device.
    device = resolve_device(args.device, cuda_available=torch.cuda.is_available())

    train_path, val_path = token_files(args.data_dir, args.files)
    train_set = TokenShards(train_path, args.context)  # tidal: windows by global index
    val_all = TokenShards(val_path, args.context)
    pick = torch.linspace(0, len(val_all) - 1, min(args.val_windows, len(val_all))).long()
    val = torch.stack([val_all[i] for i in pick]).to(device)  # over every held-out file
    train_tokens = torch.from_numpy(np.fromfile(train_path, dtype=np.uint16).astype(np.int64))
    baseline = unigram_loss(train_tokens, val[:, 1:].flatten().cpu())

    torch.manual_seed(args.seed)
    model = GPT(dim=args.dim, layers=args.layers, heads=args.heads, context=args.context)
    model.to(device)
    if args.compile:
        model.compile()  # in place: same parameter names, DDP wraps it as usual
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{params / 1e6:.2f}M parameters; {len(train_tokens)} training bytes, "
        f"{val_all.tokens} held-out bytes; unigram loss {baseline:.4f}",
        flush=True,
    )

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(args.warmup, args.max_steps)
    )
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema))
    trainer = tidal.Trainer(  # tidal
        model,
        optimizer,
        train_set,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        seed=args.seed,
        num_workers=args.num_workers,  # tidal: DataLoader worker processes fetch the windows
        persistent_workers=args.num_workers > 0,  # the same processes after a resize
        lr_scheduler=scheduler,  # tidal: stepped once per committed step, and carried
        clip_grad_norm=args.clip,  # tidal: on the synchronised gradients
        state={"ema": ema},  # tidal: carried to joiners, checkpoints, resumes
        grad_scaler=torch.amp.GradScaler(device.type) if args.autocast == "fp16" else None,
        device=device,  # tidal: every micro-batch arrives there
    )

    @trainer.after_step  # tidal: once per committed step, after the optimizer step
    def update_ema(index: int) -> None:
        ema.update_parameters(model)

    half = torch.float16 if args.autocast == "fp16" else torch.bfloat16
    autocast = torch.autocast(device.type, dtype=half, enabled=args.autocast != "off")
    for step in trainer.run(max_steps=args.max_steps):  # tidal
        for chunk in step.micro_batches():  # tidal: windows of context + 1 tokens
            with autocast:
                logits = trainer.model(chunk[:, :-1])  # tidal: trainer.model
            labels = padded_labels(chunk) if args.ragged else chunk[:, 1:]
            tokens = int((labels != IGNORE).sum())
            total = F.cross_entropy(
                logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
            )
            step.backward(total, items=tokens)  # tidal: the global token mean, exactly
            loss = total.detach() / max(tokens, 1)
        if step.index % args.eval_every == 0 and trainer.rank == 0:
            val_loss = evaluate(model, val)
            tidal.log(loss=loss.item(), val_loss=val_loss, unigram_loss=baseline)  # tidal
            print(
                f"step {step.index}: loss {loss.item():.4f}, val_loss {val_loss:.4f} "
                f"({val_loss / baseline:.1%} of unigram {baseline:.4f}), "
                f"lr {scheduler.get_last_lr()[0]:.2e}",
                flush=True,
            )

    if trainer.completed and trainer.rank == 0:
        val_loss = evaluate(model, val)
        ema_loss = evaluate(ema.module, val)
        tidal.log(val_loss=val_loss, ema_val_loss=ema_loss, unigram_loss=baseline)  # tidal
        print(
            f"done after {trainer.step} steps: val_loss {val_loss:.4f}, ema_val_loss "
            f"{ema_loss:.4f}, unigram_loss {baseline:.4f} ({val_loss / baseline:.1%})",
            flush=True,
        )
        if args.save:
            state = {n: p.detach().cpu().contiguous() for n, p in model.state_dict().items()}
            safetensors.torch.save_file(state, args.save)


if __name__ == "__main__":
    main()
