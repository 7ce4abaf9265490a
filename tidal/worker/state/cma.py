"""Cross-memory attach: a heal's receiver on the source's host reads the source's tensors
straight out of its memory, one copy, instead of through gloo's loopback sockets.

Over loopback a gloo transfer costs two copies (into the socket, out of it) on two cores,
and on a machine whose cores the training fills it shares them with the members' own
steps: 42 MB took 20 ms between two idle processes and 20 to 30 ms inside a scale-up.
``process_vm_readv(2)`` (what MPI libraries use for large messages within a node) moves the
same bytes with one copy on the receiver's core, ~5.6 GB/s here (``docs/decisions/same-host-heal.md``).

The source describes its tensors in the heal's blob (``offer``: its host, pid namespace,
pid, each tensor's address and length, and its ``Hold`` mark); a receiver that finds itself
on the same host, in the same pid namespace, with tensors of the same lengths in its own
memory, reads them all (``read``), checks that the source still held them when the read
ended (``held``), and tells the source whether it did; the source waits for every
receiver's word before it returns, so its tensors do not change under a read, and sends
through gloo to those that could not. A read the kernel refuses (no permission to attach, a seccomp
profile without the call, a source gone) is such a case: the heal falls back, it never
fails for it. The choice is ``usable``'s, a pure function with a reason.

Permission: reading another process's memory needs the right to ptrace it. With Yama's
``ptrace_scope`` 1 (Ubuntu's default) siblings lack it unless the source names a tracer, so
the source allows any tracer of its own user for the length of the heal (``allow``) and
withdraws it after; with scope 2 or 3 the source offers nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

IOV_MAX = 1024  # iovecs per call (Linux's UIO_MAXIOV)
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = -1
YAMA = Path("/proc/sys/kernel/yama/ptrace_scope")


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4  # full-width arguments
    libc.prctl.restype = ctypes.c_int
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return libc


_LIBC = _libc()


@dataclass(frozen=True, kw_only=True)
class Host:
    """Where a process runs, as far as reading its memory goes: the kernel's boot id (one
    per machine and boot) and the pid namespace (a pid means that process only inside it)."""

    boot_id: str
    pid_ns: int

    @classmethod
    def here(cls) -> Host | None:
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            return cls(boot_id=boot, pid_ns=os.stat("/proc/self/ns/pid").st_ino)
        except OSError:
            return None


def offerable(tensors: list[torch.Tensor]) -> bool:
    """Whether a source can offer these tensors: each in the CPU's memory and contiguous
    (one span of bytes a reader can name), the call available and a Yama scope that lets
    a sibling read once allowed."""
    if _LIBC is None or Host.here() is None or _yama_scope() > 1:
        return False
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


class Hold:
    """A mark in the source's memory saying its offered tensors are as offered: a random
    token while the source waits for its receivers' words, zero from the moment it stops
    waiting (``release``), however it stops (every word heard, or its wait cut by the abort
    watch, after which it may go on to change them). A receiver reads the mark after its
    copy (``held``): the token still there means the source had not stopped when the copy
    ended, so nothing copied changed under it; anything else, and the copy is refused as if
    the kernel had refused it. The token comes from ``os.urandom``: Python's ``random`` is
    part of the state the heal ships."""

    def __init__(self) -> None:
        token = (int.from_bytes(os.urandom(8), "little") >> 2) | 1
        self.mark = torch.tensor([token], dtype=torch.int64)

    def release(self) -> None:
        self.mark.zero_()


def offer(tensors: list[torch.Tensor], hold: Hold) -> dict:
    """What the heal's blob carries for a reader: plain values only (``blob``)."""
    host = Host.here()
    assert host is not None  # offerable() said so
    return {
        "boot_id": host.boot_id,
        "pid_ns": host.pid_ns,
        "pid": os.getpid(),
        "spans": [[t.data_ptr(), t.numel() * t.element_size()] for t in tensors],
        "hold": [hold.mark.data_ptr(), int(hold.mark.item())],
    }


def held(offer: dict) -> bool:
    """Whether the source still holds what it offered (``Hold``); False when it cannot be
    read (the source is gone)."""
    addr, token = offer["hold"]
    mark = torch.zeros(1, dtype=torch.int64)
    try:
        _read_part(offer["pid"], [(mark.data_ptr(), addr, 8)])
    except OSError:
        return False
    return int(mark.item()) == token


