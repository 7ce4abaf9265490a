"""What every worker of a job must agree on before it trains with the others.

The elastic data split is a function of the step and of the sampler's settings: a worker
whose script made a different global batch, seed, dataset length or sharding mode would
compute its share of a *different* global batch, and the summed gradients would mix two
trainings with nothing failing (a script that derives the global batch from the world size
or the worker's id does exactly that); one with another ``clip_grad_norm`` would apply
another update to the same gradients, and the members would drift apart; one with another
optimizer or scheduler class would load the heal's state into it and apply another update
(``kinds``). A worker started from another version of the script (a file edited while the
job runs, a node with a stale copy) or under another torch (whose optimizer or kernels may
compute the update differently) trains on beside the others just as silently. So each
worker, before its first rendezvous, compares its settings with the first worker's through
the job's store (one ``compare_set``: the first to arrive sets them) and refuses to join
when they differ. The model itself is compared by the heal, which every joiner goes through
(``heal.ModelMismatch``).

The same holds across a ``tidal resume``: a checkpoint records its step, and the step
alone places the data (``ElasticSampler.position``), so a script resumed with another
dataset length, global batch or seed would skip or repeat samples without a word. A
checkpoint records its ``data_order`` and ``check_resume`` refuses one that differs
(``DataOrderMismatch``; the checkpoint itself stays good).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from tidal.worker.batches.sampler import ElasticSampler


class ScriptMismatch(RuntimeError):
    """This worker's script set up the job differently from the first worker's (``agree``):
    no generation can mend it, so the coordinator fails the job quoting this line."""


class DataOrderMismatch(ValueError):
    """The checkpoint being resumed was written with another data order (``check_resume``)."""


def data_order(sampler: ElasticSampler) -> dict[str, object]:
    """What fixes the samples each step consumes, by the ``Trainer`` argument that sets it
    (``shuffle`` only when off: a checkpoint written before it existed was shuffled)."""
    order: dict[str, object] = {
        "dataset length": sampler.dataset_size,
        "global_batch_size": sampler.global_batch_size,
        "seed": sampler.seed,
    }
    if not sampler.shuffle:
        order["shuffle"] = False
    return order


def settings(
    sampler: ElasticSampler, sharding: str, clip_grad_norm: float | None = None
) -> dict[str, object]:
    """The settings every member must share (``clip_grad_norm`` changes the update each
    member applies to the summed gradients)."""
    return data_order(sampler) | {"sharding": sharding, "clip_grad_norm": clip_grad_norm}


def origin(script: str) -> dict[str, object]:
    """What this process runs, to be compared like ``settings``: the training script's
    content (the start of the sha256 of the file ``script``, the process's ``sys.argv[0]``;
    None where it is no file, as under ``python -c``) and torch's version. Read once, when
    the ``Trainer`` is made, moments after the script started: an edit in between counts
    here although this process runs the file as it was."""
    path = Path(script) if script else None
    digest = None
    if path is not None and path.is_file():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return {"script (sha256 of the file)": digest, "torch": torch.__version__}


def kinds(optimizer: object, tracked: dict[str, object]) -> dict[str, object]:
    """The classes the ``Trainer`` was made with: the optimizer's, and each tracked object's
    by name (``lr_scheduler``, ``grad_scaler``, ``state=``). A heal loads the source's state
    into them: another scheduler class takes it without a word (``load_state_dict`` updates
    its ``__dict__``), and tracked names that differ fail only at the heal."""
    return {
        "optimizer": getattr(optimizer, "kind", type(optimizer).__name__),
        "tracked state": ", ".join(f"{n}: {type(o).__name__}" for n, o in sorted(tracked.items())),
    }


def differences(
    mine: dict[str, object], first: dict[str, object], *, where: str = "in the first worker"
) -> list[str]:
    """Each setting that differs, as ``name: mine here, theirs <where>``."""
    return [
        f"{k}: {mine.get(k)!r} here, {first.get(k)!r} {where}"
        for k in sorted(set(mine) | set(first))
        if mine.get(k) != first.get(k)
    ]


def check_resume(path: str, saved: dict[str, object] | None, mine: dict[str, object]) -> None:
    """Refuse to resume checkpoint ``path`` whose recorded data order (``saved``; None in a
    checkpoint older than the record) is not this script's (``mine``)."""
    diff = differences(mine, saved, where="in the checkpoint") if saved is not None else []
    if diff:
        raise DataOrderMismatch(
            f"checkpoint {path} was written with another data order: "
            + "; ".join(diff)
            + "; resumed, its steps would skip or repeat samples: resume with the same "
            "dataset, global_batch_size and seed (the checkpoint is kept)"
        )


def agree(store: dist.Store, key: str, mine: dict[str, object]) -> None:
    """Set ``mine`` under ``key`` unless a worker did first; raise ``ScriptMismatch`` when
    what is there differs."""
    encoded = json.dumps(mine, sort_keys=True).encode()
    first = store.compare_set(key, b"", encoded)
    if first != encoded:
        diff = differences(mine, json.loads(first))
        raise ScriptMismatch(
            "this worker's script sets up the job differently from the first worker's: "
            + "; ".join(diff or ["(unreadable)"])
            + "; every worker must run the same script, under the same torch, and make the "
            + "same Trainer"
        )
