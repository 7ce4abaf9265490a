"""Workers as subprocesses of the coordinator on this machine."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tidal.backends.base import Backend, Exit, register_backend
from tidal.backends.gpus import assign_gpu, check_spec, device_entry, entry_index, visible_gpus
from tidal.backends.pidwatch import PidWatch, proc_gone
from tidal.backends.zygote import Zygote, fork_refusal
from tidal.config import JobSpec

log = logging.getLogger(__name__)

#: How many workers a core may hold: a worker spends part of each step waiting on its peers'
#: gradients, so a few per core still train (the tests run 4 on 2 cores). ``--oversubscribe``
#: lifts this part of the limit, not the memory part.
WORKERS_PER_CORE = 4
#: What one worker process needs at least: Python, torch and gloo loaded, a small model
#: (~250 MB measured for examples/digits.py).
WORKER_MEMORY_BYTES = 250 * 2**20


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


#: A watched worker (not a child of this process) whose process is gone but whose exit status
#: its reaper (the zygote, or the supervisor through ``reaped_fd``) has not told within this
#: long is reported as lost, status unknown.
REAPED_WAIT_S = 1.0
#: How long a new job's coordinator waits, before its first pass, for the zygote to finish its
#: imports (``wait_ready``); workers that start before it is ready start with exec.
ZYGOTE_WAIT_S = 10.0


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot): with the pid, it names one
    process for good, as a pid alone does not once it is recycled."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else None


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def runs_as_worker(log_dir: Path, worker_id: int, pid: int, url: str | None) -> bool:
    """True if ``pid`` runs and is worker ``worker_id`` of the job whose logs are in
    ``log_dir`` (a recycled pid is never taken for it): the zygote forked it as that worker
    (its identity file names the process, start time included), or it was started with that
    worker's id and the job's API ``url`` in its environment."""
    if not pid or proc_gone(pid):
        return False
    try:
        recorded = (log_dir / f"worker-{worker_id}.pid").read_text().split()
    except OSError:
        recorded = []
    if recorded == [str(pid), str(_start_time(pid))]:
        return True
    from tidal.protocol import ENV_URL, ENV_WORKER_ID

    environ = _environ(pid)
    return (
        bool(url) and environ.get(ENV_WORKER_ID) == str(worker_id) and environ.get(ENV_URL) == url
    )


def worker_base_env() -> dict[str, str]:
    """The environment every local worker shares (its own variables come on top)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_zygote(spec: JobSpec, log_dir: Path) -> Zygote | None:
    """The zygote for ``spec``'s local workers (``--worker-start fork``; on the hosts
    backend, those of ``--local-slots``), or None: exec for every worker (with a line on
    stderr if it could not start)."""
    local = spec.backend == "local" or (spec.backend == "hosts" and spec.local_slots > 0)
    if not local or spec.worker_start != "fork":
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        return Zygote(python=spec.python, env=worker_base_env(), log=log_dir / "zygote.log")
    except OSError as exc:
        log.warning("the zygote did not start (%s): workers start with exec", exc)
        return None


