"""Durable checkpoints: atomic, verified folders of safetensors and JSON.

A checkpoint is a folder ``step-NNNNNNNN`` holding ``model.safetensors``,
``optimizer.safetensors``, ``optimizer.json`` (the optimizer's non-tensor structure),
``meta.json`` (step, data position, RNG, world size) and ``MANIFEST.json`` (the checksum
and size of every other file). Contracts:

- **Atomic.** It is written under a temporary name (``.tmp-...``), every file fsynced, the
  manifest written last and fsynced, then renamed into place and the parent folder fsynced.
  A crash at any point leaves either no ``step-*`` folder or a complete one; temporary
  folders are never taken for checkpoints. At an fsspec URL (``s3://...``: ``remote``) the
  files go to the final prefix and the manifest, uploaded last, is the commit
  (``staging``); a prefix without one is never taken for a checkpoint.
- **Verified.** ``verify`` (``layout``) recomputes every file's checksum against the manifest
  and checks the structure of what the files hold; a truncated, bit-flipped, half-written or
  malformed checkpoint is refused with the reason, and ``newest_good`` falls back to the
  previous one. ``load`` also checks the tensors against the model (names, shapes, dtypes); a
  checkpoint that verifies but does not fit the script is refused as ``CheckpointMismatch``
  and kept (``Durable.resume`` marks bad only one that fails ``verify``).
- **Safe.** Tensors are read by safetensors and metadata by ``json``: no pickle anywhere.
- **At memory-copy cost.** A snapshot copies each tensor into the memory the same name's copy
  used last time (``Buffers``); the tensor files go from that memory to disk and are hashed
  as they are written (``tensorfile``): no serialised copy, no second read for the checksum.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tidal import devices, pids
from tidal.checkpoint import remote, staging
from tidal.checkpoint.fence import read as read_fence
from tidal.checkpoint.fence import refusal
from tidal.checkpoint.layout import (  # noqa: F401 - re-exported: the store's names
    BAD,
    CHUNK,
    MANIFEST,
    NAME_RE,
    REQUIRED,
    SHARDED,
    TRACKED_JSON,
    TRACKED_TENSORS,
    CheckpointError,
    CheckpointMismatch,
    checkpoint_name,
    file_digest,
    list_checkpoints,
    mark_bad,
    marks_bad,
    newest_good,
    readable,
    stale_temporary,
    temporary_name,
    verify,
)
from tidal.checkpoint.layout import sha256 as _sha256  # noqa: F401 - tests craft old manifests
from tidal.checkpoint.location import Location, is_url
from tidal.tracked import Captured, TrackedState


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """An in-memory copy of the training state, owned by the writer (nothing else changes it)."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer_tensors: dict[str, torch.Tensor]
    optimizer_meta: dict
    meta: dict
    tracked_tensors: dict[str, torch.Tensor]  # ``t.I``: the tracked skeleton's tensor I
    tracked_meta: dict  # {"skeleton": ..., "tensors": [[shape, dtype], ...]}


@dataclass(frozen=True, kw_only=True)
class Written:
    step: int
    path: str
    bytes: int
    seconds_to_write: float


# -- taking a snapshot ---------------------------------------------------------------------
def rng_meta() -> dict:
    import random

    version, state, gauss = random.getstate()
    return {
        "torch_rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python_rng": [version, list(state), gauss],
        "cuda_rng": devices.cuda_rng_text(),  # None where CUDA was never used
    }


