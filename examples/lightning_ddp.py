"""A Lightning script as its users write it, nothing of Tidal in it: it runs the same under
``torchrun --nproc-per-node 2 examples/lightning_ddp.py`` and under ``tidal run --torchrun
--workers 2 examples/lightning_ddp.py`` (docs/porting.md, "Hugging Face Trainer and
Lightning"). Needs ``pip install -e ".[lightning]"``; nothing is downloaded.

A small regression network learns a random linear teacher (seeded), with
``L.Trainer(strategy="ddp", accelerator="cpu")`` on as many devices and nodes as torchrun
started processes: Lightning's ``TorchElasticEnvironment`` takes the ranks and the address
from torchrun's variables and creates no process itself. A ``ModelCheckpoint`` writes
``last.ckpt`` every ``--save-steps`` steps and ``fit(ckpt_path="last")`` resumes from it
when it exists: what an elastic restart (a failure, or a change of size) needs.
``EndAtSigterm`` lets the SIGTERM of a restart end the process at once (its doc says why).

``--record FILE``: each worker appends one JSON line when training starts (``rank``,
``world``, ``restart_count``, ``resumed_step``), rank 0 one per step (``step``, ``loss``,
``world``) and one at the end (``final_step``): what the tests read.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint-dir", default="lightning-ckpt", help="where last.ckpt goes")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds added to each step")
    p.add_argument("--record", help="append JSON lines here (see the docstring)")
    return p.parse_args()


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(4096, 1, generator=g)
    return TensorDataset(x, y)


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


class EndAtSigterm(Callback):
    """Let a restart's SIGTERM end the process at once, as it ends a plain torchrun script;
    the next world resumes from ``last.ckpt`` either way. Lightning's own handler, set just
    before training, stops every rank at the end of its step through a broadcast made from
    inside the handler (Lightning PR 20825): when the ranks get the signal at different
    moments, that broadcast can pair with the step's own collectives and the world hangs
    until the launcher's SIGKILL, 30 s later."""

    def on_train_start(self, trainer, pl_module):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Record(Callback):
    """Appends what the tests read to ``path`` (the module doc); ``sleep`` paces the steps."""

    def __init__(self, path: str | None, sleep: float) -> None:
        self.path, self.sleep = path, sleep

    def note(self, **record: object) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({**record, "t": time.time()}) + "\n")

    def on_train_start(self, trainer, pl_module):
        self.note(
            rank=trainer.global_rank,
            world=trainer.world_size,
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            resumed_step=trainer.global_step,
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            loss = outputs["loss"].item()
            self.note(step=trainer.global_step, loss=loss, world=trainer.world_size)
        if self.sleep:
            time.sleep(self.sleep)

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            self.note(final_step=trainer.global_step, world=trainer.world_size)


def main() -> None:
    args = parse_args()
    L.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(
        dirpath=args.checkpoint_dir,
        save_last=True,  # last.ckpt, what ckpt_path="last" finds
        save_top_k=0,
        every_n_train_steps=args.save_steps,
    )
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        # As torchrun started them: its processes per node and its nodes (1 and 1 alone).
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        max_steps=args.max_steps,
        callbacks=[checkpoints, EndAtSigterm(), Record(args.record, args.sleep)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(data(), batch_size=args.batch_size, shuffle=True)
    trainer.fit(Regressor(), loader, ckpt_path="last")


if __name__ == "__main__":
    main()
