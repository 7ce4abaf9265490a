"""Token shards: fixed-length windows over flat token files, by global sample index.

A language-model corpus is often one or more flat arrays of token ids on disk (nanoGPT's
``train.bin``: uint16 or uint32, no header; or ``.npy`` files). ``TokenShards`` maps each
file with ``numpy.memmap`` (read-only) and serves window ``i`` on demand, so a job over
billions of tokens needs no index in memory and no read at start-up beyond each file's size
(and a ``.npy`` header). Only the windows a step asks for are read.

Layout: window ``j`` of a file covers tokens ``[j * seq_len, j * seq_len + seq_len + 1)``:
``seq_len`` inputs and their next-token targets, so consecutive windows share one token and a
file of ``t`` tokens holds ``(t - 1) // seq_len`` windows (the tail that does not fill one is
unused). Windows never cross files. Global index ``i`` runs over file 0's windows, then file
1's, and so on: a prefix sum over the files and a binary search per lookup.

Since Tidal's sampler makes the sample ids of each step a function of the step alone, a job
over ``TokenShards`` resumes, at any world size, at exactly the next window.
"""

from __future__ import annotations

import bisect
import operator
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

PathLike = str | os.PathLike
# Token ids become int64 tensors: every integer dtype whose values fit in int64.
SUPPORTED = tuple(
    np.dtype(d) for d in ("uint8", "uint16", "uint32", "int8", "int16", "int32", "int64")
)
_SUPPORTED_NAMES = ", ".join(d.name for d in SUPPORTED)


def _as_dtype(dtype: Any, where: str) -> np.dtype:
    """``dtype`` (a numpy dtype or its name, or a torch integer dtype) as a numpy dtype."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"TokenShards: {where}: unsupported dtype {dtype!r} ({exc})") from None
    if np_dtype.newbyteorder("=") not in SUPPORTED:
        raise ValueError(
            f"TokenShards: {where}: unsupported dtype {np_dtype.name}; token files hold one of "
            f"{_SUPPORTED_NAMES}"
        )
    return np_dtype


class _Shard:
    """One token file: its path, dtype, length in tokens and (once opened) its memmap."""

    def __init__(self, path: Path, dtype: np.dtype | None) -> None:
        self.path = path
        if not path.is_file():
            what = "is not a file" if path.exists() else "no such file"
            raise ValueError(f"TokenShards: {path}: {what}")
        if path.suffix == ".npy":
            self.dtype, self.offset, self.tokens = self._npy_header(path, dtype)
        else:
            self.dtype = dtype if dtype is not None else np.dtype(np.uint16)
            self.offset = 0
            size = path.stat().st_size
            if size % self.dtype.itemsize:
                raise ValueError(
                    f"TokenShards: {path}: {size} bytes is not a multiple of "
                    f"{self.dtype.name}'s {self.dtype.itemsize} bytes (wrong dtype, or a "
                    f"truncated file)"
                )
            self.tokens = size // self.dtype.itemsize
        self._map: np.ndarray | None = None

    @staticmethod
    def _npy_header(path: Path, dtype: np.dtype | None) -> tuple[np.dtype, int, int]:
        """(dtype, data offset, tokens) from a ``.npy`` header, checked against the size."""
        fmt = np.lib.format
        try:
            with open(path, "rb") as fh:
                version = fmt.read_magic(fh)
                read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
                shape, fortran, file_dtype = read(fh)
                offset = fh.tell()
        except ValueError as exc:
            raise ValueError(f"TokenShards: {path}: not a readable .npy file ({exc})") from None
        file_dtype = _as_dtype(file_dtype, str(path))
        if dtype is not None and dtype != file_dtype:
            raise ValueError(
                f"TokenShards: {path}: the file holds {file_dtype.name}, not dtype="
                f"{dtype.name} (a .npy file's dtype comes from its header: pass dtype=None)"
            )
        if len(shape) != 1:
            raise ValueError(
                f"TokenShards: {path}: a token file is a flat array; this one has shape {shape}"
            )
        (tokens,) = shape
        need = offset + tokens * file_dtype.itemsize
        size = path.stat().st_size
        if size != need:
            raise ValueError(
                f"TokenShards: {path}: {size} bytes, but its header says {tokens} "
                f"{file_dtype.name} tokens ({need} bytes; a truncated file?)"
            )
        return file_dtype, offset, tokens

    def array(self) -> np.ndarray:
        """The file's tokens, mapped read-only on first use (in each process)."""
        if self._map is None:
            self._map = np.memmap(
                self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.tokens,)
            )
        return self._map

    def __getstate__(self) -> dict:
        # A pickled memmap would carry the whole file's bytes: reopen it where unpickled.
        return {**self.__dict__, "_map": None}