def restore_rng(meta: dict) -> None:
    import random

    raw = base64.b64decode(meta["torch_rng"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    version, state, gauss = meta["python_rng"]
    random.setstate((version, tuple(state), gauss))
    devices.set_cuda_rng_text(meta.get("cuda_rng"))


class Buffers:
    """Snapshot memory kept from one checkpoint to the next, by tensor: a copy lands in the
    tensor that held the same name's copy last time (same shape and dtype), so a checkpoint
    pays a memory copy, not also the page faults of fresh memory. Contract: used by one
    writer for one snapshot at a time (``AsyncCheckpointer`` starts a snapshot only once the
    previous one is on disk). A CUDA tensor's copy goes to pinned host memory (full-speed
    device-to-host copies)."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        buf = self._held.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._held[key] = buf
        self._used.add(key)
        return buf.copy_(t)

    def keep_used(self) -> None:
        """Let go of the memory of tensors the last snapshot did not have (after it)."""
        self._held = {k: v for k, v in self._held.items() if k in self._used}
        self._used = set()


def _copy(t: torch.Tensor, buffers: Buffers | None, key: str) -> torch.Tensor:
    if buffers is not None:
        return buffers.copy(key, t)
    return t.detach().to("cpu", copy=True).contiguous()


@dataclass(frozen=True, kw_only=True)
class PendingSnapshot:
    """The first half of a snapshot, taken at once: what the next step's body may change
    (buffers such as running statistics, tracked state) and the RNG. ``complete`` copies the rest
    (parameters and optimizer state), which nothing changes until the next optimizer step,
    so it may run on another thread while the next step computes."""

    step: int
    buffers: dict[str, torch.Tensor]
    meta: dict
    tracked: Captured  # taken at ``begin_snapshot``: the skeleton and copies of the tensors
    pool: Buffers | None = None  # where the copies go (None: fresh memory)

    @torch.no_grad()
    def complete(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Snapshot:
        pool = self.pool
        model = {
            k: self.buffers[k] if k in self.buffers else _copy(v, pool, f"m.{k}")
            for k, v in module.state_dict(keep_vars=True).items()
        }
        opt = optimizer.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        state_meta: dict[str, dict] = {}
        for pid, entries in opt["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    name = f"state.{pid}.{key}"
                    tensors[name] = _copy(value, pool, f"o.{name}")
                else:
                    state_meta.setdefault(str(pid), {})[key] = value
        tracked = {f"t.{i}": t for i, t in enumerate(self.tracked.tensors)}  # copied at begin
        if pool is not None:
            pool.keep_used()
        return Snapshot(
            step=self.step,
            model=model,
            optimizer_tensors=tensors,
            optimizer_meta={"param_groups": opt["param_groups"], "state": state_meta},
            meta=self.meta,
            tracked_tensors=tracked,
            tracked_meta={"skeleton": self.tracked.skeleton, "tensors": self.tracked.layout()},
        )


@torch.no_grad()
def begin_snapshot(
    *,
    step: int,
    module: torch.nn.Module,
    meta: dict,
    tracked: TrackedState | None = None,
    pool: Buffers | None = None,
) -> PendingSnapshot:
    """``tracked`` objects' state is taken now, tensors copied: a script may change them in
    the next step's body, before any optimizer step (an EMA updated there, as
    docs/porting.md shows), so they cannot wait for ``complete`` as parameters do. Seen: a
    job resumed from such a checkpoint had its EMA one update ahead (chaos seed
    340000120: ``n_averaged`` 1201 after 1,200 steps). ``pool``: the copies go into its
    memory (see ``Buffers``)."""
    params = {id(p) for p in module.parameters()}
    buffers = {
        k: _copy(v, pool, f"m.{k}")
        for k, v in module.state_dict(keep_vars=True).items()
        if id(v) not in params
    }
    return PendingSnapshot(
        step=step,
        buffers=buffers,
        meta={**meta, "step": step, "time": time.time(), **rng_meta()},
        tracked=_copied(tracked.capture(), pool) if tracked else Captured(skeleton={}, tensors=[]),
        pool=pool,
    )


def _copied(captured: Captured, pool: Buffers | None) -> Captured:
    tensors = [_copy(t, pool, f"t.{i}") for i, t in enumerate(captured.tensors)]
    return Captured(skeleton=captured.skeleton, tensors=tensors)


def take_snapshot(
    *,
    step: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict,
    tracked: TrackedState | None = None,
) -> Snapshot:
    """The whole snapshot at once (what a synchronous save pays for)."""
    pending = begin_snapshot(step=step, module=module, meta=meta, tracked=tracked)
    return pending.complete(module, optimizer)


# -- writing -----------------------------------------------------------------------------
def write(
    snapshot: Snapshot,
    directory: Location,
    *,
    during: Callable[[], None] | None = None,
    fence: str | None = None,
) -> Written:
    """Write ``snapshot`` as ``directory/step-N`` atomically (see the module contract; at a
    URL the manifest uploaded last is the commit: ``staging``). ``during`` (a test hook: the
    ``checkpoint`` fault phase) runs once the first file is written. ``fence``: the writer's
    run (``staging.publish``)."""
    start = time.monotonic()
    target = staging.begin(directory, snapshot.step, fence=fence)
    files = {}
    try:
        files["model.safetensors"] = target.write_tensors("model.safetensors", snapshot.model)
        if during is not None:
            during()
        files["optimizer.safetensors"] = target.write_tensors(
            "optimizer.safetensors", snapshot.optimizer_tensors
        )
        files[TRACKED_TENSORS] = target.write_tensors(TRACKED_TENSORS, snapshot.tracked_tensors)
        target.write_json(
            files,
            {
                "optimizer.json": snapshot.optimizer_meta,
                "meta.json": snapshot.meta,
                TRACKED_JSON: snapshot.tracked_meta,
            },
        )
        target.publish({"step": snapshot.step, "files": files}, fence=fence)
    except BaseException:
        target.discard()
        raise
    size = sum(f["bytes"] for f in files.values())
    return Written(
        step=snapshot.step,
        path=target.final,
        bytes=size,
        seconds_to_write=time.monotonic() - start,
    )


def prune(directory: Location, keep: int, *, fence: str | None = None) -> list[Location]:
    """Delete all but the newest ``keep`` checkpoints, and the temporary folders of writes
    whose writer died in them (``layout.stale_temporary``; at a URL, ``remote.prune``);
    returns what was deleted. A writer whose run no longer owns the folder (``fence``)
    deletes nothing."""
    if is_url(directory):
        return remote.prune(directory, keep, fence=fence)
    directory = Path(directory)
    if refusal(fence, read_fence(directory) if fence is not None else None):
        return []
    doomed = list_checkpoints(directory)[keep:]
    host, now = socket.gethostname(), time.time()
    for path in directory.iterdir() if directory.is_dir() else ():
        try:
            age = now - path.stat().st_mtime
        except OSError:  # renamed or removed meanwhile
            continue
        if path.is_dir() and stale_temporary(path.name, age_s=age, host=host, alive=pids.alive):
            doomed.append(path)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# -- reading -----------------------------------------------------------------------------
def _read_tracked(path: Path) -> tuple[dict, list[torch.Tensor]]:
    """The tracked objects' saved state: skeleton and tensors (none in a checkpoint written
    before Tidal carried tracked state)."""
    if not (path / TRACKED_JSON).is_file():
        return {}, []
    saved = json.loads((path / TRACKED_JSON).read_text())
    tensors = load_file(str(path / TRACKED_TENSORS))
    return saved["skeleton"], [tensors[f"t.{i}"] for i in range(len(saved["tensors"]))]


def check_model(path: Path, tensors: dict[str, torch.Tensor], module: torch.nn.Module) -> None:
    """Refuse tensors that are not the model's: names, shapes and dtypes (``load_state_dict``
    would cast a float32 checkpoint into a float64 model without a word)."""
    want = module.state_dict()
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise CheckpointMismatch(
            path,
            "its model tensors are not the model's"
            + (f"; missing {', '.join(missing[:3])}" if missing else "")
            + (f"; unexpected {', '.join(extra[:3])}" if extra else ""),
        )
    for name, t in want.items():
        got = tensors[name]
        if got.shape != t.shape or got.dtype != t.dtype:
            raise CheckpointMismatch(
                path,
                f"{name} is {got.dtype} {list(got.shape)}, the model's {t.dtype} {list(t.shape)}",
            )


def load(
    path: Location,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    tracked: TrackedState | None = None,
) -> dict:
    """``load_folder`` of ``path``, a folder or a checkpoint at a URL (downloaded first:
    ``layout.readable``; refusals name the URL)."""
    with readable(path) as local:
        return load_folder(local, module, optimizer, tracked=tracked)


def load_folder(
    path: Path,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    tracked: TrackedState | None = None,
) -> dict:
    """Verify, then load ``path`` into ``module``, ``optimizer`` and the ``tracked`` objects;
    returns its meta (RNG restored by ``restore_rng``). Raises ``CheckpointError`` (one line)
    for a checkpoint that ``verify`` refuses, and its ``CheckpointMismatch`` for one that
    verifies but does not fit the model, optimizer or tracked state: whatever fails after
    ``verify`` is taken for the script's mismatch, since checksums and structure held (the
    worker must not train on after either: a scheduler left at step 0 would silently
    diverge)."""
    manifest = verify(path)
    try:
        if manifest.get("layout") == SHARDED:  # written by sharding="fsdp": whole tensors
            from tidal.checkpoint.sharded import load_unsharded

            meta, saved_tracked = load_unsharded(path, module, optimizer)
            if tracked or saved_tracked[0]:
                (tracked or TrackedState({})).restore(*saved_tracked)
            return meta
        model = load_file(str(path / "model.safetensors"))
        check_model(path, model, module)
        tensors = load_file(str(path / "optimizer.safetensors"))
        opt_meta = json.loads((path / "optimizer.json").read_text())
        state: dict[int, dict] = {}
        for pid, entries in opt_meta["state"].items():
            state.setdefault(int(pid), {}).update(entries)
        for key, value in tensors.items():
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = value
        n_params = sum(len(g["params"]) for g in optimizer.param_groups)
        if any(not 0 <= pid < n_params for pid in state):
            raise CheckpointMismatch(path, "optimizer state for parameters the model lacks")
        groups = [  # JSON made the tuples (Adam's betas) lists
            {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
            for g in opt_meta["param_groups"]
        ]
        saved_tracked = _read_tracked(path)
        module.load_state_dict(model)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        if tracked or saved_tracked[0]:
            (tracked or TrackedState({})).restore(*saved_tracked)
        return json.loads((path / "meta.json").read_text())
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever does not fit: one line, not a traceback
        msg = " ".join(str(exc).split())[:300]
        raise CheckpointMismatch(path, f"it does not load ({type(exc).__name__}: {msg})") from None
