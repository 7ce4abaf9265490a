"""Loops written the ways users write them (issue 49), in float64. Test fixture of
tests/test_script_forms_e2e.py, not an example.

``--form``:

- ``items``: a tiny next-token model over ragged, padded token sequences; each micro-batch's
  loss is the SUM of its tokens' cross-entropies (padding labelled -100, ignored) and
  ``step.backward(loss, items=tokens)``: the update is the global token mean at any split;
- ``unused``: two heads, the second used on odd steps only, under
  ``ddp_kwargs={"find_unused_parameters": True}``;
- ``eval``: per-sample means, and ``trainer.evaluate`` over a held-out set at steps
  ``EVAL_AT`` on every member; each member records the means it got;
- ``compressed``: ``unused`` with the gradients all-reduced in bfloat16
  (``ddp_kwargs={"compression": "bf16"}``): not exact, but the same on every member;
- ``gan``: a generator and a discriminator, each with its own optimizer (Adam and SGD with
  momentum) handed as ``[opt_g, opt_d]``; each network's loss reaches only its own
  parameters (the generator's through a detached copy of the discriminator);
- ``items-ref``: the ``items`` data and model in a plain loop without Tidal, one process:
  each step's global batch (Tidal's sample order) in one forward, the loss its token sum
  over its token count;
- ``raw``: the forward calls the module given to the Trainer, not ``trainer.model``: refused
  at the first step under ``tidal run`` (its gradients are never all-reduced);
- ``bare``: ``loss.backward()`` instead of ``step.backward(loss)``; ``scale``: the plain AMP
  loop's ``scaler.scale(loss)`` left in; ``loader``: a DataLoader whose ``batch_size`` the
  Trainer would ignore: each refused at the first step (or when the Trainer is made).

Each member that finishes writes ``OUT/worker-ID.safetensors`` (its parameters), so a test
compares every member with a one-process run, not only rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import tidal

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)

VOCAB, SEQ, PAD = 13, 10, -100
FORMS = ("items", "items-ref", "unused", "eval", "gan", "compressed")
UNUSED = ("unused", "eval", "compressed")  # the forms with a second head
EVAL_AT = (10, 30, 60, 80)
TRAPS = ("raw", "bare", "scale", "loader")


class TinyLM(torch.nn.Module):
    def __init__(self, *, two_heads: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.mix = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, VOCAB)
        # used on odd steps by --form unused
        self.other = torch.nn.Linear(8, VOCAB) if two_heads else None

    def forward(self, tokens: torch.Tensor, *, other: bool = False) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(tokens)))
        return (self.other if other else self.head)(h)


class GAN(torch.nn.Module):
    """A generator of 2-D points from 4-D noise, and its discriminator; ``forward`` is the
    sum of both per-sample mean losses (each one's gradient reaches its own network only)."""

    def __init__(self) -> None:
        super().__init__()
        self.g = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)
        )
        self.d = torch.nn.Sequential(
            torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def forward(self, real: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        bce = F.binary_cross_entropy_with_logits
        fake = self.g(z)
        d_real, d_fake = self.d(real), self.d(fake.detach())
        d_loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
        frozen = {k: v.detach() for k, v in self.d.named_parameters()}
        judged = torch.func.functional_call(self.d, frozen, (fake,))
        return d_loss + bce(judged, torch.ones_like(judged))


def gan_main(args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(5)
    centres = torch.tensor([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]])
    real = centres[torch.randint(0, 3, (600,), generator=g)] + 0.2 * torch.randn(
        600, 2, generator=g
    )
    noise = torch.randn(600, 4, generator=g)  # each sample's own: the same at any split
    torch.manual_seed(0)
    model = GAN()
    opt_g = torch.optim.Adam(model.g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.SGD(model.d.parameters(), lr=0.05, momentum=0.9)
    trainer = tidal.Trainer(
        model,
        [opt_g, opt_d],
        TensorDataset(real, noise),
        global_batch_size=24,
        micro_batch_size=4,
        lr_scheduler=torch.optim.lr_scheduler.StepLR(opt_d, step_size=40, gamma=0.5),
    )
    for step in trainer.run(max_steps=args.max_steps):
        for xb, zb in step.micro_batches():
            step.backward(trainer.model(xb, zb))
    save(trainer, model, args, {"g_steps": int(opt_g.state_dict()["state"][0]["step"])})


def ragged_tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences of 1 to SEQ tokens, padded: inputs (pad id 0) and next-token labels
    (-100 past each sequence's end)."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, SEQ + 2, (n,), generator=g)
    seqs = torch.randint(1, VOCAB, (n, SEQ + 1), generator=g)
    keep = torch.arange(SEQ + 1)[None, :] < lengths[:, None]
    seqs = torch.where(keep, seqs, torch.zeros_like(seqs))
    labels = torch.where(keep[:, 1:], seqs[:, 1:], torch.full_like(seqs[:, 1:], PAD))
    return seqs[:, :-1], labels


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--form", choices=(*FORMS, *TRAPS), required=True)
    p.add_argument("--max-steps", type=int, default=90)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.form == "gan":
        return gan_main(args)

    inputs, labels = ragged_tokens(640)
    torch.manual_seed(0)
    model = TinyLM(two_heads=args.form in UNUSED)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    if args.form == "items-ref":
        return plain_global_mean(model, opt, inputs, labels, args)
    data = TensorDataset(inputs, labels)
    scaler = torch.amp.GradScaler("cpu") if args.form == "scale" else None
    trainer = tidal.Trainer(
        model,
        opt,
        torch.utils.data.DataLoader(data, batch_size=5) if args.form == "loader" else data,
        global_batch_size=24,
        micro_batch_size=4,
        grad_scaler=scaler,
        ddp_kwargs=(
            {"find_unused_parameters": True}
            | ({"compression": "bf16"} if args.form == "compressed" else {})
            if args.form in UNUSED
            else None
        ),
    )
    held_out = TensorDataset(*ragged_tokens(101))  # its own draw: 101, not a batch multiple
    evaluated = {}

    def metrics(batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        xb, yb = batch
        logits = model(xb)[:, -1]
        target = yb[:, 0].clamp(min=0)
        return {
            "loss": F.cross_entropy(logits, target, reduction="none"),  # per sample
            "accuracy": (logits.argmax(1) == target).double().mean(),  # the batch's mean
        }

    for step in trainer.run(max_steps=args.max_steps):
        for xb, yb in step.micro_batches():
            if args.form in UNUSED:
                logits = trainer.model(xb, other=step.index % 2 == 1)
                step.backward(F.cross_entropy(logits[:, -1], yb[:, 0].clamp(min=0)))
            elif args.form == "items":
                logits = trainer.model(xb)
                loss = F.cross_entropy(
                    logits.reshape(-1, VOCAB), yb.reshape(-1), ignore_index=PAD, reduction="sum"
                )
                step.backward(loss, items=int((yb != PAD).sum()))
            else:  # the traps: raw calls the module handed to the Trainer
                logits = (model if args.form == "raw" else trainer.model)(xb)
                loss = F.cross_entropy(logits[:, -1], yb[:, 0].clamp(min=0))
                if args.form == "bare":
                    loss.backward()
                else:
                    step.backward(scaler.scale(loss) if args.form == "scale" else loss)
        if args.form == "eval" and step.index in EVAL_AT:
            evaluated[step.index] = trainer.evaluate(metrics, held_out, batch_size=7)
    save(trainer, model, args, {"evaluated": evaluated})


def save(
    trainer: tidal.Trainer, model: torch.nn.Module, args: argparse.Namespace, facts: dict
) -> None:
    """A finishing member's parameters and facts, under its worker id."""
    if not trainer.completed:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wid = trainer.worker_id if trainer.worker_id is not None else os.getpid()
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(tensors, str(out / f"worker-{wid}.safetensors"))
    facts = {"job_name": trainer.job_name, **facts}
    (out / f"worker-{wid}.json").write_text(json.dumps(facts))


def plain_global_mean(model, opt, inputs, labels, args) -> None:  # noqa: ANN001
    from tidal.worker.batches.sampler import ElasticSampler

    order = ElasticSampler(dataset_size=len(inputs), global_batch_size=24, seed=0)
    for index in range(args.max_steps):
        ids = order.shard(index, 0, 1)
        logits, yb = model(inputs[ids]), labels[ids]
        loss = F.cross_entropy(
            logits.reshape(-1, VOCAB), yb.reshape(-1), ignore_index=PAD, reduction="sum"
        )
        opt.zero_grad()
        (loss / (yb != PAD).sum()).backward()
        opt.step()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(tensors, str(out / "reference.safetensors"))


if __name__ == "__main__":
    main()