def usable(offer: dict | None, host: Host | None, tensors: list[torch.Tensor]) -> str | None:
    """None when this receiver can read the offer into ``tensors``; else why not."""
    if offer is None:
        return "the source offered no read (tensors off the CPU or not contiguous, no call)"
    if _LIBC is None:
        return "this process cannot call process_vm_readv"
    if host is None or host.boot_id != offer["boot_id"]:
        return "the source runs on another host"
    if host.pid_ns != offer["pid_ns"]:
        return "the source runs in another pid namespace"
    if len(tensors) != len(offer["spans"]):
        return "the source offers another number of tensors"
    for t, (_, nbytes) in zip(tensors, offer["spans"], strict=True):
        if t.device.type != "cpu" or not t.is_contiguous():
            return "a tensor here is off the CPU or not contiguous"
        if t.numel() * t.element_size() != nbytes:
            return "a tensor here has another size than the source's"
    return None


def read(offer: dict, tensors: list[torch.Tensor], *, threads: int | None = None) -> None:
    """Copy each of the source's spans into the matching tensor here, on ``threads``
    threads (default ``readers``: one per ``PART_BYTES``, at most one per core this process
    may use, at most ``MAX_THREADS``; the call releases the GIL, and one core copies ~5 GB/s
    where memory moves faster). Raises ``OSError`` when the kernel refuses or copies less
    than all (the tensors may then hold part of the source's bytes: the caller overwrites
    them or forgets them)."""
    pieces = [
        (t.data_ptr(), addr, n) for t, (addr, n) in zip(tensors, offer["spans"], strict=True) if n
    ]
    total = sum(n for _, _, n in pieces)
    parts = _split(pieces, threads or readers(total))
    errors: list[OSError] = []

    def run(part: list[tuple[int, int, int]]) -> None:
        try:
            _read_part(offer["pid"], part)
        except OSError as exc:
            errors.append(exc)

    helpers = [threading.Thread(target=run, args=(part,), daemon=True) for part in parts[1:]]
    for helper in helpers:
        helper.start()
    run(parts[0] if parts else [])
    for helper in helpers:
        helper.join()
    if errors:
        raise errors[0]


PART_BYTES = 4 << 20
MAX_THREADS = 4


def readers(total: int) -> int:
    """How many threads read ``total`` bytes (``read``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return max(1, min(MAX_THREADS, cores, total // PART_BYTES))


def _split(pieces: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """``pieces`` (local address, remote address, length) cut into ``parts`` runs of about
    equal bytes, in order; a piece may be cut in two."""
    total = sum(n for _, _, n in pieces)
    share = -(-total // max(1, parts))
    out: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for mine, theirs, n in pieces:
        while n:
            if room == 0:
                out.append([])
                room = share
            take = min(n, room)
            out[-1].append((mine, theirs, take))
            mine, theirs, n, room = mine + take, theirs + take, n - take, room - take
    return [part for part in out if part]


def _read_part(pid: int, part: list[tuple[int, int, int]]) -> None:
    assert _LIBC is not None
    for i in range(0, len(part), IOV_MAX):
        chunk = part[i : i + IOV_MAX]
        local = (_Iovec * len(chunk))(*[_Iovec(mine, n) for mine, _, n in chunk])
        remote = (_Iovec * len(chunk))(*[_Iovec(theirs, n) for _, theirs, n in chunk])
        want = sum(n for _, _, n in chunk)
        got = _LIBC.process_vm_readv(pid, local, len(chunk), remote, len(chunk), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        if got != want:
            raise OSError(f"process_vm_readv from pid {pid} copied {got} of {want} bytes")


def _yama_scope() -> int:
    try:
        return int(YAMA.read_text())
    except (OSError, ValueError):
        return 0  # no Yama: the classic same-user rule


class allow:
    """For the ``with`` block, let any process of this user read this one (when ``offered``
    and Yama's scope is 1; nothing otherwise), and withdraw it after."""

    def __init__(self, offered: bool) -> None:
        self.offered = offered

    def __enter__(self) -> allow:
        self.set = self.offered and _LIBC is not None and _yama_scope() == 1
        if self.set:
            _LIBC.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY & 0xFFFFFFFFFFFFFFFF, 0, 0, 0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.set:
            _LIBC.prctl(PR_SET_PTRACER, 0, 0, 0, 0)
