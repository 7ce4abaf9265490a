"""A checkpoint folder on disk: its names, and whether it may be used. No torch here, so that
``tidal status`` and ``tidal resume`` choose checkpoints without importing it.

``verify`` refuses, with the reason in one line, a folder that is not a complete checkpoint:

- the manifest must list exactly the required files (``REQUIRED``), with their sizes and
  checksums (``HASHES``: XXH3-128, or sha256 in older checkpoints), and its ``step`` must be
  the folder's;
- each file must match its size and hash (a truncated, bit-flipped or half-written file);
- the contents must have the expected structure, since hashes only prove that nothing changed
  after the manifest was written, not that what was written is a checkpoint (a pickle with
  its hash recomputed, a manifest of ``{"files": {}}``): both ``.safetensors`` headers must
  parse (safetensors validates names, dtypes, shapes and offsets against the file's size),
  the model must hold tensors, optimizer tensors must be named ``state.PARAM.KEY``,
  ``optimizer.json`` must hold ``param_groups`` and ``state``, and ``meta.json`` must hold an
  integer ``step`` equal to the manifest's;
- it must not be marked bad: a checkpoint that a worker found damaged when it loaded it (a
  checksum or structure that ``verify`` refused then: it changed after it was chosen) gets a
  ``BAD`` file with the reason (``mark_bad``), which ``verify`` refuses from then on; deleting
  the file lets the checkpoint be chosen again. A checkpoint that verifies but does not fit the
  script resuming it (``CheckpointMismatch``: another model, optimizer or tracked state) is
  never marked: the fault is the script's, and the right script resumes from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import xxhash

from tidal.checkpoint.location import Location, base_name, is_url

MANIFEST = "MANIFEST.json"
BAD = "BAD"
NAME_RE = re.compile(r"^step-(\d{8,})$")
CHUNK = 1 << 20
TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")
REQUIRED = (*TENSOR_FILES, "optimizer.json", "meta.json")
# The tracked objects' state (``tidal.tracked``): both or neither (a checkpoint written before
# Tidal carried tracked state has neither; loading it into a Trainer that tracks something is
# refused then).
TRACKED_TENSORS, TRACKED_JSON = "tracked.safetensors", "tracked.json"
OPTIONAL = (TRACKED_TENSORS, TRACKED_JSON)
TRACKED_KEY_RE = re.compile(r"^t\.\d+$")
OPTIMIZER_KEY_RE = re.compile(r"^state\.\d+\..+$")
# A sharded checkpoint (``sharding="fsdp"``, ``tidal.checkpoint.sharded``): the manifest says
# ``"layout": "sharded"`` and ``"shards": W``; each member's rows are in its own file.
SHARDED = "sharded"
REPLICATED = "replicated.safetensors"
SHARDED_REQUIRED = (REPLICATED, "optimizer.json", "meta.json")
ROW_KEY_RE = re.compile(r"^(p\.[^.].*|o\.[^.].*\..+)$")


def shard_file(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that must not be used; the message names it and says why."""


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint (it verifies) that does not fit the script loading it: its model,
    optimizer or tracked state is not the script's. It is kept, never marked bad."""

    def __init__(self, path: Path | str, why: str) -> None:
        # What matters first: a worker's failure line is the log's last 300 characters.
        super().__init__(
            f"checkpoint {path} refused, and kept: {why}; it does not fit this script (resume "
            "with the script that wrote it, or move its folder away to resume from an older one)"
        )


def marks_bad(exc: CheckpointError) -> bool:
    """Whether a checkpoint whose load raised ``exc`` is marked bad: only for what is wrong
    with the checkpoint itself (``verify`` refused it), never for a script it does not fit."""
    return not isinstance(exc, CheckpointMismatch)


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


# -- temporary folders: a write in progress, or the remains of a writer that died in one ---
TMP_RE = re.compile(r"^\.tmp-step-\d{8,}-[0-9a-f]+-(\d+)@(.+)$")
#: A temporary folder whose writer cannot be asked (another host's, or an older name
#: without one) is removed only once it is this old: no checkpoint write takes an hour.
STALE_TMP_S = 3600.0


def temporary_name(step: int, *, pid: int, host: str) -> str:
    """The folder a write of ``step`` goes into before its rename: names its writer."""
    return f".tmp-{checkpoint_name(step)}-{uuid.uuid4().hex[:8]}-{pid}@{host}"


def stale_temporary(
    name: str, *, age_s: float, host: str, alive: Callable[[int], bool]
) -> str | None:
    """Why the temporary folder ``name`` (``age_s`` old) is the remains of a dead write and
    may be removed, or None to leave it (a write in progress, or not a temporary folder).

    A writer on this ``host`` is asked directly (``alive(pid)``); a pid may be reused, which
    only keeps a dead write's folder a while longer. Anything else waits ``STALE_TMP_S``.
    """
    if not name.startswith(".tmp-"):
        return None
    m = TMP_RE.match(name)
    if m and m.group(2) == host:
        pid = int(m.group(1))
        return None if alive(pid) else f"its writer (pid {pid}) is gone"
    if age_s > STALE_TMP_S:
        return f"{age_s / 3600:.1f} h old"
    return None


