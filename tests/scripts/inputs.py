"""One training loop over three kinds of input, for tests/test_inputs_e2e.py (not an example):

- ``map``: a map-style dataset of ragged samples (dicts with a variable-length sequence),
  padded by a custom ``collate_fn``, loaded by 2 DataLoader worker processes;
- ``tokens``: ``tidal.data.TokenShards`` over two token files the script writes;
- ``stream``: a stream of the same ragged samples read in order (``iter_from``), or a
  plain ``IterableDataset`` that can only be read from the start (``--no-seek``).

``--loader-dies-on ID`` (map only): the DataLoader worker process that first fetches sample
``ID`` in the whole job SIGKILLs itself (a marker file in ``OUT`` makes it once), as the OOM
killer would; the member's training process must replace it and go on.

Float64. Each member appends the sample ids of every step it commits to
``OUT/ids-worker-ID.jsonl`` (from ``after_step``, so a step that failed and was redone is
recorded once, by the generation that committed it) and writes its final parameters to
``OUT/worker-ID.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset

import tidal

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
FEATURES = 8


def features(i: int) -> torch.Tensor:
    """Sample ``i``'s features: a pure function of the id, in every process."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(1 + i % 5, FEATURES, generator=g)  # 1 to 5 rows: ragged


def label(i: int) -> int:
    return int(features(i).sum() > 0)


class Ragged(Dataset):
    def __init__(self, n: int, dies_on: int | None = None, marker: Path | None = None) -> None:
        self.n, self.dies_on, self.marker = n, dies_on, marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i == self.dies_on and first(self.marker):
            os.kill(os.getpid(), signal.SIGKILL)  # this DataLoader worker process
        return {"id": i, "x": features(i), "y": label(i)}


def first(marker: Path) -> bool:
    """True for the one caller, in any process, that creates ``marker``."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def pad(samples: list[dict]) -> dict:
    """Pad the ragged sequences to the longest in the batch, with a mask."""
    rows = max(len(s["x"]) for s in samples)
    x = torch.zeros(len(samples), rows, FEATURES)
    mask = torch.zeros(len(samples), rows)
    for k, s in enumerate(samples):
        x[k, : len(s["x"])] = s["x"]
        mask[k, : len(s["x"])] = 1.0
    ids = torch.tensor([s["id"] for s in samples])
    return {"id": ids, "x": x, "mask": mask, "y": torch.tensor([s["y"] for s in samples])}


class Seekable:
    """A stream: sample at position p, from any position on."""

    def iter_from(self, position: int):
        p = position
        while True:
            yield {"id": p, "x": features(p), "y": label(p)}
            p += 1


class FromStart(IterableDataset):
    """An IterableDataset that can only be read from its start."""

    def __iter__(self):
        return Seekable().iter_from(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=["map", "tokens", "stream"], required=True)
    p.add_argument("--no-seek", action="store_true")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--out", required=True)
    p.add_argument("--loader-dies-on", type=int, default=None)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    if args.kind == "tokens":
        model = torch.nn.Sequential(torch.nn.Embedding(97, 16), torch.nn.Linear(16, 97))
    else:
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh())
        model.append(torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kw: dict = {"global_batch_size": 24, "micro_batch_size": 5}
    if args.kind == "map":
        data = Ragged(240, args.loader_dies_on, out / "loader-died")
        kw |= {"collate_fn": pad, "num_workers": 2}
    elif args.kind == "tokens":
        from tidal.data import TokenShards, write_tokens

        paths = []
        for f, n in enumerate((1300, 1111)):  # two files, neither a multiple of the window
            path = out / f"tokens-{f}.bin"
            if not path.exists():  # every worker writes the same bytes: write once, atomically
                tmp = out / f".tokens-{f}-{os.getpid()}.bin"
                write_tokens(tmp, f * 5000 + torch.arange(n), dtype="uint16")  # unique
                os.replace(tmp, path)
            paths.append(path)
        data = TokenShards(paths, seq_len=16)
    else:
        data = FromStart() if args.no_seek else Seekable()
        kw |= {"collate_fn": pad}
    trainer = tidal.Trainer(model, opt, data, seed=3, **kw)
    pending: list[int] = []
    log = None

    @trainer.after_step
    def record(index: int) -> None:
        nonlocal log
        if log is None:
            log = open(out / f"ids-worker-{trainer.worker_id}.jsonl", "a")  # noqa: SIM115
        log.write(json.dumps({"step": index, "ids": sorted(pending)}) + "\n")
        log.flush()

    for step in trainer.run(max_steps=args.max_steps):
        pending.clear()  # a redone step starts over
        for batch in step.micro_batches():
            if args.kind == "tokens":
                (window,) = (batch,) if torch.is_tensor(batch) else batch
                tokens = window % 97  # the model's vocabulary; the raw token is a position
                logits = trainer.model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                pending.extend(int(w) for w in window[:, 0])  # a window's id: its first token
            else:
                pooled = (batch["x"] * batch["mask"][..., None]).sum(1) / batch["mask"].sum(1)[
                    :, None
                ]
                loss = F.cross_entropy(trainer.model(pooled), batch["y"])
                pending.extend(batch["id"].tolist())
            step.backward(loss)
    if trainer.completed:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        safetensors.torch.save_file(state, str(out / f"worker-{trainer.worker_id}.safetensors"))


if __name__ == "__main__":
    main()
