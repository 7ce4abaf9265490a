"""Helpers for the end-to-end tests: drive the real ``tidal`` CLI against a temporary home.

Every command runs as ``python -m tidal.cli ...`` in a subprocess with ``--home`` set to the
test's folder. Polling is the exception: a ``tidal status`` subprocess costs about 1.5 s of
CPU (``import tidal`` imports torch), which on a 2-core machine would starve the workers and
distort the pauses under test, so ``Job.poll`` runs the CLI's own ``get_status`` in this
process (the same code path as ``tidal status --json``, minus the interpreter start).
``Job.status`` is the real subprocess and is what the final assertions read.

Every process a test starts carries a marker in its environment (workers inherit it from
the coordinator, which inherits it from ``tidal run``), so ``Home.cleanup`` can find and
SIGKILL whatever survives a test without ever touching a foreign process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tidal import pids
from tidal.testing import fault_env

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits.py"
MARKER_VAR = "TIDAL_E2E_TEST_OWNER"  # not read by the library; identifies our processes

Status = dict[str, Any]


def standalone_params(out: Path, *script_args: str) -> Path:
    """Train ``examples/digits.py`` alone (no ``tidal run``: the same mathematics as a
    1-worker job, bitwise, at a fraction of the start-up) and return where it saved the
    parameters."""
    proc = subprocess.run(
        [sys.executable, str(DIGITS), *script_args, "--save", str(out)],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-2000:]
    return out


HOOK_ERRORS = "hook-errors.txt"

#: The ``sitecustomize`` that ``call_log`` arms: it imports the test's hook and, if that
#: raises (a stale import path after a move, say), writes the traceback where the test's
#: ``tidal_home`` fixture finds it (``hook_errors``), then raises on. Python would only print
#: "Error in sitecustomize" into a worker's log and run on without the hook.
_GUARD = """
import traceback

try:
    import _test_hook  # noqa: F401
except BaseException:
    with open({errors!r}, "a") as f:
        traceback.print_exc(file=f)
    raise
"""


def call_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, site: str, var: str) -> Path:
    """Arm a test's own ``sitecustomize`` (``site``) in the processes a job starts: it goes
    on their ``PYTHONPATH`` and appends what it records to the file named in ``$var``,
    returned here (the library reads neither). A hook that fails to import fails the test
    (``hook_errors``, checked by the ``tidal_home`` fixture)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "_test_hook.py").write_text(site)
    (hooks / "sitecustomize.py").write_text(_GUARD.format(errors=str(hooks / HOOK_ERRORS)))
    log = tmp_path / f"{var.lower()}.txt"
    # Before the rest of the path, not instead of it: a checkout on PYTHONPATH stays the
    # code the job runs.
    rest = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks)] + ([rest] if rest else [])))
    monkeypatch.setenv(var, str(log))
    return log


def hook_errors(tmp_path: Path) -> str:
    """The tracebacks of ``call_log`` hooks that failed to import in any process ("" if none)."""
    path = tmp_path / "hooks" / HOOK_ERRORS
    return path.read_text() if path.exists() else ""


# -- processes ----------------------------------------------------------------------------
def pid_alive(pid: int | None) -> bool:
    """True if ``pid`` runs (a zombie counts as gone: it holds no resources but its slot)."""
    return pids.alive(pid)


