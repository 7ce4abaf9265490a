"""Writing a sharded checkpoint: every member of the generation at once (a collective).

At a checkpoint step (``Durable.due``) every member, after committing the step:

1. learns the write, which rank 0 opens and names (``staging.begin``: a temporary folder
   named after its pid, so ``store.prune`` removes it if rank 0 dies in the write; at a
   URL the final prefix, whose manifest rank 0 uploads last);
2. writes its own rows there (``checkpoint.sharded.write_shard``, hashed while written);
3. all-gathers every member's result (bytes and checksum, or a failure);
4. rank 0 writes the replicated files and the manifest and renames the folder into place
   (``finalize``), then reports it to the coordinator; a member that could not write
   (a full disk) makes it a failed checkpoint, reported as one: training goes on.

A peer lost during the write fails the collectives: the generation re-forms as after any
failed collective, and the temporary folder is removed by rank 0 (or pruned later). The
write is synchronous: each member writes 1/n of the state, in parallel with the others.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from tidal.checkpoint import sharded as disk
from tidal.checkpoint import staging, store
from tidal.checkpoint.fence import Fenced
from tidal.checkpoint.location import Location
from tidal.checkpoint.writer import prune_quietly
from tidal.protocol import CheckpointView
from tidal.tracked import TrackedState
from tidal.worker.sharded.module import ShardedModel

log = logging.getLogger(__name__)

NAME_BYTES = 1024


def _broadcast_name(name: str) -> str:
    raw = name.encode()
    if len(raw) > NAME_BYTES:
        raise ValueError(f"checkpoint folder name longer than {NAME_BYTES} bytes: {name!r}")
    buf = torch.zeros(NAME_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else buf[:0]
    dist.broadcast(buf, 0)
    return bytes(buf.numpy()).rstrip(b"\0").decode()


def _entry_row(entry: dict | None) -> torch.Tensor:
    if entry is None:
        return torch.zeros(4, dtype=torch.int64)
    digest = bytes.fromhex(entry[disk.HASH])
    hi, lo = (int.from_bytes(digest[i : i + 8], "big", signed=True) for i in (0, 8))
    return torch.tensor([1, entry["bytes"], hi, lo], dtype=torch.int64)


def _row_entry(row: torch.Tensor) -> dict | None:
    ok, size, hi, lo = (int(v) for v in row.tolist())
    if not ok:
        return None
    digest = hi.to_bytes(8, "big", signed=True) + lo.to_bytes(8, "big", signed=True)
    return {disk.HASH: digest.hex(), "bytes": size}


def save_sharded(
    sm: ShardedModel,
    *,
    directory: Location,
    step: int,
    position: dict,
    tracked: TrackedState | None,
    keep: int,
    agent,  # noqa: ANN001 - the worker's Agent (posts the checkpoint or its failure)
    fence: str | None = None,
) -> bool:
    """This member's part of the checkpoint of ``step`` (module contract); True if this
    member published it (rank 0, the write whole). Rank 0 first prunes to ``keep``, so the
    shards reuse the pages that frees (``checkpoint.writer``'s module doc); the last
    checkpoint's pruning is ``Durable.close``'s."""
    started = time.monotonic()
    rank, world = dist.get_rank(), dist.get_world_size()
    name, target = "", None
    if rank == 0:
        prune_quietly(directory, keep, fence=fence)
        try:
            target = staging.begin(directory, step, fence=fence)
            name = target.name
        except (OSError, Fenced) as exc:
            log.warning("checkpoint of step %s failed: %s", step, exc)
    name = _broadcast_name(name)
    if name and target is None:
        target = staging.join(directory, name, step)
    held = sm.held()
    entry, error = None, None
    if target is not None:
        try:
            rows = {".".join(k): t.contiguous() for k, t in held.rows.items()}
            entry = disk.write_shard(target, rank, world, rows)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.warning("checkpoint of step %s failed: %s", step, error)
    mine = _entry_row(entry)
    rows_of = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(rows_of, mine)
    except BaseException:
        if rank == 0 and target is not None:
            target.discard()
        raise
    if rank != 0:
        return False
    entries = [_row_entry(r) for r in rows_of]
    if target is None or any(e is None for e in entries):
        failed = [r for r, e in enumerate(entries) if e is None]
        if target is not None:
            target.discard()
        agent.post_checkpoint_failure(step, error or f"ranks {failed} could not write their shard")
        return False
    try:
        written = disk.finalize(
            target,
            step=step,
            world=world,
            shards=entries,
            **_replicated(sm, held, step=step, world=world, position=position, tracked=tracked),
            started=started,
            fence=fence,
        )
    except Exception as exc:  # noqa: BLE001 - a failed write must not stop training
        error = " ".join(f"{type(exc).__name__}: {exc}".split())
        log.warning("checkpoint of step %s failed: %s", step, error)
        agent.post_checkpoint_failure(step, error)
        return False
    agent.post_checkpoint(
        CheckpointView(
            step=written.step,
            path=written.path,
            bytes=written.bytes,
            seconds_to_write=written.seconds_to_write,
        )
    )
    return True


def _replicated(sm, held, *, step, world, position, tracked) -> dict:  # noqa: ANN001
    replicated = {f"b.{n}": b.contiguous() for n, b in held.buffers.items()}
    state: dict[str, dict] = {}
    for n, entries in held.scalars.items():
        for k, v in entries.items():
            if isinstance(v, torch.Tensor):
                replicated[f"s.{n}.{k}"] = v.detach().reshape(v.shape).contiguous()
            else:
                state.setdefault(n, {})[k] = v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sm.optimizer.param_groups]
    keys = {
        ".".join(k): [list(sm.full_shape(k)), str(t.dtype).removeprefix("torch.")]
        for k, t in held.rows.items()
    }
    captured = tracked.capture() if tracked else None
    meta = {**position, "world_size": world, "step": step, "time": time.time()}
    meta |= {**store.rng_meta(), "keys": keys}
    return {
        "replicated": replicated,
        "optimizer_meta": {"param_groups": groups, "state": state},
        "meta": meta,
        "tracked_tensors": {f"t.{i}": t.contiguous() for i, t in enumerate(captured.tensors)}
        if captured
        else {},
        "tracked_meta": {"skeleton": captured.skeleton, "tensors": captured.layout()}
        if captured
        else {"skeleton": {}, "tensors": []},
    }


def load_for_roll_back(sm: ShardedModel, path: Location, *, gen: int, tracked) -> int:  # noqa: ANN001
    """Hold the whole state of the sharded checkpoint ``path`` (a roll-back the coordinator
    chose: every member of generation ``gen`` loads it, so all hold the same layout
    ``(gen, 1, 0)``, and the heal cuts each member's rows from it); returns its step."""
    from tidal.checkpoint.layout import SHARDED, readable
    from tidal.worker.sharded.module import Held
    from tidal.worker.sharded.plan import Layout

    with readable(path) as local:
        if store.verify(local).get("layout") != SHARDED:
            raise store.CheckpointError(
                f"checkpoint {path} refused: sharding='fsdp' rolls back only to sharded checkpoints"
            )
        full = disk.read_full(local)
    rows = {tuple(_split_key(k, sm.names)): t for k, t in full["rows"].items()}
    scalars: dict[str, dict] = {n: dict(e) for n, e in full["optimizer"]["state"].items()}
    for key, t in full["replicated"].items():
        if key.startswith("s."):
            name, k = _split_key(key, sm.names)[1:]
            scalars.setdefault(name, {})[k] = t
    buffers = {k[2:]: t for k, t in full["replicated"].items() if k.startswith("b.")}
    for g, saved in zip(sm.optimizer.param_groups, full["optimizer"]["param_groups"], strict=True):
        g.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    if tracked or full["tracked"][0]:
        (tracked or TrackedState({})).restore(*full["tracked"])
    store.restore_rng(full["meta"])
    sm.install(
        Held(layout=Layout(gen=gen, world=1, rank=0), rows=rows, buffers=buffers, scalars=scalars)
    )
    return int(full["meta"]["step"])


def _split_key(key: str, names: list[str]) -> tuple[str, ...]:
    """``p.NAME`` / ``o.NAME.KEY`` / ``s.NAME.KEY`` back into its parts (names hold dots)."""
    kind, rest = key.split(".", 1)
    if kind == "p":
        return (kind, rest)
    name = max((n for n in names if rest.startswith(n + ".")), key=len, default=None)
    if name is None:
        raise store.CheckpointError(f"checkpoint tensor {key!r} names no parameter of the model")
    return (kind, name, rest[len(name) + 1 :])
