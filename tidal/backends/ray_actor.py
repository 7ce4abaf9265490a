"""The Ray actor that hosts one worker: it runs the training script as its child process.

Runs on a cluster node, in a Ray worker process. Imports nothing of Ray at module level:
``tidal.backends.ray`` wraps ``WorkerHost`` with ``ray.remote`` and the resource request.

Contracts:

- The script is the same command, with the same Tidal environment, that the local backend
  runs, so the worker runtime cannot tell the backends apart. It runs with this node's
  Python (the cluster's environment, which must have tidal and the script's imports).
- The script dies with the actor: it is launched from a thread that lives as long as the
  actor's process, with ``PR_SET_PDEATHSIG``. A node that is lost (raylet killed) or an
  actor process that is killed leaves no orphan training on beside the survivors.
- The actor dies with its raylet. Ray does not end a worker process whose raylet was
  killed (seen with Ray 2.60: it lives on for minutes), so a lost node's script would keep
  training beside the survivors until Ray declared the node dead. The launcher thread
  watches the actor's parent (the raylet) and, when it is gone, kills the script and exits.
- The actor outlives the coordinator that made it (the backend makes it *detached*, named
  after the worker's credential): a restarted coordinator, a new Ray driver, finds it by
  name and adopts it (``where``, then ``wait`` again). A detached actor is ended by nobody
  but its coordinator, so it ends itself ``LINGER_S`` after its script ended: long enough
  for a restarted coordinator to collect the exit, and no resources held for ever by a job
  whose every coordinator is gone.
- ``wait`` returns within ``WAIT_CALL_S`` even while the script runs (``running``): a call
  of a coordinator that died does not hold one of the actor's threads for ever, so the
  actor's concurrency is not used up by restarts.
- Gloo binds the address Ray knows this node by (``GLOO_SOCKET_IFNAME`` of that address's
  interface, unless the cluster's environment sets one): peers on other nodes reach it
  there, not at whatever the hostname resolves to (often 127.0.0.1 or 127.0.1.1).
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1
try:  # loaded here, not in the forked child, where loading could deadlock
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: kill the script when the thread that forked it (the actor's launcher) dies.
    Local workers outlive their coordinator (it is restarted and adopts them); a Ray
    actor's script must not outlive its actor, which nobody could adopt."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


RAYLET_CHECK_S = 0.1
LINGER_S = 30.0
WAIT_CALL_S = 5.0


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` on this machine, if any."""
    try:
        import psutil  # a dependency of Ray
    except ImportError:  # pragma: no cover - Ray always brings it
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


class WorkerHost:
    """One worker's process on the node Ray placed this actor on.

    Methods may run concurrently (the actor is threaded): ``wait`` blocks until the script
    ends while ``signal`` reaches it."""

    def __init__(self, log_path: str) -> None:
        self._proc: subprocess.Popen | None = None
        self._where: dict | None = None
        self._ended_at: float | None = None
        self._log_path = Path(log_path)
        self._calls: queue.Queue[tuple[Callable[[], object], queue.Queue]] = queue.Queue()
        # The launcher thread forks the script; PR_SET_PDEATHSIG fires when the forking
        # thread ends, so it must live as long as the process does.
        threading.Thread(target=self._launcher, name="tidal-launcher", daemon=True).start()

    def _launcher(self) -> None:
        raylet = os.getppid()
        while True:
            try:
                fn, reply = self._calls.get(timeout=RAYLET_CHECK_S)
            except queue.Empty:
                if os.getppid() != raylet:  # reparented: the raylet is gone
                    self.signal(signal.SIGKILL)
                    os._exit(1)
                if self._proc is not None and self._proc.poll() is not None:
                    now = time.monotonic()
                    self._ended_at = self._ended_at or now
                    if now - self._ended_at > LINGER_S:  # nobody collected it: end
                        os._exit(0)
                continue
            try:
                reply.put((True, fn()))
            except BaseException as exc:  # handed back to the caller
                reply.put((False, exc))

    def _on_launcher(self, fn: Callable[[], object]) -> object:
        reply: queue.Queue = queue.Queue()
        self._calls.put((fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    def start(self, command: list[str | None], env: dict[str, str], cwd: str) -> dict:
        """Launch the script; returns where it runs. ``None`` in ``command`` is this node's
        Python."""
        import ray

        node_ip = ray.util.get_node_ip_address()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        if "GLOO_SOCKET_IFNAME" not in full_env:
            iface = interface_of(node_ip)
            if iface is not None:
                full_env["GLOO_SOCKET_IFNAME"] = iface
        argv = [sys.executable if part is None else part for part in command]
        try:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # the coordinator's folder is not on this node: keep the log here
            self._log_path = Path(os.getcwd()) / self._log_path.name

        def launch() -> subprocess.Popen:
            with open(self._log_path, "ab") as log:
                return subprocess.Popen(
                    argv,
                    env=full_env,
                    cwd=cwd if os.path.isdir(cwd) else None,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )

        self._proc = self._on_launcher(launch)
        self._where = {
            "pid": self._proc.pid,
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": node_ip,
        }
        return self._where

    def where(self) -> dict | None:
        """What ``start`` returned (None before it ran): a restarted coordinator adopts the
        actor by it."""
        return self._where

    def wait(self) -> dict:
        """Wait until the script ends, at most ``WAIT_CALL_S``: its return code and its
        log's last line, or ``{"running": True}`` (call again)."""
        assert self._proc is not None, "start() first"
        try:
            code = self._proc.wait(timeout=WAIT_CALL_S)
        except subprocess.TimeoutExpired:
            return {"running": True}
        return {"returncode": code, "last_line": self._last_line()}

    def signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def _last_line(self) -> str:
        try:
            lines = self._log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""
