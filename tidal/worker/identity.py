"""What every worker of a job must agree on before it trains with the others.

The elastic data split is a function of the step and of the sampler's settings: a worker
whose script made a different global batch, seed, dataset length or sharding mode would
compute its share of a *different* global batch, and the summed gradients would mix two
trainings with nothing failing (a script that derives the global batch from the world size
or the worker's id does exactly that); one with another ``clip_grad_norm`` would apply
another update to the same gradients, and the members would drift apart. So each worker,
before its first rendezvous, compares its settings with the first worker's through the
job's store (one ``compare_set``: the first to arrive sets them) and refuses to join when
they differ. The model itself is compared by the heal, which every joiner goes through
(``heal.ModelMismatch``).
"""

from __future__ import annotations

import json

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
            + "; every worker must make the same Trainer"
        )
