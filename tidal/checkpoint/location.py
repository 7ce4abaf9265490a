"""Where checkpoints live: a folder or an fsspec URL, named by one value.

A *location* is either a ``Path`` (a folder of this machine's file systems: a local disk, or
a shared one every host mounts at the same path) or a ``str`` URL of an fsspec filesystem
(``s3://BUCKET/PREFIX``, ``gs://``, ``az://``, ``abfs://``, ...; ``tidal.checkpoint.remote``
reads and writes those). ``file://`` URLs are folders. Pure string rules, no I/O: the checkpoint
modules dispatch on ``is_url`` and keep the local code path as it was.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

Location = Path | str
SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


def is_url(where: object) -> bool:
    """Whether ``where`` is a URL of an fsspec filesystem (not a folder, not ``file://``)."""
    if not isinstance(where, str):
        return False
    m = SCHEME_RE.match(where)
    return m is not None and m.group(1).lower() != "file"


def of(text: str | Path) -> Location:
    """The location ``text`` names: a URL stays a string (without a trailing ``/``); a folder,
    ``file://`` ones included, becomes a ``Path`` (as given: not resolved)."""
    if isinstance(text, Path):
        return text
    m = SCHEME_RE.match(text)
    if m is None:
        return Path(text)
    if m.group(1).lower() == "file":
        return Path(m.group(2) or "/")
    return f"{m.group(1)}://{m.group(2).rstrip('/')}"


def join(where: Location, *names: str) -> Location:
    """``where`` / ``names``: a path for a folder, ``URL/NAME/...`` for a URL."""
    if isinstance(where, Path):
        return where.joinpath(*names)
    return "/".join([where.rstrip("/"), *names])


def base_name(where: Location) -> str:
    """The last part of ``where`` (``step-00000100``), a folder's or a URL's."""
    return where.name if isinstance(where, Path) else PurePosixPath(where.rstrip("/")).name
