"""Checkpoint folders at an fsspec URL (``s3://``, ``gs://``, ``az://``, ...): the layout of a
local folder (``layout``), written and read without a rename.

An object store has no atomic rename of a folder (S3's is a copy and a delete per object),
so a write goes straight to its final prefix ``URL/step-NNNNNNNN/`` (``staging``) and the
manifest is the commit. Contracts:

- **Complete means manifest.** Every object becomes visible only once its upload completed
  (a PUT, or a completed multipart upload; the parts of an interrupted one are never
  listed), and ``MANIFEST.json`` is uploaded after every file it lists. A prefix without a
  manifest is a write in progress or an interrupted one: listed, never chosen (``verify``
  refuses it). A rewrite of a step deletes its manifest first; a prune too.
- **Verified as a folder.** ``local_copy`` downloads the manifest and the files it lists (only
  names the layout knows) into a temporary folder, where ``layout.verify`` and the loaders
  check sizes, XXH3-128 checksums and structure as for a local checkpoint; refusals name the
  URL. ``BAD`` is an object as it is a file.
- **Pruned** by ``doomed`` (pure): all but the newest ``keep`` complete checkpoints, and the
  incomplete prefixes older than the newest complete one (a writer writes one checkpoint
  at a time, so those are interrupted writes).
- **Configured as fsspec is.** Tidal passes no storage options: the endpoint and credentials
  are the filesystem's own defaults (for S3: the AWS variables and files; fsspec's
  configuration, e.g. ``FSSPEC_S3_ENDPOINT_URL``), so the same URL works in every process.
- Every failure of the store is an ``OSError`` naming the URL (``errors``).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tidal.checkpoint.fence import read as read_fence
from tidal.checkpoint.fence import refusal
from tidal.checkpoint.layout import (
    BAD,
    MANIFEST,
    NAME_RE,
    CheckpointError,
    manifest_files,
    verify,
)
from tidal.checkpoint.location import base_name

#: Installs of the filesystems users name most; others: fsspec's list of implementations.
PACKAGES = {"s3": "s3fs (pip install 'tidal[s3]')", "gs": "gcsfs", "gcs": "gcsfs"}
PACKAGES |= {"az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}


def check_url(url: str) -> None:
    """One line (``ValueError``) if no fsspec filesystem for ``url`` is installed here."""
    import fsspec

    scheme = url.split("://", 1)[0].lower()
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError:
        need = PACKAGES.get(scheme, f"fsspec's {scheme} implementation")
        raise ValueError(f"--checkpoint-dir {url} needs {need}, which is not installed") from None
    except ValueError:
        raise ValueError(
            f"--checkpoint-dir {url}: fsspec knows no {scheme}:// filesystem"
        ) from None


@contextmanager
def errors(url: str) -> Iterator[None]:
    """Any failure of the store inside is an ``OSError`` naming ``url`` (botocore's and
    aiohttp's errors are not ``OSError``); one line."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the filesystem raises: one line
        why = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise OSError(f"{url}: {why}") from exc


def filesystem(url: str):  # noqa: ANN201 - an fsspec AbstractFileSystem
    """``(fs, path)`` of ``url``: the filesystem (with fsspec's configuration) and the path
    it takes."""
    import fsspec

    with errors(url):
        try:
            return fsspec.core.url_to_fs(url)
        except ImportError as exc:
            raise OSError(f"{url}: {exc}") from None


def read_bytes(url: str) -> bytes | None:
    """The object at ``url``; None if there is none."""
    fs, path = filesystem(url)
    with errors(url):
        try:
            return fs.cat_file(path)
        except FileNotFoundError:
            return None


def write_bytes(url: str, data: bytes) -> None:
    """Replace the object at ``url`` (one PUT: whole or not at all)."""
    fs, path = filesystem(url)
    with errors(url):
        fs.pipe_file(path, data)


def scan(url: str) -> dict[str, dict[str, int]]:
    """The ``step-*`` prefixes under ``url``: name -> {file name: bytes} (one listing)."""
    fs, root = filesystem(url)
    root = root.rstrip("/")
    with errors(url):
        fs.invalidate_cache(root)  # another process wrote meanwhile: never a stale listing
        try:
            listing = fs.find(root, detail=True)
        except FileNotFoundError:
            return {}
    found: dict[str, dict[str, int]] = {}
    for key, info in listing.items():
        parts = key[len(root) :].strip("/").split("/") if key.startswith(root) else []
        if len(parts) == 2 and NAME_RE.match(parts[0]):
            found.setdefault(parts[0], {})[parts[1]] = int(info.get("size") or 0)
    return found


def _newest_first(names: object) -> list[str]:
    return sorted(names, key=lambda n: int(NAME_RE.match(n).group(1)), reverse=True)


def list_checkpoints(url: str) -> list[str]:
    """Every checkpoint prefix under ``url``, newest first (complete or not)."""
    return [f"{url}/{name}" for name in _newest_first(scan(url))]


def doomed(folders: list[tuple[int, bool]], keep: int) -> list[int]:
    """The steps a prune deletes, of ``folders`` (``(step, complete)``, any order): every
    complete one but the newest ``keep``, and every incomplete one older than the newest
    complete one (an interrupted write: a writer writes one checkpoint at a time)."""
    complete = sorted((s for s, done in folders if done), reverse=True)
    newest = complete[0] if complete else None
    kept = set(complete[:keep])
    return sorted(
        s
        for s, done in folders
        if (done and s not in kept) or (not done and newest is not None and s < newest)
    )


def remove(url: str) -> None:
    """Delete the checkpoint prefix ``url``: its manifest first (never a complete-looking
    remainder), then the rest."""
    fs, path = filesystem(url)
    with errors(url):
        try:
            fs.rm_file(f"{path}/{MANIFEST}")
        except FileNotFoundError:
            pass
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass


def prune(url: str, keep: int, *, fence: str | None = None) -> list[str]:
    """``store.prune`` at a URL (``doomed``); a writer whose run no longer owns the folder
    deletes nothing. Returns the prefixes deleted."""
    if refusal(fence, read_fence(url) if fence is not None else None):
        return []
    folders = scan(url)
    steps = {int(NAME_RE.match(n).group(1)): n for n in folders}
    gone = []
    for step in doomed([(s, MANIFEST in folders[n]) for s, n in steps.items()], keep):
        remove(f"{url}/{steps[step]}")
        gone.append(f"{url}/{steps[step]}")
    return gone


def mark_bad(url: str, reason: str) -> bool:
    """``layout.mark_bad`` at a URL: a ``BAD`` object; False if it cannot be written."""
    try:
        write_bytes(f"{url}/{BAD}", (" ".join(reason.split()) + "\n").encode())
        return True
    except OSError:
        return False


def _listed(local: Path, name: str) -> list[str]:
    """The files the downloaded manifest lists (names the layout knows only), or none."""
    try:
        return manifest_files(json.loads((local / MANIFEST).read_text()), name)
    except (OSError, ValueError, TypeError, AttributeError):
        return []


@contextmanager
def local_copy(url: str) -> Iterator[Path]:
    """The checkpoint at ``url`` downloaded into a temporary folder of the same name (its
    manifest, ``BAD`` and the files the manifest lists), removed after. A ``CheckpointError``
    raised inside names ``url``, not the copy."""
    fs, root = filesystem(url)
    root = root.rstrip("/")
    name = base_name(url)
    with tempfile.TemporaryDirectory(prefix="tidal-checkpoint-") as tmp:
        local = Path(tmp) / name
        local.mkdir()
        with errors(url):
            fs.invalidate_cache(root)
            try:
                there = {base_name(p) for p in fs.ls(root, detail=False)}
            except FileNotFoundError:
                there = set()
            for file in (MANIFEST, BAD):
                if file in there:
                    fs.get_file(f"{root}/{file}", str(local / file))
            for file in _listed(local, name):
                if file in there:
                    fs.get_file(f"{root}/{file}", str(local / file))
        try:
            yield local
        except CheckpointError as exc:
            exc.args = (str(exc).replace(str(local), url),)
            raise


def newest_good(url: str) -> tuple[str | None, list[str]]:
    """``layout.newest_good`` at a URL: each candidate, newest first, downloaded and verified
    (``local_copy``); a failure of the store raises ``OSError`` (not a refusal: an older
    checkpoint is not chosen because the store did not answer)."""
    warnings = []
    for path in list_checkpoints(url):
        try:
            with local_copy(path) as local:
                verify(local)
            return path, warnings
        except CheckpointError as exc:
            warnings.append(str(exc))
    return None, warnings


def found(url: str) -> list[tuple[int, str, int]]:
    """``layout.found_on_disk`` at a URL: ``(step, url, bytes)`` of the complete-looking
    checkpoints (a manifest the layout's rules accept, each file listed there with its size,
    no ``BAD``), oldest first; reads the manifests only."""
    out = []
    for name, files in scan(url).items():
        if MANIFEST not in files or BAD in files:
            continue
        try:
            manifest = json.loads(read_bytes(f"{url}/{name}/{MANIFEST}") or b"null")
            listed = manifest_files(manifest, name)
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        sizes = {n: manifest["files"][n]["bytes"] for n in listed}
        if all(files.get(n) == size for n, size in sizes.items()):
            out.append((manifest["step"], f"{url}/{name}", sum(sizes.values())))
    return sorted(out)
