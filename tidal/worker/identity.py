"""What every worker of a job must agree on before it trains with the others.

The elastic data split is a function of the step and of the sampler's settings: a worker
whose script made a different global batch, seed, dataset length or sharding mode would
compute its share of a *different* global batch, and the summed gradients would mix two
trainings with nothing failing (a script that derives the global batch from the world size
or the worker's id does exactly that); one with another ``clip_grad_norm`` would apply
another update to the same gradients, and the members would drift apart. A worker started
from another version of the script (a file edited while the job runs, a node with a stale
copy) or under another torch (whose optimizer or kernels may compute the update
differently) trains on beside the others just as silently. So each worker,
before its first rendezvous, compares its settings with the first worker's through the
job's store (one ``compare_set``: the first to arrive sets them) and refuses to join when
they differ. The model itself is compared by the heal, which every joiner goes through
(``heal.ModelMismatch``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from tidal.worker.data import ElasticSampler


class ScriptMismatch(RuntimeError):
    """This worker's script set up the job differently from the first worker's (``agree``):
    no generation can mend it, so the coordinator fails the job quoting this line."""


def settings(
    sampler: ElasticSampler, sharding: str, clip_grad_norm: float | None = None
) -> dict[str, object]:
    """The settings every member must share, by the ``Trainer`` argument that sets each
    (``clip_grad_norm`` changes the update each member applies to the summed gradients)."""
    return {
        "dataset length": sampler.dataset_size,
        "global_batch_size": sampler.global_batch_size,
        "seed": sampler.seed,
        "sharding": sharding,
        "clip_grad_norm": clip_grad_norm,
    }


def origin(script: str) -> dict[str, object]:
    """What this process runs, to be compared like ``settings``: the training script's
    content (the start of the sha256 of the file ``script``, the process's ``sys.argv[0]``;
    None where it is no file, as under ``python -c``) and torch's version. Read once, when
    the ``Trainer`` is made: the code this process runs is the file as it was then."""
    path = Path(script) if script else None
    digest = None
    if path is not None and path.is_file():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return {"script (sha256 of the file)": digest, "torch": torch.__version__}


def differences(mine: dict[str, object], first: dict[str, object]) -> list[str]:
    """Each setting that differs, as ``name: mine here, theirs in the first worker``."""
    return [
        f"{k}: {mine.get(k)!r} here, {first.get(k)!r} in the first worker"
        for k in sorted(set(mine) | set(first))
        if mine.get(k) != first.get(k)
    ]


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