def _environ_of(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def marked_pids(marker: str) -> list[int]:
    """Live processes whose environment carries ``MARKER_VAR=marker``."""
    needle = f"{MARKER_VAR}={marker}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        if needle in _environ_of(pid) and pid_alive(pid):
            found.append(pid)
    return sorted(found)


def process_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (``T``: stopped by a signal); "" if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def wait_stopped(pid: int, timeout: float) -> None:
    """Wait until ``pid`` is stopped (SIGSTOP, e.g. by a ``TIDAL_FAULTS`` sigstop)."""
    deadline = time.monotonic() + timeout
    while process_state(pid) != "T":
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout:.0f} s")
        time.sleep(0.02)


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` runs; returns those still running at the deadline."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


# -- parameters ---------------------------------------------------------------------------
def relative_l2(a_path: Path, b_path: Path) -> float:
    """||a - b|| / ||b|| over all parameters of two safetensors files (same names)."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    assert a, f"{a_path} holds no tensors"
    names = sorted(a)
    va = torch.cat([a[n].flatten().double() for n in names])
    vb = torch.cat([b[n].flatten().double() for n in names])
    return (torch.linalg.vector_norm(va - vb) / torch.linalg.vector_norm(vb)).item()


# -- status queries -----------------------------------------------------------------------
def workers_by_id(status: Status) -> dict[int, dict]:
    return {w["id"]: w for w in status["workers"]}


def running_workers(status: Status) -> list[dict]:
    return [w for w in status["workers"] if w["state"] == "running"]


def event_messages(status: Status, kind: str | None = None) -> list[str]:
    return [e["message"] for e in status["events"] if kind is None or e["kind"] == kind]


def summarize(status: Status | None) -> str:
    """A compact, readable rendering of a status for failure messages."""
    if status is None:
        return "<no status>"
    lines = [
        f"state={status['state']} step={status['step']} world_size={status['world_size']} "
        f"target={status['target_workers']} metrics={status.get('metrics')}"
    ]
    for w in status["workers"]:
        lines.append(
            f"  worker {w['id']}: pid={w['pid']} state={w['state']} rank={w['rank']} "
            f"exit_code={w['exit_code']}"
        )
    for g in status["generations"]:
        lines.append(
            f"  gen {g['id']}: world_size={g['world_size']} members={g['members']} "
            f"start_step={g['start_step']} pause_s={g['pause_s']} reason={g['reason']!r}"
        )
    for e in status["events"][-25:]:
        lines.append(f"  [{e['kind']}] {e['message']}")
    return "\n".join(lines)


class Job:
    """One job of a ``Home``."""

    def __init__(self, home: Home, name: str) -> None:
        self.home = home
        self.name = name
        self.last: Status | None = None

    @property
    def dir(self) -> Path:
        return self.home.path / "jobs" / self.name

    def coordinator_info(self) -> dict | None:
        try:
            return json.loads((self.dir / "coordinator.json").read_text())
        except (OSError, ValueError):
            return None

    # -- status ---------------------------------------------------------------------------
    def status(self) -> Status:
        """``tidal status --home H JOB --json`` in a subprocess, parsed."""
        proc = self.home.cli("status", self.name, "--json", timeout=60)
        assert proc.returncode == 0, f"tidal status failed: {proc.stderr}"
        self.last = json.loads(proc.stdout)
        return self.last

    def poll(self) -> Status:
        """The same JSON as ``status``, computed in this process (cheap; see the module doc)."""
        from tidal.lookup import get_status

        self.last = json.loads(get_status(self.home.path, self.name).model_dump_json())
        return self.last

    def wait_for(
        self, pred: Callable[[Status], Any], timeout: float, what: str, interval: float = 0.1
    ) -> Status:
        """Poll the status every ``interval`` s until ``pred(status)`` is truthy; fail with the
        last status and the worker logs' tails after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        error: str | None = None
        status: Status | None = None
        while True:
            try:
                status = self.poll()
                error = None
                if pred(status):
                    return status
            except Exception as exc:  # noqa: BLE001 - reported if we time out
                error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                break
            time.sleep(interval)
        pytest.fail(
            f"timed out after {timeout:.0f} s waiting for {what} (job {self.name})\n"
            + (f"last error: {error}\n" if error else "")
            + f"last status:\n{summarize(status)}\n"
            + self.logs_tail(),
            pytrace=False,
        )

    def wait_state(self, *states: str, timeout: float) -> Status:
        return self.wait_for(lambda s: s["state"] in states, timeout, f"state in {states}")

    def wait_running(self, min_step: int = 0, timeout: float = 60) -> Status:
        return self.wait_for(
            lambda s: s["state"] == "running" and s["step"] > min_step,
            timeout,
            f"state running and step > {min_step}",
        )

    # -- commands -------------------------------------------------------------------------
    def scale(self, n: int) -> subprocess.CompletedProcess:
        return self.home.cli("scale", self.name, str(n))

    def stop(self) -> subprocess.CompletedProcess:
        return self.home.cli("stop", self.name)

    # -- logs -----------------------------------------------------------------------------
    def worker_log(self, worker_id: int) -> str:
        try:
            return (self.dir / "logs" / f"worker-{worker_id}.log").read_text(errors="replace")
        except OSError:
            return ""

    def logs_tail(self, lines: int = 15) -> str:
        parts = []
        paths = sorted((self.dir / "logs").glob("worker-*.log")) if self.dir.exists() else []
        coord_log = self.dir / "coordinator.log"
        for path in [coord_log, *paths]:
            if not path.exists():
                continue
            text = path.read_text(errors="replace").rstrip().splitlines()[-lines:]
            parts.append(f"--- {path.name} (last {len(text)} lines) ---\n" + "\n".join(text))
        return "\n".join(parts) if parts else "(no logs)"


class Home:
    """A temporary ``--home`` and every process started in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.marker = uuid.uuid4().hex
        self.jobs: dict[str, Job] = {}

    def env(self, faults: str | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
        env["PYTHONUNBUFFERED"] = "1"
        env[MARKER_VAR] = self.marker
        if faults is not None:  # armed in the workers by a sitecustomize (tidal.testing)
            env.update(fault_env(faults, env))
        return env

    def cli(
        self, *args: str, faults: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        """``python -m tidal.cli CMD --home H ARGS...``; never raises on a non-zero exit."""
        cmd, *rest = args
        return subprocess.run(
            [sys.executable, "-m", "tidal.cli", cmd, "--home", str(self.path), *rest],
            cwd=ROOT,
            env=self.env(faults),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def popen(self, *args: str, faults: str | None = None) -> subprocess.Popen:
        """``python -m tidal.cli CMD --home H ARGS...`` started, not waited for (text pipes
        for stdout and stderr)."""
        cmd, *rest = args
        return subprocess.Popen(
            [sys.executable, "-m", "tidal.cli", cmd, "--home", str(self.path), *rest],
            cwd=ROOT,
            env=self.env(faults),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def job(self, name: str) -> Job:
        return self.jobs.setdefault(name, Job(self, name))

    def _run_args(
        self, name: str, opts: Sequence[str], script: Path | str, script_args: Sequence[str]
    ) -> list[str]:
        return ["run", "--name", name, "--quiet", *opts, str(script), *script_args]

    def start(
        self,
        name: str,
        *opts: str,
        script_args: Sequence[str] = (),
        script: Path | str = DIGITS,
        faults: str | None = None,
    ) -> Job:
        """``tidal run --detach``; returns once the coordinator is up."""
        job = self.job(name)
        proc = self.cli(
            *self._run_args(name, ["--detach", *opts], script, script_args), faults=faults
        )
        assert proc.returncode == 0, f"tidal run --detach failed:\n{proc.stderr}\n{job.logs_tail()}"
        assert proc.stdout.strip() == name, proc.stdout
        return job

    def run(
        self,
        name: str,
        *opts: str,
        script_args: Sequence[str] = (),
        script: Path | str = DIGITS,
        faults: str | None = None,
        timeout: float = 120,
    ) -> tuple[subprocess.CompletedProcess, Job]:
        """``tidal run`` in the foreground, to its end."""
        job = self.job(name)
        proc = self.cli(
            *self._run_args(name, opts, script, script_args), faults=faults, timeout=timeout
        )
        return proc, job

    # -- processes ------------------------------------------------------------------------
    def live_processes(self) -> list[int]:
        return marked_pids(self.marker)

    def assert_no_processes(self, timeout: float = 10) -> None:
        """Every process this home started has exited (within ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while (left := self.live_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            desc = []
            for pid in left:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    cmd = b"?"
                desc.append(f"{pid}: {cmd.decode(errors='replace')[:200]}")
            raise AssertionError("processes outlived their job:\n" + "\n".join(desc))

    def cleanup(self) -> None:
        """Stop every job, then SIGKILL any coordinator or worker still alive. Raises if a
        process survives even that."""
        jobs_dir = self.path / "jobs"
        names = sorted(p.name for p in jobs_dir.iterdir()) if jobs_dir.is_dir() else []
        jobs = [self.job(n) for n in names]
        for job in jobs:
            info = job.coordinator_info()
            if info and pid_alive(info.get("pid")):
                try:
                    self.cli("stop", job.name, timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        wait_gone(self.live_processes(), timeout=5)
        targets: set[int] = set()
        supervisors: set[int] = set()  # first: they would restart a killed coordinator
        for job in jobs:
            info = job.coordinator_info()
            if info and info.get("supervisor_pid"):
                supervisors.add(int(info["supervisor_pid"]))
            if info and info.get("pid"):
                targets.add(int(info["pid"]))
            try:
                status = job.poll()
            except Exception:  # noqa: BLE001 - no records: nothing to read pids from
                status = None
            for w in (status or {}).get("workers", []):
                if w.get("pid"):
                    targets.add(int(w["pid"]))
        ours = set(self.live_processes())
        # The recorded coordinator and worker pids first, each only if it is still ours
        # (pids get reused), then anything else of ours (a worker the records missed).
        for pid in sorted(supervisors & ours) + sorted(targets & ours) + sorted(ours - targets):
            kill_pid(pid)
        left = wait_gone(ours, timeout=10)
        left += [p for p in self.live_processes() if p not in left]
        if left:
            raise RuntimeError(f"could not kill processes of {self.path}: {left}")


# -- the store, as an outsider finds it ---------------------------------------------------
def store_port(job: Job) -> int:
    """The rendezvous store's port, as an intruder would find it: by scanning the
    coordinator's listening sockets (its API port is the other one)."""
    pid = job.coordinator_info()["pid"]
    api_port = int(job.coordinator_info()["url"].rsplit(":", 1)[1])
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                ports.add(int(cols[1].rpartition(":")[2], 16))
    ports.discard(api_port)
    assert len(ports) == 1, ports
    return ports.pop()
