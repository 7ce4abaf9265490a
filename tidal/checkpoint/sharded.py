"""Sharded checkpoints (``sharding="fsdp"``): every member writes its own rows, in parallel.

A folder ``step-NNNNNNNN`` of the sharded layout (``layout.SHARDED``) holds:

- ``shard-RRRRR-of-WWWWW.safetensors``: rank R's rows of every sharded tensor, named
  ``p.NAME`` (a parameter) and ``o.NAME.KEY`` (an optimizer state tensor of its shape), in
  ``torch.chunk``'s dim-0 layout at world size W (``worker.shards.shard_range``);
- ``replicated.safetensors``: buffers (``b.NAME``) and the optimizer's scalar tensors
  (``s.NAME.KEY``, e.g. Adam's step counts);
- ``optimizer.json``: ``param_groups`` (hyper-parameters) and ``state``, the optimizer's
  non-tensor state by parameter name;
- ``meta.json``: step, data position, RNG, ``world_size`` and ``keys`` (each row key's
  full shape and dtype); the tracked objects' ``tracked.json`` and ``tracked.safetensors``;
- ``MANIFEST.json``, written last: ``"layout": "sharded"``, ``"shards": W``, the size and
  checksum of every file.

The same guarantees as the replicated layout (``store``): written through one ``staging``
write that every member joins (a temporary folder renamed into place, or at a URL the final
prefix with the manifest last); verified by ``layout.verify`` before use; safetensors and
JSON only. It loads at any world size and into either sharding:
``read_full`` gives whole tensors (``store.load`` fills an unsharded model with them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tidal.checkpoint.layout import (
    REPLICATED,
    SHARDED,
    TRACKED_JSON,
    TRACKED_TENSORS,
    shard_file,
    verify,
)
from tidal.checkpoint.staging import Staging
from tidal.checkpoint.store import Written
from tidal.checkpoint.tensorfile import HASH  # noqa: F401 - the manifest's checksum, re-exported


def write_shard(target: Staging, rank: int, world: int, rows: dict[str, torch.Tensor]) -> dict:
    """Write this member's rows into the write (``staging.join``); its manifest entry."""
    return target.write_tensors(shard_file(rank, world), rows)


def finalize(
    target: Staging,
    *,
    step: int,
    world: int,
    shards: list[dict],
    replicated: dict[str, torch.Tensor],
    optimizer_meta: dict,
    meta: dict,
    tracked_tensors: dict[str, torch.Tensor],
    tracked_meta: dict,
    started: float,
    fence: str | None = None,
) -> Written:
    """Rank 0, once every member's shard is in the write ``target`` (``shards``: their
    manifest entries, by rank): write the replicated files and the manifest, which makes it
    count (unless the writer's run, ``fence``, no longer owns the folder: ``staging``)."""
    files = {shard_file(r, world): entry for r, entry in enumerate(shards)}
    try:
        for name, held in ((REPLICATED, replicated), (TRACKED_TENSORS, tracked_tensors)):
            files[name] = target.write_tensors(name, held)
        target.write_json(
            files,
            {"optimizer.json": optimizer_meta, "meta.json": meta, TRACKED_JSON: tracked_meta},
        )
        manifest = {"step": step, "layout": SHARDED, "shards": world, "files": files}
        target.publish(manifest, fence=fence)
    except BaseException:
        target.discard()
        raise
    return Written(
        step=step,
        path=target.final,
        bytes=sum(f["bytes"] for f in files.values()),
        seconds_to_write=time.monotonic() - started,
    )


def read_full(path: Path) -> dict:
    """A verified sharded checkpoint as whole tensors: ``rows`` (key -> the tensor, its
    shards' rows in rank order), ``replicated``, ``optimizer`` and ``meta`` (the JSON), and
    ``tracked`` (skeleton, tensors). Raises ``CheckpointError`` if it does not verify."""
    manifest = verify(path)
    world = manifest["shards"]
    meta = json.loads((path / "meta.json").read_text())
    parts = [load_file(str(path / shard_file(r, world))) for r in range(world)]
    rows = {}
    for key, (shape, _dtype) in meta["keys"].items():
        rows[key] = torch.cat([p[key] for p in parts if key in p]) if world > 1 else parts[0][key]
        if list(rows[key].shape) != list(shape):
            raise ValueError(f"{key} has {list(rows[key].shape)} rows in all, meta.json {shape}")
    tracked = ({}, [])
    if (path / TRACKED_JSON).is_file():
        saved = json.loads((path / TRACKED_JSON).read_text())
        tensors = load_file(str(path / TRACKED_TENSORS))
        tracked = (saved["skeleton"], [tensors[f"t.{i}"] for i in range(len(saved["tensors"]))])
    return {
        "rows": rows,
        "replicated": load_file(str(path / REPLICATED)),
        "optimizer": json.loads((path / "optimizer.json").read_text()),
        "meta": meta,
        "tracked": tracked,
    }


def load_unsharded(
    path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict, tuple[dict, list]]:
    """Load a sharded checkpoint into a whole (unsharded) ``module`` and its ``optimizer``;
    returns (meta, tracked) for the caller to restore. Names, shapes and dtypes must be the
    model's (``CheckpointMismatch`` otherwise, one line)."""
    from tidal.checkpoint.store import CheckpointMismatch, check_model

    full = read_full(path)
    model = {k[2:]: v for k, v in full["rows"].items() if k.startswith("p.")}
    model |= {k[2:]: v for k, v in full["replicated"].items() if k.startswith("b.")}
    check_model(path, model, module)
    names = {id(p): n for n, p in module.named_parameters()}
    ids = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict] = {}
    for pid, name in enumerate(ids):
        entry = dict(full["optimizer"]["state"].get(name, {}))
        for key, t in full["rows"].items():
            if key.startswith(f"o.{name}."):
                entry[key[len(name) + 3 :]] = t
        for key, t in full["replicated"].items():
            if key.startswith(f"s.{name}."):
                entry[key[len(name) + 3 :]] = t
        if entry:
            state[pid] = entry
    saved = full["optimizer"]["param_groups"]
    current = optimizer.state_dict()["param_groups"]
    if len(saved) != len(current):
        raise CheckpointMismatch(path, "its optimizer has other param groups")
    groups = [
        {
            **{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()},
            "params": c["params"],
        }
        for g, c in zip(saved, current, strict=True)
    ]
    module.load_state_dict(model)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return full["meta"], full["tracked"]