def step_of(where: Location) -> int:
    """The step a checkpoint's folder name says (``step-00000100``: 100)."""
    m = NAME_RE.match(base_name(where))
    if m is None:
        raise ValueError(f"{where} is not a checkpoint's folder")
    return int(m.group(1))


def list_checkpoints(directory: Location) -> list[Location]:
    """Complete-looking checkpoint folders, newest first (temporary folders never count).
    At a URL (``remote``): every ``step-*`` prefix, a write in progress too (no manifest yet:
    ``verify`` refuses it)."""
    if is_url(directory):
        from tidal.checkpoint import remote

        return remote.list_checkpoints(directory)
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and NAME_RE.match(p.name)]
    return sorted(found, key=lambda p: int(NAME_RE.match(p.name).group(1)), reverse=True)


#: The checksums a manifest may give a file, by their key in its entry: XXH3-128, which
#: the writer computes while writing (``tensorfile``), and sha256, which checkpoints
#: written before it carry.
HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def file_digest(path: Path, algorithm: str) -> str:
    h = HASHES[algorithm]()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256(path: Path) -> str:
    return file_digest(path, "sha256")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path.name} is not readable JSON ({_one_line(exc)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return data


def _tensor_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file whose header (names, dtypes, shapes, offsets
    against the file's size) parses; reads no tensor data."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return list(f.keys())
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{path.name} is not a safetensors file ({_one_line(exc)})") from None


def bad_reason(path: Path) -> str | None:
    """Why the checkpoint was marked bad, or None."""
    try:
        return (path / BAD).read_text().strip() or "marked bad"
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"marked bad ({_one_line(exc)})"


def mark_bad(path: Location, reason: str) -> bool:
    """Record that ``path`` failed to load (``BAD``, written atomically); False if the folder
    cannot be written (it is then refused again by the same load, as before)."""
    if is_url(path):
        from tidal.checkpoint import remote

        return remote.mark_bad(path, reason)
    path = Path(path)
    tmp = path / f".{BAD}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(" ".join(reason.split()) + "\n")
        os.replace(tmp, path / BAD)
        return True
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        return False


def manifest_files(manifest: dict, name: str) -> list[str]:
    """The files a checkpoint folder named ``name`` must hold, as its ``manifest`` lists
    them (each entry with an integer size); raises ValueError saying what is wrong with the
    manifest itself (its files are not looked at: ``verify``). Pure: a folder's manifest and
    an object store's (``remote``) are read by the same rule."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError("the manifest has no table of files")
    sharded = manifest.get("layout") == SHARDED
    shards = manifest.get("shards")
    if sharded and not (_is_int(shards) and shards >= 1):
        raise ValueError("the manifest of a sharded checkpoint gives no number of shards")
    required = (
        (*(shard_file(r, shards) for r in range(shards)), *SHARDED_REQUIRED)
        if sharded
        else REQUIRED
    )
    missing = [n for n in required if n not in files]
    if missing:
        raise ValueError(f"the manifest does not list {', '.join(missing)}")
    extra = sorted(set(files) - set(required) - set(OPTIONAL))
    if extra:
        raise ValueError(f"the manifest lists unexpected files: {', '.join(extra)}")
    present = [n for n in OPTIONAL if n in files]
    if present and len(present) != len(OPTIONAL):
        raise ValueError(f"the manifest lists {present[0]} without its pair")
    step = manifest.get("step")
    if not _is_int(step):
        raise ValueError("the manifest has no integer step")
    named = NAME_RE.match(name)
    if named and int(named.group(1)) != step:
        raise ValueError(f"the manifest says step {step}, the folder's name another")
    for n in (*required, *present):
        want = files[n]
        if not (isinstance(want, dict) and _is_int(want.get("bytes"))):
            raise ValueError(f"the manifest's entry for {n} is malformed")
    return [*required, *present]


def verify(path: Path, *, hashes: bool = True) -> dict:
    """The manifest of a good checkpoint; raises CheckpointError naming what is wrong (see the
    module doc). ``hashes=False`` skips the checksums of the files (sizes are still checked):
    the cheap check ``tidal status`` uses to list checkpoints found on disk."""

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} refused: {why}")

    reason = bad_reason(path)
    if reason is not None:
        raise refuse(
            f"it failed to load before: {reason} (delete {path / BAD} to have it tried again)"
        )
    try:
        manifest = _json_object(path / MANIFEST)
    except ValueError as exc:
        raise refuse(f"unreadable manifest ({exc})") from None
    try:
        listed = manifest_files(manifest, path.name)
    except ValueError as exc:
        raise refuse(str(exc)) from None
    files, step = manifest["files"], manifest["step"]
    sharded, shards = manifest.get("layout") == SHARDED, manifest.get("shards")
    present = [n for n in OPTIONAL if n in files]
    for name in listed:
        want, f = files[name], path / name
        if not f.is_file():
            raise refuse(f"{name} is missing")
        if f.stat().st_size != want["bytes"]:
            raise refuse(f"{name} has {f.stat().st_size} bytes, the manifest says {want['bytes']}")
        algorithm = next((a for a in HASHES if isinstance(want.get(a), str)), None)
        if algorithm is None:
            raise refuse(f"the manifest gives no checksum for {name}")
        if hashes and file_digest(f, algorithm) != want[algorithm]:
            raise refuse(f"{algorithm} mismatch in {name}")
    try:
        meta = _json_object(path / "meta.json")
        if not _is_int(meta.get("step")):
            raise ValueError("meta.json has no integer step")
        if meta["step"] != step:
            raise ValueError(f"meta.json says step {meta['step']}, the manifest {step}")
        opt = _json_object(path / "optimizer.json")
        if not isinstance(opt.get("param_groups"), list) or not isinstance(opt.get("state"), dict):
            raise ValueError("optimizer.json has no param_groups list and state table")
        if sharded:
            _check_shards(path, shards, meta)
        else:
            if not _tensor_names(path / "model.safetensors"):
                raise ValueError("model.safetensors holds no tensors")
            odd = [
                k
                for k in _tensor_names(path / "optimizer.safetensors")
                if not OPTIMIZER_KEY_RE.match(k)
            ]
            if odd:
                raise ValueError(f"optimizer.safetensors holds a tensor named {odd[0]!r}")
        if present:
            _check_tracked(path)
    except ValueError as exc:
        raise refuse(str(exc)) from None
    return manifest


def _check_shards(path: Path, shards: int, meta: dict) -> None:
    """Every shard holds rows of the keys ``meta.json`` lists, and nothing else."""
    keys = meta.get("keys")
    if not isinstance(keys, dict) or not keys:
        raise ValueError("meta.json of a sharded checkpoint lists no row keys")
    for r in range(shards):
        names = _tensor_names(path / shard_file(r, shards))
        odd = [k for k in names if k not in keys or not ROW_KEY_RE.match(k)]
        if odd:
            raise ValueError(f"{shard_file(r, shards)} holds a tensor named {odd[0]!r}")
    _tensor_names(path / REPLICATED)


def _check_tracked(path: Path) -> None:
    tracked = _json_object(path / TRACKED_JSON)
    layout = tracked.get("tensors")
    if not isinstance(tracked.get("skeleton"), dict) or not isinstance(layout, list):
        raise ValueError(f"{TRACKED_JSON} has no skeleton table and tensors list")
    names = _tensor_names(path / TRACKED_TENSORS)
    if sorted(names) != sorted(f"t.{i}" for i in range(len(layout))):
        raise ValueError(f"{TRACKED_TENSORS} does not hold the tensors {TRACKED_JSON} lists")


def newest_good(directory: Location) -> tuple[Location | None, list[str]]:
    """The newest checkpoint that verifies, and a warning line for each newer one refused.
    At a URL each candidate is verified in a local copy (``remote.newest_good``)."""
    if is_url(directory):
        from tidal.checkpoint import remote

        return remote.newest_good(directory)
    directory = Path(directory)
    warnings = []
    for path in list_checkpoints(directory):
        try:
            verify(path)
            return path, warnings
        except CheckpointError as exc:
            warnings.append(str(exc))
    return None, warnings


def newest_usable(directory: Location) -> tuple[Location | None, int | None, list[str]]:
    """``newest_good`` and its step, for the coordinator's loop, which must not die of a
    storage outage: a folder or store that cannot be read is a warning and no checkpoint."""
    try:
        path, warnings = newest_good(directory)
    except OSError as exc:
        return None, None, [f"the checkpoints in {directory} could not be read: {exc}"]
    return path, (step_of(path) if path is not None else None), warnings


def found_on_disk(directory: Location) -> list[tuple[int, Location, int]]:
    """``(step, path, bytes)`` of the checkpoints in ``directory`` that pass the cheap check
    (``verify(hashes=False)``; at a URL: the manifest's rules and the objects' sizes),
    oldest first."""
    if is_url(directory):
        from tidal.checkpoint import remote

        return remote.found(directory)
    directory = Path(directory)
    found = []
    for path in list_checkpoints(directory):
        try:
            manifest = verify(path, hashes=False)
        except CheckpointError:
            continue
        size = sum(f["bytes"] for f in manifest["files"].values())
        found.append((manifest["step"], path, size))
    return found[::-1]


@contextmanager
def readable(path: Location) -> Iterator[Path]:
    """``path`` as a folder of this machine, for ``verify`` and the loaders: a folder is
    itself; a checkpoint at a URL is downloaded into a temporary folder, removed after
    (``remote.local_copy``: refusals name the URL)."""
    if is_url(path):
        from tidal.checkpoint import remote

        with remote.local_copy(path) as local:
            yield local
    else:
        yield Path(path)
