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

#: How many workers a core may hold: a worker spends part of each step waiting on its peers'
#: gradients, so a few per core still train (the tests run 4 on 2 cores). ``--oversubscribe``
#: lifts this part of the limit, not the memory part.
WORKERS_PER_CORE = 4
#: What one worker process needs at least: Python, torch and gloo loaded, a small model
#: (~250 MB measured for examples/digits.py).
WORKER_MEMORY_BYTES = 250 * 2**20
try:  # loaded here, not in the forked child, where loading could deadlock
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _available_memory() -> int | None:
    """Bytes this machine (and this process's cgroup) can still give; None if unknown."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v2: a container's limit, less what it uses
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cg / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(0, min(found)) if found else None


def local_capacity(*, oversubscribe: bool = False) -> tuple[int, str]:
    """The most workers the local backend starts on this machine, and why that many."""
    cores = _cores()
    limits = []
    if not oversubscribe:
        limits.append((cores * WORKERS_PER_CORE, f"{WORKERS_PER_CORE} per core on {cores} cores"))
    memory = _available_memory()
    if memory is not None:
        limits.append(
            (
                max(1, memory // WORKER_MEMORY_BYTES),
                f"{memory / 2**30:.1f} GiB of memory available at "
                f"~{WORKER_MEMORY_BYTES // 2**20} MB per worker",
            )
        )
    return min(limits) if limits else (sys.maxsize, "no limit known")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: kill the worker if the coordinator process dies (it cannot train without it).

    Must be called by ``Popen`` from the thread that lives as long as the coordinator (the
    controller's): the kernel ties the signal to the forking thread."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class LocalBackend(Backend):
    """Each worker runs ``command`` with the worker's environment; stdout and stderr go to
    ``log_dir/worker-ID.log``."""

    #: Workers started at once at most; the next ones start as these register (each start
    #: imports torch: a core's worth of work for a second or more).
    max_starting = max(4, _cores())

    @classmethod
    def check_capacity(cls, spec: JobSpec) -> None:
        """Refuse, in one line, a job whose ``--max-workers`` this machine cannot hold."""
        limit, why = local_capacity(oversubscribe=spec.oversubscribe)
        if spec.max_workers > limit:
            hint = (
                ""
                if spec.oversubscribe or "core" not in why
                else "; --oversubscribe allows more per core"
            )
            raise ValueError(
                f"{spec.max_workers} workers is more than this machine holds: at most {limit} "
                f"local workers ({why}){hint}"
            )

    def __init__(self, *, spec: JobSpec, log_dir: Path, cwd: Path | None = None) -> None:
        self.check_capacity(spec)  # before anything is started (``tidal resume`` included)
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
