"""Forking workers from a warm interpreter: the local backend's side of ``tidal.host.zygote``
(the process, its protocol and its contract are described there).

``fork_refusal`` decides whether a worker may be forked: only when its environment differs
from the zygote's in variables nothing reads while a library is loaded. ``Zygote`` starts the
process, forks workers through it and hands on their exit statuses. Any failure of the zygote
(it cannot start, crashed, does not answer) makes ``spawn`` return None: the backend then
starts the worker with exec, as it would without a zygote. A worker is never lost to one.

A ``Zygote`` is made by the process that owns it (the job's supervisor) and used by the
coordinators it forks, each with its copy of the object and of the socket: ``close`` in a
coordinator only lets go of its copy; in the owner it ends the zygote.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

#: Variables a forked worker may hold differently from the zygote: Tidal's own, read by its
#: runtime once the script runs, ``CUDA_VISIBLE_DEVICES``, read when CUDA initialises (the
#: zygote never does), and the interfaces gloo and NCCL bind, read when a group forms
#: (``--local-slots`` beside joined hosts: ``backends.addresses``).
PER_WORKER_PREFIXES = ("TIDAL_",)
PER_WORKER_KEYS = frozenset({"CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"})
#: How long a fork waits for the zygote's answer before it gives up on the zygote.
SPAWN_TIMEOUT_S = 5.0


def _per_worker(key: str) -> bool:
    return key in PER_WORKER_KEYS or key.startswith(PER_WORKER_PREFIXES)


def fork_refusal(base: Mapping[str, str], env: Mapping[str, str]) -> str | None:
    """Why a worker launched with ``env`` cannot be forked from a zygote started with
    ``base`` (a variable a library may read at import differs), or None if it can."""
    differ = sorted(k for k in base.keys() | env.keys() if base.get(k) != env.get(k))
    fixed = [k for k in differ if not _per_worker(k)]
    if not fixed:
        return None
    named = ", ".join(fixed[:3]) + (f" and {len(fixed) - 3} more" if len(fixed) > 3 else "")
    return f"its environment differs from the zygote's in {named}"


class Zygote:
    """A zygote: ``python -P -m tidal.host.zygote`` started with ``env`` (the environment
    every worker shares), its output appended to ``log``."""

    def __init__(self, *, python: str, env: Mapping[str, str], log: Path) -> None:
        self.env = dict(env)
        self._owner = os.getpid()
        self._sock, theirs = socket.socketpair()
        with open(log, "ab") as out:
            try:
                self._proc = subprocess.Popen(
                    [python, "-P", "-m", "tidal.host.zygote", str(theirs.fileno())],
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
            except OSError:
                self._sock.close()
                raise
            finally:
                theirs.close()
        self._sock.setblocking(False)
        self._fresh()

    def _fresh(self) -> None:
        """The reading state of one process (a forked coordinator starts its own)."""
        self._user = os.getpid()
        self._ids = itertools.count()
        self._buf = b""
        self._replies: dict[str, dict] = {}
        self._exits: list[tuple[int, int]] = []
        self._ping: str | None = None
        self._ready = False
        self.broken: str | None = None

    def _mine(self) -> None:
        if self._user != os.getpid():
            self._fresh()

    def _send(self, msg: dict) -> str | None:
        """Send ``msg`` with a new id (returned); None if the zygote is given up."""
        key = f"{os.getpid()}-{next(self._ids)}"
        try:
            self._sock.setblocking(True)
            self._sock.sendall(json.dumps({"id": key, **msg}).encode() + b"\n")
            self._sock.setblocking(False)
        except OSError as exc:
            self._give_up(f"a request failed: {exc}")
            return None
        return key

    def _read(self, timeout: float) -> None:
        """Take what the zygote sent, waiting up to ``timeout`` for something."""
        if self.broken:
            return
        readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        if not readable:
            return
        try:
            data = self._sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._give_up(f"its socket failed: {exc}")
            return
        if not data:
            self._give_up("it exited")
            return
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # the tail of a line a dead coordinator had half read
            if "exit" in msg:
                self._exits.append((int(msg["exit"]), int(msg["code"])))
            elif str(msg.get("id", "")).startswith(f"{os.getpid()}-"):
                self._replies[msg["id"]] = msg  # others answer a dead coordinator's requests

    def _give_up(self, why: str) -> None:
        self.broken = self.broken or why
        try:
            self._sock.close()
        except OSError:
            pass

    def _answer(self, key: str, deadline: float) -> dict | None:
        while key not in self._replies and not self.broken:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._read(left)
        return self._replies.pop(key, None)

    def ready(self, wait: float = 0.0) -> bool:
        """True once the zygote has imported what it preloads (waiting up to ``wait`` s)."""
        self._mine()
        if not self._ready and not self.broken:
            if self._ping is None:
                self._ping = self._send({"ping": True})
            if self._ping is not None:
                self._ready = self._answer(self._ping, time.monotonic() + wait) is not None
        return self._ready and not self.broken

    def spawn(
        self, *, argv: list[str], env: Mapping[str, str], cwd: Path | None, log: Path
    ) -> int | None:
        """Fork a worker running ``argv`` (the script and its arguments); its pid, or None if
        the zygote is not ready or failed (it is then given up)."""
        if not self.ready():
            return None
        key = self._send(
            {"argv": argv, "env": dict(env), "cwd": str(cwd) if cwd else None, "log": str(log)}
        )
        if key is None:
            return None
        reply = self._answer(key, time.monotonic() + SPAWN_TIMEOUT_S)
        if reply is None:
            self._give_up(self.broken or f"no answer within {SPAWN_TIMEOUT_S:g} s")
            return None
        return int(reply["pid"]) if "pid" in reply else None

    def fileno(self) -> int | None:
        """The socket the zygote's messages arrive on (readable when a forked worker's exit
        is told), or None once given up."""
        self._mine()
        return None if self.broken else self._sock.fileno()

    def exits(self) -> list[tuple[int, int]]:
        """``(pid, code)`` of forked workers that ended since the last call."""
        self._mine()
        self._read(0)
        found, self._exits = self._exits, []
        return found

    def close(self) -> None:
        """Let go of the zygote; in its owner, end it at once (it may still be importing, and
        reads its socket only after that; the workers it forked train on)."""
        self._give_up("closed")
        if os.getpid() != self._owner:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
