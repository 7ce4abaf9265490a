"""The worker processes of one joined host: children of its agent (``tidal worker --join``).

Contracts:

- Each worker runs in its own session, so the terminal's Ctrl-C reaches the agent only; the
  agent forwards signals (``signal``, ``signal_all``).
- A worker dies with its agent (``PR_SET_PDEATHSIG`` = SIGKILL): an agent that is killed
  leaves no orphan training beside the survivors, and the coordinator, which counts the
  host lost (``placement.lost_hosts``), is right that its workers are gone. So workers are
  started by the agent's main thread only, which lives as long as the process (the signal
  fires when the thread that forked the child ends).
- Every end is recorded once as a ``HostExit`` (its code, its log's last line) and kept
  until ``acknowledge`` (the coordinator answered a poll that carried it); ``on_exit`` is
  called from the waiting thread so the agent reports it at once.
- A worker id is started at most once in the agent's life (``started``), even if its order
  is seen again after its end.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tidal.hosts_protocol import HostExit, HostWorker

_PR_SET_PDEATHSIG = 1
try:  # loaded here, not in the forked child, where loading could deadlock
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def _die_with_agent() -> None:  # pragma: no cover - runs in the child before exec
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


class Children:
    def __init__(self, *, log_dir: Path, on_exit: Callable[[], None]) -> None:
        self.log_dir = log_dir
        self._on_exit = on_exit
        self._lock = threading.RLock()
        self._procs: dict[int, subprocess.Popen] = {}
        self._started: set[int] = set()
        self._exits: dict[int, HostExit] = {}  # not yet acknowledged

    def log_path(self, wid: int) -> Path:
        return self.log_dir / f"worker-{wid}.log"

    def start(self, wid: int, argv: list[str], env: dict[str, str], cwd: str | None) -> int:
        """Start worker ``wid`` (main thread only: see the module doc); its pid. A worker
        that cannot start (no such Python, a folder it cannot write its log to) is an exit
        with code 127 and the reason."""
        with self._lock:
            self._started.add(wid)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_path(wid), "ab") as log:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_agent,
                )
        except OSError as exc:
            self._record(wid, 127, f"could not start on its host: {exc}"[:300])
            return 0
        with self._lock:
            self._procs[wid] = proc
        threading.Thread(
            target=self._wait, args=(wid, proc), name=f"tidal-worker-{wid}", daemon=True
        ).start()
        return proc.pid

    def cancel(self, wid: int, why: str) -> None:
        """Worker ``wid`` will never start here: an exit, code 0, with ``why``."""
        with self._lock:
            self._started.add(wid)
        self._record(wid, 0, why)

    def _wait(self, wid: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            self._procs.pop(wid, None)
        self._record(wid, code, "", last_line(self.log_path(wid)))

    def _record(self, wid: int, code: int, reason: str, line: str = "") -> None:
        with self._lock:
            self._exits[wid] = HostExit(
                worker_id=wid, returncode=max(-255, min(255, code)), reason=reason, last_line=line
            )
        self._on_exit()

    def signal(self, wid: int, sig: int) -> bool:
        """Send ``sig`` to worker ``wid``; False if it does not run."""
        with self._lock:
            proc = self._procs.get(wid)
        if proc is None or proc.poll() is not None:
            return False
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            return False
        return True

    def signal_all(self, sig: int) -> None:
        for wid in self.running_ids():
            self.signal(wid, sig)

    def started(self, wid: int) -> bool:
        with self._lock:
            return wid in self._started

    def running_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._procs)

    def running(self) -> list[HostWorker]:
        with self._lock:
            return [HostWorker(worker_id=w, pid=p.pid) for w, p in sorted(self._procs.items())]

    def exits(self) -> list[HostExit]:
        with self._lock:
            return list(self._exits.values())

    def acknowledge(self, exits: list[HostExit]) -> None:
        with self._lock:
            for e in exits:
                if self._exits.get(e.worker_id) is e:
                    del self._exits[e.worker_id]
