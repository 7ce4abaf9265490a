"""Durable checkpoints: atomic, verified folders of safetensors and JSON.

A checkpoint is a folder ``step-NNNNNNNN`` holding ``model.safetensors``,
``optimizer.safetensors``, ``optimizer.json`` (the optimizer's non-tensor structure),
``meta.json`` (step, data position, RNG, world size) and ``MANIFEST.json`` (sha256 and size
of every other file). Contracts:

- **Atomic.** It is written under a temporary name (``.tmp-...``), every file fsynced, the
  manifest written last and fsynced, then renamed into place and the parent folder fsynced.
  A crash at any point leaves either no ``step-*`` folder or a complete one; temporary
  folders are never taken for checkpoints.
- **Verified.** ``verify`` recomputes every file's sha256 against the manifest; a truncated,
  bit-flipped or half-written checkpoint is refused with the reason, and
  ``newest_good`` falls back to the previous one.
- **Safe.** Tensors are read by safetensors and metadata by ``json``: no pickle anywhere.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MANIFEST = "MANIFEST.json"
NAME_RE = re.compile(r"^step-(\d{8,})$")
CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that must not be used; the message names it and says why."""


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """An in-memory copy of the training state, owned by the writer (nothing else changes it)."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer_tensors: dict[str, torch.Tensor]
    optimizer_meta: dict
    meta: dict


@dataclass(frozen=True, kw_only=True)
class Written:
    step: int
    path: str
    bytes: int
    seconds_to_write: float


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


# -- taking a snapshot ---------------------------------------------------------------------
def _rng_meta() -> dict:
    import random

    version, state, gauss = random.getstate()
    return {
        "torch_rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python_rng": [version, list(state), gauss],
    }


def restore_rng(meta: dict) -> None:
    import random

    raw = base64.b64decode(meta["torch_rng"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    version, state, gauss = meta["python_rng"]
    random.setstate((version, tuple(state), gauss))


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


@dataclass(frozen=True, kw_only=True)
class PendingSnapshot:
    """The first half of a snapshot, taken at once: what the next forward pass may change
    (buffers such as running statistics) and the RNG. ``complete`` copies the rest
    (parameters and optimizer state), which nothing changes until the next optimizer step,
    so it may run on another thread while the next step computes."""

    step: int
    buffers: dict[str, torch.Tensor]
    meta: dict

    @torch.no_grad()
    def complete(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Snapshot:
        model = {
            k: self.buffers[k] if k in self.buffers else _copy(v)
            for k, v in module.state_dict(keep_vars=True).items()
        }
        opt = optimizer.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        state_meta: dict[str, dict] = {}
        for pid, entries in opt["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state.{pid}.{key}"] = _copy(value)
                else:
                    state_meta.setdefault(str(pid), {})[key] = value
        return Snapshot(
            step=self.step,
            model=model,
            optimizer_tensors=tensors,
            optimizer_meta={"param_groups": opt["param_groups"], "state": state_meta},
            meta=self.meta,
        )


@torch.no_grad()
def begin_snapshot(*, step: int, module: torch.nn.Module, meta: dict) -> PendingSnapshot:
    params = {id(p) for p in module.parameters()}
    buffers = {
        k: _copy(v) for k, v in module.state_dict(keep_vars=True).items() if id(v) not in params
    }
    return PendingSnapshot(
        step=step, buffers=buffers, meta={**meta, "step": step, "time": time.time(), **_rng_meta()}
    )


def take_snapshot(
    *, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict
) -> Snapshot:
    """The whole snapshot at once (what a synchronous save pays for)."""
    return begin_snapshot(step=step, module=module, meta=meta).complete(module, optimizer)


# -- writing -----------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def write(snapshot: Snapshot, directory: Path) -> Written:
    """Write ``snapshot`` as ``directory/step-N`` atomically (see the module contract)."""
    start = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(snapshot.step)
    tmp = directory / f".tmp-{checkpoint_name(snapshot.step)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(snapshot.model, str(tmp / "model.safetensors"))
        save_file(snapshot.optimizer_tensors, str(tmp / "optimizer.safetensors"))
        _write_json(tmp / "optimizer.json", snapshot.optimizer_meta)
        _write_json(tmp / "meta.json", snapshot.meta)
        files = {}
        for path in sorted(tmp.iterdir()):
            _fsync_file(path)
            files[path.name] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
        _write_json(tmp / MANIFEST, {"step": snapshot.step, "files": files})
        _fsync_file(tmp / MANIFEST)
        _fsync_dir(tmp)
        if final.exists():  # the same step written again (e.g. a stop right after a save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f["bytes"] for f in files.values())
    return Written(
        step=snapshot.step, path=str(final), bytes=size, seconds_to_write=time.monotonic() - start
    )


def prune(directory: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints; returns what was deleted."""
    doomed = list_checkpoints(directory)[keep:]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# -- reading -----------------------------------------------------------------------------
def list_checkpoints(directory: Path) -> list[Path]:
    """Complete-looking checkpoint folders, newest first (temporary folders never count)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and NAME_RE.match(p.name)]
    return sorted(found, key=lambda p: int(NAME_RE.match(p.name).group(1)), reverse=True)


def verify(path: Path) -> dict:
    """The manifest of a good checkpoint; raises CheckpointError naming what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path} refused: unreadable manifest ({exc})") from None
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} refused: {name} is missing")
        if f.stat().st_size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} refused: {name} has {f.stat().st_size} bytes, "
                f"the manifest says {want['bytes']}"
            )
        if _sha256(f) != want["sha256"]:
            raise CheckpointError(f"checkpoint {path} refused: sha256 mismatch in {name}")
    return manifest


def newest_good(directory: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and a warning line for each newer one refused."""
    warnings = []
    for path in list_checkpoints(directory):
        try:
            verify(path)
            return path, warnings
        except CheckpointError as exc:
            warnings.append(str(exc))
    return None, warnings


def load(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Verify, then load ``path`` into ``module`` and ``optimizer``; returns its meta
    (RNG restored by ``restore_rng``)."""
    verify(path)
    module.load_state_dict(load_file(str(path / "model.safetensors")))
    tensors = load_file(str(path / "optimizer.safetensors"))
    opt_meta = json.loads((path / "optimizer.json").read_text())
    state: dict[int, dict] = {}
    for pid, entries in opt_meta["state"].items():
        state.setdefault(int(pid), {}).update(entries)
    for key, value in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = value
    groups = [  # JSON made the tuples (Adam's betas) lists
        {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
        for g in opt_meta["param_groups"]
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return json.loads((path / "meta.json").read_text())
