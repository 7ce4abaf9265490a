"""Forking workers from a warm interpreter: the local backend's side of ``tidal.host.zygote``
(the process and its contract are described there).

``fork_refusal`` decides whether a worker may be forked: only when its environment differs
from the zygote's in variables nothing reads while a library is loaded. ``Zygote`` starts the
process, forks workers through it and hands on their exit statuses. Any failure of the zygote
(it cannot start, crashed, does not answer) makes ``spawn`` return None: the backend then
starts the worker with exec, as it would without a zygote. A worker is never lost to one.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

#: Variables a forked worker may hold differently from the zygote: Tidal's own, read by its
#: runtime once the script runs, and ``CUDA_VISIBLE_DEVICES``, read when CUDA initialises
#: (the zygote never does).
PER_WORKER_PREFIXES = ("TIDAL_",)
PER_WORKER_KEYS = frozenset({"CUDA_VISIBLE_DEVICES"})
#: How long a spawn waits for the zygote's answer before it gives up on the zygote.
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
    """The zygote of one coordinator: ``python -P -m tidal.host.zygote`` started with
    ``env`` (the environment every worker shares), its output appended to ``log``."""

    def __init__(self, *, python: str, env: Mapping[str, str], log: Path) -> None:
        self.env = dict(env)
        self._sock, theirs = socket.socketpair()
        self._buf = b""
        self._replies: list[dict] = []
        self._exits: list[tuple[int, int]] = []
        self._ready = False
        self.broken: str | None = None
        with open(log, "ab") as out:
            self._proc = subprocess.Popen(
                [python, "-P", "-m", "tidal.host.zygote", str(theirs.fileno())],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        theirs.close()
        self._sock.setblocking(False)

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
            data, self.broken = b"", f"its socket failed: {exc}"
        if not data:
            self._give_up(self.broken or "it exited")
            return
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            if "ready" in msg:
                self._ready = True
            elif "exit" in msg:
                self._exits.append((int(msg["exit"]), int(msg["code"])))
            else:
                self._replies.append(msg)

    def _give_up(self, why: str) -> None:
        self.broken = self.broken or why
        self.close()

    def ready(self, wait: float = 0.0) -> bool:
        """True once the zygote has imported what it preloads (waiting up to ``wait`` s)."""
        deadline = time.monotonic() + wait
        while not self._ready and not self.broken:
            self._read(deadline - time.monotonic())
            if time.monotonic() >= deadline:
                break
        return self._ready and not self.broken

    def spawn(
        self, *, argv: list[str], env: Mapping[str, str], cwd: Path | None, log: Path
    ) -> int | None:
        """Fork a worker running ``argv`` (the script and its arguments); its pid, or None if
        the zygote is not ready or failed (it is then given up)."""
        if not self.ready():
            return None
        request = {
            "argv": argv,
            "env": dict(env),
            "cwd": str(cwd) if cwd else None,
            "log": str(log),
        }
        try:
            self._sock.setblocking(True)
            self._sock.sendall(json.dumps(request).encode() + b"\n")
        except OSError as exc:
            self._give_up(f"a request failed: {exc}")
            return None
        finally:
            if not self.broken:
                self._sock.setblocking(False)
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while not self._replies and not self.broken and time.monotonic() < deadline:
            self._read(deadline - time.monotonic())
        if not self._replies:
            self._give_up(self.broken or f"no answer within {SPAWN_TIMEOUT_S:g} s")
            return None
        reply = self._replies.pop(0)
        return int(reply["pid"]) if "pid" in reply else None

    def exits(self) -> list[tuple[int, int]]:
        """``(pid, code)`` of forked workers that ended since the last call."""
        self._read(0)
        found, self._exits = self._exits, []
        return found

    def close(self) -> None:
        """End the zygote (its workers train on)."""
        self.broken = self.broken or "closed"
        try:
            self._sock.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
