"""Where a checkpoint is written before it counts: one write's files, its manifest last.

``begin(directory, step)`` opens the write of ``step`` (the one writer, or rank 0 of a
sharded write), ``join(directory, name)`` the same write for another member (``name`` is
what rank 0 broadcast). A ``Staging`` writes tensor files (hashed while written,
``tensorfile``) and JSON files, each adding its manifest entry, then ``publish``es; on any
failure the writer calls ``discard``. Two kinds, one contract (a checkpoint is visible only
once complete):

- ``LocalStaging``, a folder (local or shared): the files go into a temporary folder
  (``layout.temporary_name``), every file fsynced, the manifest last and fsynced, then the
  folder is renamed into place and its parent fsynced: a crash leaves no ``step-*`` folder or
  a complete one.
- ``ObjectStaging``, an fsspec URL (``remote``): no rename, so the files are uploaded to the
  final prefix, after deleting a previous manifest of the same step, and the manifest is
  uploaded last: a crash leaves a prefix without a manifest, which ``verify`` refuses.

Both check the writer's fence (``fence.check``) just before the step that makes it count;
at a URL also before the write begins, since its files land where the owner's would (a
fenced writer never clears nor discards the prefix: what it may hold is the new run's).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import torch
import xxhash

from tidal.checkpoint import remote
from tidal.checkpoint.fence import Fenced
from tidal.checkpoint.fence import check as check_fence
from tidal.checkpoint.layout import MANIFEST, checkpoint_name, file_digest, temporary_name
from tidal.checkpoint.location import Location, is_url
from tidal.checkpoint.tensorfile import HASH, write_tensors, write_tensors_to


def _json_bytes(data: object) -> bytes:
    return json.dumps(data, indent=1, sort_keys=True).encode()


# -- a folder --------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_json_files(tmp: Path, files: dict, contents: dict[str, object]) -> None:
    """Write each JSON file into the write's folder, fsynced; its manifest entry in ``files``."""
    for name, data in contents.items():
        (tmp / name).write_bytes(_json_bytes(data))
        _fsync_file(tmp / name)
        files[name] = {HASH: file_digest(tmp / name, HASH), "bytes": (tmp / name).stat().st_size}


def publish(tmp: Path, final: Path, manifest: dict, *, fence: str | None = None) -> None:
    """The manifest last, fsynced, then the folder renamed into place and its parent
    fsynced: a crash leaves no ``step-*`` folder or a complete one. ``fence``: the writer's
    run (``checkpoint.fence``); ``fence.Fenced`` instead of the rename if it no longer owns
    the folder."""
    (tmp / MANIFEST).write_bytes(_json_bytes(manifest))
    _fsync_file(tmp / MANIFEST)
    _fsync_dir(tmp)
    check_fence(final.parent, fence)
    if final.exists():  # the same step written again (e.g. a stop right after a save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


class LocalStaging:
    """A write into a temporary folder of ``directory``, renamed into place (module doc)."""

    def __init__(self, directory: Path, name: str, step: int) -> None:
        self.directory, self.name = directory, name
        self.tmp = directory / name
        self.final = str(directory / checkpoint_name(step))

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> dict:
        size, digest = write_tensors(self.tmp / name, tensors)  # fsynced, hashed while written
        return {HASH: digest, "bytes": size}

    def write_json(self, files: dict, contents: dict[str, object]) -> None:
        write_json_files(self.tmp, files, contents)

    def publish(self, manifest: dict, *, fence: str | None = None) -> None:
        publish(self.tmp, Path(self.final), manifest, fence=fence)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


# -- an fsspec URL ---------------------------------------------------------------------------
class ObjectStaging:
    """A write straight into the final prefix, the manifest uploaded last (module doc)."""

    def __init__(self, directory: str, step: int) -> None:
        self.directory, self.name = directory, checkpoint_name(step)
        self.final = f"{directory}/{self.name}"
        self.fs, self.path = remote.filesystem(self.final)
        self.fenced = False

    def clear(self) -> None:
        """A previous write of the same step goes, its manifest first."""
        remote.remove(self.final)

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> dict:
        with remote.errors(f"{self.final}/{name}"):
            with self.fs.open(f"{self.path}/{name}", "wb") as f:
                size, digest = write_tensors_to(f, tensors)
        return {HASH: digest, "bytes": size}

    def write_json(self, files: dict, contents: dict[str, object]) -> None:
        for name, data in contents.items():
            raw = _json_bytes(data)
            remote.write_bytes(f"{self.final}/{name}", raw)
            files[name] = {HASH: xxhash.xxh3_128(raw).hexdigest(), "bytes": len(raw)}

    def publish(self, manifest: dict, *, fence: str | None = None) -> None:
        self.check(fence)
        remote.write_bytes(f"{self.final}/{MANIFEST}", _json_bytes(manifest))

    def check(self, fence: str | None) -> None:
        """``fence.check``; once refused, this write leaves the prefix alone."""
        try:
            check_fence(self.directory, fence)
        except Fenced:
            self.fenced = True
            raise

    def discard(self) -> None:
        if self.fenced:
            return
        try:
            remote.remove(self.final)
        except OSError:  # the store is gone: the prefix has no manifest, pruned later
            pass


Staging = LocalStaging | ObjectStaging


def begin(directory: Location, step: int, *, fence: str | None = None) -> Staging:
    """Open the write of ``step`` into ``directory`` (made if missing); raises OSError, and
    ``fence.Fenced`` at a URL whose folder the writer's run (``fence``) no longer owns."""
    if is_url(directory):
        staging = ObjectStaging(str(directory), step)
        staging.check(fence)
        staging.clear()
        return staging
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = temporary_name(step, pid=os.getpid(), host=socket.gethostname())
    (directory / name).mkdir()
    return LocalStaging(directory, name, step)


def join(directory: Location, name: str, step: int) -> Staging:
    """The write ``begin`` opened as ``name`` (``Staging.name``), for another member."""
    if is_url(directory):
        return ObjectStaging(str(directory), step)
    return LocalStaging(Path(directory), name, step)
