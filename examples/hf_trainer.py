"""A Hugging Face ``Trainer`` script as its users write it, nothing of Tidal in it: it runs the
same under ``torchrun --nproc-per-node 2 examples/hf_trainer.py`` and under ``tidal run
--torchrun --workers 2 examples/hf_trainer.py`` (docs/porting.md, "Hugging Face Trainer and
Lightning"). Needs ``pip install -e ".[hf]"``; nothing is downloaded.

A tiny GPT-2 (random weights) learns sequences of random token ids that follow a fixed random
successor table (so its loss falls within a few dozen steps), on the CPU over gloo. The
``Trainer`` saves ``checkpoint-N`` every ``--save-steps`` steps in ``--output-dir``; every
start resumes from the newest complete one, if any: what an elastic restart (a failure, or
a change of size) needs, and the one thing this script adds to a plain ``trainer.train()``.

``--record FILE``: each worker appends one JSON line when training begins (``rank``,
``world``, ``restart_count``, ``resumed_step``), rank 0 one per logged step (``step``,
``loss``, ``world``) and one at the end (``final_step``): what the tests read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

VOCAB, SEQ = 128, 32


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output-dir", default="hf-out", help="where checkpoint-N folders go")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8, help="per worker")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds added to each step")
    p.add_argument("--record", help="append JSON lines here (see the docstring)")
    return p.parse_args()


class Sequences(torch.utils.data.Dataset):
    """Random token ids from a seeded generator, the same in every process: each sequence
    starts at a random token and follows a random successor table (a learnable bigram)."""

    def __init__(self, n: int = 2048) -> None:
        g = torch.Generator().manual_seed(0)
        succ = torch.randperm(VOCAB, generator=g)
        ids = torch.empty(n, SEQ, dtype=torch.long)
        ids[:, 0] = torch.randint(VOCAB, (n,), generator=g)
        for t in range(1, SEQ):
            ids[:, t] = succ[ids[:, t - 1]]
        noise = torch.rand(n, SEQ, generator=g) < 0.1  # one token in ten is random
        self.ids = torch.where(noise, torch.randint(VOCAB, (n, SEQ), generator=g), ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def newest_checkpoint(output_dir: str) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir``, or None. ``trainer_state.json``
    is the last file the Trainer writes into one: a folder without it was cut short (by
    the SIGTERM of a restart) and is skipped, where ``get_last_checkpoint`` would pick it."""
    if not os.path.isdir(output_dir):
        return None
    steps = [
        int(m.group(1))
        for name in os.listdir(output_dir)
        if (m := re.fullmatch(r"checkpoint-(\d+)", name))
        and os.path.isfile(os.path.join(output_dir, name, "trainer_state.json"))
    ]
    return os.path.join(output_dir, f"checkpoint-{max(steps)}") if steps else None


class Record(TrainerCallback):
    """Appends what the tests read to ``path`` (the module doc); ``sleep`` paces the steps."""

    def __init__(self, path: str | None, sleep: float) -> None:
        self.path, self.sleep = path, sleep

    def note(self, **record: object) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({**record, "t": time.time()}) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self.note(
            rank=args.process_index,
            world=args.world_size,
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            resumed_step=state.global_step,
        )

    def on_step_end(self, args, state, control, **kwargs):
        if self.sleep:
            time.sleep(self.sleep)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            self.note(step=state.global_step, loss=logs["loss"], world=args.world_size)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.note(final_step=state.global_step, world=args.world_size)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-2,
        warmup_steps=0,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,
        logging_steps=1,
        # Under torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from its environment
        # (accelerate's PartialState refuses a backend in a plain one-process run).
        ddp_backend="gloo" if "LOCAL_RANK" in os.environ else None,
        use_cpu=True,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Sequences(),
        callbacks=[Record(args.record, args.sleep)],
    )
    trainer.train(resume_from_checkpoint=newest_checkpoint(args.output_dir))


if __name__ == "__main__":
    main()
