"""Which run of a job may write its checkpoints: the fence file ``CHECKPOINTS/.fence``.

A job's checkpoint folder outlives the processes that write into it: after its coordinator
and ``tidal run`` died, its workers train on (until ``--orphan-timeout``), and a ``tidal
resume`` starts a new set beside any it could not end (on another host). Without a fence the
old set went on writing checkpoints and pruning the new set's, and rewrote a finished job's
final checkpoint minutes after it ended (issue 50 finding 3).

Contract:

- Each coordinator that starts a run (``tidal run``, ``tidal resume``) draws a new ``epoch``
  and writes it here before it starts a worker; a coordinator that takes over the same run
  (a restart by its supervisor, ``tidal attach``) keeps the epoch on disk. Workers get it at
  registration (``WorkerConfig.checkpoint_fence``).
- A writer publishes (renames a finished write into place) and prunes only while the fence
  names its epoch and is not sealed (``refusal``); it checks just before the rename.
- A job that ended seals its fence (``sealed``: why): its checkpoints are final; only a
  ``tidal resume`` (a new epoch) opens the folder again.
- A writer that holds no epoch (a script run alone, a worker of a version before fences) and
  a folder without a fence are not fenced.

The check and the rename are two steps: a fence moved in between lets one last write land.
``tidal resume`` therefore also ends the old set's local processes first
(``coordinator.fencing``); the fence covers those it cannot reach.

Beside the fence, a run that starts with ``--checkpoint-dir`` (a folder outside its home)
copies the job's spec (``SPEC``): the folder says whose it is, and ``tidal resume NAME --checkpoint-dir DIR|URL`` rebuilds a job whose home is gone
from it. Both are single small files, replaced atomically (a rename in a folder, one PUT at a
URL: ``remote``).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from tidal.checkpoint.location import Location, is_url

FENCE = ".fence"
SPEC = "spec.json"


@dataclass(frozen=True)
class Fence:
    epoch: str
    sealed: str | None = None  # why the job's checkpoints are final (it ended)


class Fenced(RuntimeError):
    """This writer's run no longer owns the checkpoint folder; the message says why."""


def read(directory: Location) -> Fence | None:
    """The folder's fence; None if it has none (or it cannot be read as one)."""
    try:
        data = json.loads(_read(directory, FENCE))
        return Fence(epoch=str(data["epoch"]), sealed=data.get("sealed"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(directory: Location, fence: Fence) -> None:
    """Replace the folder's fence atomically (the folder is made if missing)."""
    data = json.dumps({"epoch": fence.epoch, "sealed": fence.sealed}).encode()
    if is_url(directory):
        from tidal.checkpoint import remote

        remote.write_bytes(f"{directory}/{FENCE}", data)
        return
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"{FENCE}.{os.getpid()}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, directory / FENCE)


def read_spec(directory: Location) -> dict | None:
    """The job's spec copied into its checkpoint folder (``SPEC``), or None."""
    try:
        data = json.loads(_read(directory, SPEC))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_spec(directory: Location, spec: dict) -> None:
    """Copy the job's spec into its checkpoint folder, atomically; raises OSError."""
    data = json.dumps(spec, indent=1, sort_keys=True).encode()
    if is_url(directory):
        from tidal.checkpoint import remote

        remote.write_bytes(f"{directory}/{SPEC}", data)
        return
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{SPEC}.{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, directory / SPEC)
    finally:
        tmp.unlink(missing_ok=True)


def _read(directory: Location, name: str) -> bytes:
    """A small file of the folder; raises OSError (FileNotFoundError if it is not there)."""
    if is_url(directory):
        from tidal.checkpoint import remote

        data = remote.read_bytes(f"{directory}/{name}")
        if data is None:
            raise FileNotFoundError(f"{directory}/{name}")
        return data
    return (Path(directory) / name).read_bytes()


def refusal(held: str | None, on_disk: Fence | None) -> str | None:
    """Why a writer holding epoch ``held`` must not publish into (or prune) a folder whose
    fence is ``on_disk``; None if it may."""
    if held is None or on_disk is None:
        return None
    if on_disk.sealed is not None:
        return f"the job's checkpoints are final ({on_disk.sealed})"
    if on_disk.epoch != held:
        return "a newer run of the job (`tidal resume`) owns its checkpoints"
    return None


def check(directory: Location, held: str | None) -> None:
    """Raise ``Fenced`` if a writer holding ``held`` must not publish into ``directory``."""
    why = refusal(held, read(directory) if held is not None else None)
    if why is not None:
        raise Fenced(f"not written: {why}")