class LocalBackend(Backend):
    """Each worker runs ``command`` with the worker's environment; stdout and stderr go to
    ``log_dir/worker-ID.log``. With ``--worker-start fork`` (the default) a worker is forked
    from the job's zygote (``tidal.host.zygote``: torch is imported once, not once a worker),
    unless its environment forbids it (``zygote.fork_refusal``) or the zygote is not ready or
    failed; it is then started with exec, as with ``--worker-start exec``. On a machine with
    GPUs each worker gets one of its own as ``CUDA_VISIBLE_DEVICES`` (``gpus.assign_gpu``: the lowest free one; with
    ``--share-gpus`` the least used); with none the variable is left as this process has it.
    ``gpus``: the GPU count to use instead of this machine's (tests)."""

    #: Workers started at once at most; the next ones start as these register (each start
    #: imports torch: a core's worth of work for a second or more).
    max_starting = max(4, _cores())

    @classmethod
    def check_capacity(cls, spec: JobSpec) -> None:
        """Refuse, in one line, a job whose ``--max-workers`` (and ``--spares``) this
        machine cannot hold."""
        limit, why = local_capacity(oversubscribe=spec.oversubscribe)
        wanted = spec.max_workers + spec.spares
        if wanted > limit:
            hint = (
                ""
                if spec.oversubscribe or "core" not in why
                else "; --oversubscribe allows more per core"
            )
            counted = f" ({spec.max_workers} + {spec.spares} spares)" if spec.spares else ""
            raise ValueError(
                f"{wanted} workers{counted} is more than this machine holds: at most {limit} "
                f"local workers ({why}){hint}"
            )

    def __init__(
        self, *, spec: JobSpec, log_dir: Path, cwd: Path | None = None, gpus: int | None = None
    ) -> None:
        self.check_capacity(spec)  # before anything is started (``tidal resume`` included)
        self.gpus = visible_gpus(gpus)
        check_spec(spec, n_gpus=self.gpus)  # --comm nccl without GPUs, too few GPUs
        self.share_gpus = spec.share_gpus
        self._gpu: dict[int, int] = {}  # worker id -> the GPU index it holds, until its exit
        self.command = [spec.python, *spec.worker_argv]
        self.log_dir = log_dir
        self.cwd = cwd
        self.spec = spec
        self._zygote: Zygote | None = None
        self._owns_zygote = False  # a supervisor's zygote outlives this backend
        self._procs: dict[int, subprocess.Popen] = {}  # workers started with exec
        # Workers that are not children of this process (the zygote forked them, or a
        # previous coordinator started them: ``adopt``): id -> pid, and since when each has
        # been gone without a known exit status.
        self._watched: dict[int, int] = {}
        self._pids = PidWatch()  # the watched workers' processes
        self._gone_since: dict[int, float] = {}
        self._reaped: dict[int, int] = {}  # pid -> exit code, as the reaper told
        self.reaped_fd: int | None = None  # "PID CODE" lines from the supervisor (a reaper)
        log_dir.mkdir(parents=True, exist_ok=True)

    def prepare(self, zygote: Zygote | None = None) -> None:
        """Use ``zygote`` (its supervisor's), or start one of its own (``--worker-start
        fork``): it imports torch while the coordinator comes up."""
        if self.spec.worker_start != "fork" or self._zygote is not None:
            return
        self._owns_zygote = zygote is None
        self._zygote = zygote or start_zygote(self.spec, self.log_dir)

    def wait_ready(self) -> bool:
        """Up to ``ZYGOTE_WAIT_S`` for the zygote's imports."""
        return self._zygote is None or self._zygote.ready(wait=ZYGOTE_WAIT_S)

    def _fork(self, worker_id: int, env: dict[str, str]) -> tuple[int | None, str]:
        """Fork the worker from the zygote: its pid, or None and why not (the worker is then
        started with exec)."""
        z = self._zygote
        if z is None:
            return None, ""
        refused = fork_refusal(z.env, env)
        if refused:
            return None, refused
        if not z.ready():
            return (
                None,
                f"the zygote failed ({z.broken})" if z.broken else "the zygote is not ready",
            )
        pid = z.spawn(argv=self.command[1:], env=env, cwd=self.cwd, log=self.log_path(worker_id))
        if pid is None:
            return None, f"the zygote failed ({z.broken or 'no pid'})"
        start = _start_time(pid)
        if start is not None:  # ``adopt``'s proof that pid is this worker
            try:
                self._identity_path(worker_id).write_text(f"{pid} {start}\n")
            except OSError:
                pass  # it trains all the same; a restarted coordinator cannot adopt it
        return pid, ""

    def _watch(self, worker_id: int, pid: int) -> None:
        self._watched[worker_id] = pid
        self._pids.add(pid)

    def _identity_path(self, worker_id: int) -> Path:
        return self.log_dir / f"worker-{worker_id}.pid"  # ``runs_as_worker`` reads it too

    def _forked_as(self, worker_id: int, pid: int) -> bool:
        """True if the zygote forked ``pid`` as this worker (its record names the process)."""
        try:
            recorded = self._identity_path(worker_id).read_text().split()
        except OSError:
            return False
        return recorded == [str(pid), str(_start_time(pid))]

    def log_path(self, worker_id: int) -> Path:
        return self.log_dir / f"worker-{worker_id}.log"

    def _pick_gpu(self) -> tuple[int | None, str]:
        """The GPU for a new worker, and a line for its log when it must share one although
        ``--share-gpus`` was not given (a stopping worker still holds its GPU: its exit has
        not been polled yet); the launch check keeps that brief."""
        try:
            return assign_gpu(n_gpus=self.gpus, in_use=self._gpu, share=self.share_gpus), ""
        except ValueError:
            index = assign_gpu(n_gpus=self.gpus, in_use=self._gpu, share=True)
            holders = sorted(w for w, i in self._gpu.items() if i == index)
            return index, f"tidal: no free GPU yet: sharing GPU {index} with workers {holders}\n"

    def start(self, worker_id: int, env: dict[str, str]) -> int | None:
        full_env = {**worker_base_env(), **env}
        # Under --torchrun each worker sees every GPU, as under torchrun: the script picks
        # its own by LOCAL_RANK.
        gpu, note = (None, "") if self.spec.torchrun else self._pick_gpu()
        if gpu is not None:
            parent = os.environ.get("CUDA_VISIBLE_DEVICES")
            full_env["CUDA_VISIBLE_DEVICES"] = device_entry(gpu, parent)
        if note:
            with open(self.log_path(worker_id), "ab") as log:
                log.write(note.encode())
        pid, why_exec = self._fork(worker_id, full_env)
        if pid is not None:
            self._watch(worker_id, pid)
            if gpu is not None:
                self._gpu[worker_id] = gpu
            return pid
        with open(self.log_path(worker_id), "ab") as log:
            if why_exec:
                log.write(f"tidal: started with exec, not forked: {why_exec}\n".encode())
                log.flush()
            proc = subprocess.Popen(
                self.command,
                env=full_env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Ctrl-C reaches the coordinator only; it stops the job. Workers outlive a
                # coordinator that dies: its supervisor restarts it and the new one adopts
                # them (``adopt``); they exit by themselves after ``--orphan-timeout``.
                start_new_session=True,
            )
        self._procs[worker_id] = proc
        self._pids.add(proc.pid)  # only to wake the control loop at its exit (``wake_fds``)
        if gpu is not None:
            self._gpu[worker_id] = gpu
        return proc.pid

    def adopt(self, worker_id: int, pid: int, env: dict[str, str]) -> bool:
        """Watch a worker a previous coordinator of the job started: True if ``pid`` runs
        with exactly ``env`` (its id and credential) or is the process the zygote forked as
        this worker (``_forked_as``), so a recycled pid is never taken for it. Its exit
        status comes from ``reaped_fd`` (the supervisor reaps orphans)."""
        if not pid or proc_gone(pid):  # 0: it never registered, and its start was not seen
            return False
        environ = _environ(pid)
        launched_with = all(environ.get(k) == v for k, v in env.items())
        if not launched_with and not self._forked_as(worker_id, pid):
            return False
        self._watch(worker_id, pid)
        gpu = entry_index(
            environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        if gpu is not None and gpu < self.gpus:
            self._gpu[worker_id] = gpu
        return True

    def _read_reaped(self) -> None:
        if self.reaped_fd is None:
            return
        try:
            data = os.read(self.reaped_fd, 65536)
        except (BlockingIOError, OSError):
            return
        for line in data.decode(errors="replace").splitlines():
            pid, _, code = line.partition(" ")
            if pid.isdigit() and code.lstrip("-").isdigit():
                self._reaped[int(pid)] = int(code)

    def poll(self) -> list[Exit]:
        exits = []
        for wid, proc in list(self._procs.items()):
            code = proc.poll()
            if code is not None:
                exits.append(Exit(worker_id=wid, returncode=code))
                del self._procs[wid]
                self._pids.remove(proc.pid)
                self._gpu.pop(wid, None)
        if self._zygote is not None:
            self._reaped.update(self._zygote.exits())
        if self._watched:
            self._read_reaped()
        now = time.monotonic()
        gone = self._pids.gone() if self._watched else set()
        for wid, pid in list(self._watched.items()):
            if pid not in gone:
                continue
            code = self._reaped.pop(pid, None)
            if code is None and now - self._gone_since.setdefault(wid, now) < REAPED_WAIT_S:
                continue
            reason = "" if code is not None else "lost (its exit status is unknown)"
            exits.append(
                Exit(
                    worker_id=wid,
                    returncode=-9 if code is None else code,
                    reason=reason,
                    known=code is not None,
                )
            )
            del self._watched[wid]
            self._pids.remove(pid)
            self._gone_since.pop(wid, None)
            self._gpu.pop(wid, None)
        return exits

    def signal(self, worker_id: int, sig: int) -> None:
        proc = self._procs.get(worker_id)
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
        pid = self._watched.get(worker_id)
        if pid is not None:
            self._pids.send(pid, sig)

    def alive(self) -> list[int]:
        """Workers whose exit ``poll`` has not reported yet: one that ended
        counts until its reaper tells its exit status (or ``REAPED_WAIT_S``), so the job
        never ends before every exit is recorded."""
        return [*self._procs, *self._watched]

    def node(self, worker_id: int) -> str | None:
        known = worker_id in self._procs or worker_id in self._watched
        return socket.gethostname() if known else None

    def describe_exit(self, worker_id: int) -> str:
        try:
            lines = self.log_path(worker_id).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def wake_fds(self) -> list[int]:
        """The zygote's socket (it tells forked workers' exits), the supervisor's reaped
        pipe, and the pidfds of watched workers not yet seen gone."""
        fds = self._pids.fds()
        if self._zygote is not None and self._zygote.fileno() is not None:
            fds.append(self._zygote.fileno())
        if self.reaped_fd is not None and self._watched:
            fds.append(self.reaped_fd)
        return fds

    def close(self) -> None:
        self._pids.close()
        if self._zygote is not None and self._owns_zygote:
            self._zygote.close()
        self._zygote = None


register_backend("local", LocalBackend)
