"""Workers as subprocesses of the coordinator on this machine."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tidal.backends.base import Backend, Exit, register_backend
from tidal.config import JobSpec

_PR_SET_PDEATHSIG = 1
try:  # loaded here, not in the forked child, where loading could deadlock
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: kill the worker if the coordinator process dies (it cannot train without it).

    Must be called by ``Popen`` from the thread that lives as long as the coordinator (the
    controller's): the kernel ties the signal to the forking thread."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class LocalBackend(Backend):
    """Each worker runs ``command`` with the worker's environment; stdout and stderr go to
    ``log_dir/worker-ID.log``."""

    def __init__(self, *, spec: JobSpec, log_dir: Path, cwd: Path | None = None) -> None:
        self.command = [spec.python, spec.script, *spec.script_args]
        self.log_dir = log_dir
        self.cwd = cwd
        self._procs: dict[int, subprocess.Popen] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def log_path(self, worker_id: int) -> Path:
        return self.log_dir / f"worker-{worker_id}.log"

    def start(self, worker_id: int, env: dict[str, str]) -> int | None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        full_env.setdefault("OMP_NUM_THREADS", "1")
        with open(self.log_path(worker_id), "ab") as log:
            proc = subprocess.Popen(
                self.command,
                env=full_env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the coordinator only; it stops the job
                preexec_fn=_die_with_parent,
            )
        self._procs[worker_id] = proc
        return proc.pid

    def poll(self) -> list[Exit]:
        exits = []
        for wid, proc in list(self._procs.items()):
            code = proc.poll()
            if code is not None:
                exits.append(Exit(worker_id=wid, returncode=code))
                del self._procs[wid]
        return exits

    def signal(self, worker_id: int, sig: int) -> None:
        proc = self._procs.get(worker_id)
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def alive(self) -> list[int]:
        return [wid for wid, p in self._procs.items() if p.poll() is None]

    def node(self, worker_id: int) -> str | None:
        return socket.gethostname() if worker_id in self._procs else None

    def describe_exit(self, worker_id: int) -> str:
        try:
            lines = self.log_path(worker_id).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""


register_backend("local", LocalBackend)