class TokenShards(Dataset):
    """Windows of ``seq_len + 1`` tokens over one or more flat token files.

    ``paths``: one path or a sequence of them, read in the order given. A ``.npy`` file
    carries its dtype in its header; any other file is raw tokens (the nanoGPT ``.bin``
    layout) of ``dtype`` (default uint16). Sample ``i`` is an int64 tensor of ``seq_len + 1``
    tokens: ``x = w[:-1]`` are the inputs, ``y = w[1:]`` their next-token targets.
    """

    def __init__(
        self, paths: PathLike | Sequence[PathLike], seq_len: int, *, dtype: Any = None
    ) -> None:
        if isinstance(paths, str | os.PathLike):
            paths = [paths]
        paths = [Path(p) for p in paths]
        if not paths:
            raise ValueError("TokenShards: no paths given (one or more token files)")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"TokenShards: seq_len must be an integer >= 1, got {seq_len!r}")
        self.seq_len = seq_len
        np_dtype = None if dtype is None else _as_dtype(dtype, "dtype argument")
        self.shards = [_Shard(p, np_dtype) for p in paths]
        self.starts = [0]  # global index of each file's first window
        for shard in self.shards:
            if shard.tokens < seq_len + 1:
                raise ValueError(
                    f"TokenShards: {shard.path}: {shard.tokens} tokens, fewer than one window "
                    f"of seq_len + 1 = {seq_len + 1}"
                )
            self.starts.append(self.starts[-1] + (shard.tokens - 1) // seq_len)

    @property
    def paths(self) -> list[Path]:
        return [s.path for s in self.shards]

    @property
    def tokens(self) -> int:
        """Tokens in all the files (the tails that fill no window included)."""
        return sum(s.tokens for s in self.shards)

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, index: int) -> tuple[Path, int]:
        """(file, first token's position in it) of window ``index``."""
        i = operator.index(index)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {index} out of range for TokenShards of {n} windows")
        i %= n
        f = bisect.bisect_right(self.starts, i) - 1
        return self.shards[f].path, (i - self.starts[f]) * self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        i = operator.index(index)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {index} out of range for TokenShards of {n} windows")
        i %= n
        f = bisect.bisect_right(self.starts, i) - 1
        start = (i - self.starts[f]) * self.seq_len
        window = self.shards[f].array()[start : start + self.seq_len + 1]
        return torch.from_numpy(window.astype(np.int64))  # a copy: nothing aliases the map

    def __repr__(self) -> str:
        files = ", ".join(str(p) for p in self.paths[:3]) + (", ..." if len(self.paths) > 3 else "")
        return f"TokenShards([{files}], seq_len={self.seq_len}): {len(self)} windows"


def write_tokens(path: PathLike, tokens: Any, dtype: Any = np.uint16) -> Path:
    """Write ``tokens`` (a sequence, numpy array or tensor of ids) as a flat token file:
    ``.npy`` when ``path`` ends so (dtype in the header), else raw (``tofile``, no header).

    Atomic: written under a temporary name in the same folder and renamed into place, so
    several processes writing the same file at once, or a reader, never see half of one.
    Ids that do not fit ``dtype`` are refused.
    """
    path = Path(path)
    np_dtype = _as_dtype(dtype, str(path))
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    array = np.asarray(tokens)
    if array.ndim != 1:
        array = array.reshape(-1)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"write_tokens: {path}: token ids must be integers, got {array.dtype}")
    if array.size:
        info = np.iinfo(np_dtype)
        lo, hi = int(array.min()), int(array.max())
        if lo < info.min or hi > info.max:
            raise ValueError(
                f"write_tokens: {path}: ids range over [{lo}, {hi}], outside "
                f"{np_dtype.name}'s [{info.min}, {info.max}]"
            )
    array = array.astype(np_dtype, copy=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask's permissions
    try:
        with os.fdopen(fd, "wb") as fh:
            if path.suffix == ".npy":
                np.save(fh, array, allow_pickle=False)
            else:
                array.tofile(fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
