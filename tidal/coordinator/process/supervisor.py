"""Keeping a job's coordinator alive: the process that ``tidal run`` (or ``--detach``) is.

The supervisor holds what must outlive any one coordinator, and restarts the coordinator
when it dies:

- the job's lock (``home.JobDir.lock``), so no second coordinator hosts the job meanwhile;
- the API's and the store's listening sockets (``Hosting``): a restarted coordinator
  serves the same URL and store port, and workers' calls made during the restart wait in
  the socket's backlog instead of being refused;
- the job's token, from which every worker's credential derives;
- the workers' zygote (``tidal.host.zygote``), started by the caller, which every
  coordinator forks its local workers from;
- the workers themselves, as their subreaper (``PR_SET_CHILD_SUBREAPER``): when a
  coordinator dies its workers become the supervisor's children, which it reaps and whose
  exit statuses it passes on (``Hosting.reaped_r``) to the next coordinator.

Each coordinator is a ``fork`` of the supervisor (it imported everything already, so a
restart takes tens of milliseconds, not an interpreter's start) running ``runner.host_job``
in its own process group (the terminal's Ctrl-C reaches the supervisor, which forwards each
signal once). A coordinator that returns (the job ended: 0, or 1 when it failed, was
stopped, or was refused) ends the supervisor with its code; one that dies of a signal or an
uncaught exception (``CRASHED``) is restarted with ``recover=True`` and rebuilds its state
from SQLite and the workers' re-registration (``recovery``). More than ``MAX_CRASHES``
crashes within ``CRASH_WINDOW_S`` end the supervisor: the job is then ``interrupted`` and its
workers train on until ``--orphan-timeout`` unless ``tidal attach`` takes them over.

A hang-up of ``tidal run``'s terminal (SIGHUP) or a closed output pipe does not end the job
(``docs/decisions/hangup.md``): the supervisor sends its own lines to the job's
``coordinator.log`` from then on and passes the SIGHUP to the coordinator, which does the same
and records it (``tidal.terminal``).

The supervisor creates no thread before it forks (a fork copies only the calling thread).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.backends.zygote import Zygote

if TYPE_CHECKING:
    from tidal.terminal import Terminal

CRASHED = 70  # the exit code of a coordinator that raised what it could not handle
MAX_CRASHES = 5
CRASH_WINDOW_S = 60.0
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True, kw_only=True)
class Hosting:
    """What a coordinator inherits from its supervisor (see the module's docstring)."""

    token: str
    api_sock: socket.socket
    store_sock: socket.socket
    reaped_r: int | None = None  # "PID CODE" lines: orphaned workers the supervisor reaped
    supervisor_pid: int
    incarnation: int = 0  # 0: the first coordinator; n: the n-th restart
    zygote: Zygote | None = None  # the workers' warm interpreter (``tidal.host.zygote``)


@dataclass(frozen=True, kw_only=True)
class Attach:
    """A dead coordinator's token and API port, which its live workers still use
    (``tidal attach``)."""

    token: str
    api_port: int


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host`` (loopback for local workers); ``port`` 0: one the
    OS picks. ``OSError`` if it is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this: without it a response written in two parts waits
    # for the client's delayed ACK (40 ms a call).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    """The HTTP URL a listening socket serves."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _become_subreaper() -> None:
    """Linux: orphaned descendants (a dead coordinator's workers) become our children."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    except (OSError, AttributeError):
        pass  # elsewhere they go to init, which reaps them; their statuses are then unknown


def crash_exit(fn: Callable[[], int]) -> int:
    """``fn()``'s code; ``CRASHED`` (and the traceback on stderr) if it raised."""
    try:
        return fn()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - anything unhandled is a crash to recover from
        traceback.print_exc()
        return CRASHED


def supervise(
    host_job: Callable[[Hosting, bool, bool], int],
    *,
    host: str = "127.0.0.1",
    token: str | None = None,
    api_port: int = 0,
    recover: bool = False,
    name: str = "",
    zygote: Zygote | None = None,
    terminal: Terminal | None = None,
) -> int:
    """Run ``host_job(hosting, recover, stop_requested)`` in a forked coordinator until it
    returns; restart it when it dies. ``api_port``/``token``: those of a coordinator to take
    over (``tidal attach``), with ``recover`` True. ``zygote``: the workers' warm
    interpreter, shared with every coordinator (its caller owns it and ends it).
    ``terminal``: this process's output, switched to the job's log when the terminal hangs
    up (SIGHUP) or a line cannot be written (module doc). Returns the job's exit code."""
    try:
        api_sock = listen(host, api_port)
    except OSError as exc:  # an attach: another process took the workers' address
        raise ValueError(
            f"cannot listen on {host}:{api_port}, the address the job's workers call: "
            f"{exc.strerror or exc}"
        ) from None
    _become_subreaper()
    store_sock = listen(host)
    reaped_r, reaped_w = os.pipe()
    os.set_blocking(reaped_r, False)
    os.set_blocking(reaped_w, False)
    base = Hosting(
        token=token or secrets.token_urlsafe(24),
        api_sock=api_sock,
        store_sock=store_sock,
        reaped_r=reaped_r,
        supervisor_pid=os.getpid(),
        zygote=zygote,
    )
    state = {"child": 0, "signals": 0}

    def forward(signum: int, _frame: object) -> None:
        state["signals"] += 1
        if state["child"]:
            try:
                os.kill(state["child"], signum)
            except ProcessLookupError:
                pass  # it just died: the next one starts with the stop requested

    def hang_up(signum: int, _frame: object) -> None:
        if terminal is not None:
            terminal.lose("SIGHUP")
        if state["child"]:  # in its own process group: the terminal's SIGHUP missed it
            try:
                os.kill(state["child"], signum)
            except ProcessLookupError:
                pass

    say = terminal.say if terminal is not None else _say
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    old[signal.SIGHUP] = signal.signal(signal.SIGHUP, hang_up)
    crashes: list[float] = []
    incarnation = 0
    try:
        while True:
            hosting = Hosting(**{**vars(base), "incarnation": incarnation})
            child = _fork_coordinator(
                lambda h=hosting, r=recover, s=state["signals"] > 0: host_job(h, r, s)
            )
            state["child"] = child
            status = _wait_for(child, reaped_w)
            state["child"] = 0
            code = os.waitstatus_to_exitcode(status)
            if code >= 0 and code != CRASHED:
                return code
            now = time.monotonic()
            crashes = [t for t in crashes if now - t < CRASH_WINDOW_S] + [now]
            why = f"killed by {_signal_name(-code)}" if code < 0 else "crashed"
            if len(crashes) > MAX_CRASHES:
                say(
                    f"tidal: error: the coordinator of job {name} {why}, its {len(crashes)}th "
                    f"crash within {CRASH_WINDOW_S:.0f} s; giving up (its workers train on "
                    "until --orphan-timeout: `tidal attach` takes them over)"
                )
                return 1
            say(f"tidal: the coordinator of job {name} {why}; restarting it")
            incarnation += 1
            recover = True
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for fd in (reaped_r, reaped_w):
            os.close(fd)
        api_sock.close()
        store_sock.close()


def unsupervised(name: str, supervisor_pid: int | None, parent_pid: int) -> str | None:
    """The line a coordinator records when its supervisor is gone (``parent_pid``: its
    parent now; an orphan's is another process), or None while it is supervised."""
    if supervisor_pid is None or parent_pid == supervisor_pid:
        return None
    return (
        f"the supervisor of job {name} (`tidal run`, pid {supervisor_pid}) is gone: its "
        f"coordinator (pid {os.getpid()}) runs on unsupervised, and nothing restarts it if it "
        f"dies (`tidal attach {name}` then takes the workers over)"
    )


class Supervision:
    """A coordinator's watch on its supervisor: ``check`` returns the line once it is gone."""

    def __init__(self, name: str, supervisor_pid: int | None) -> None:
        self.name = name
        self.supervisor_pid = supervisor_pid
        self.told = False

    def check(self) -> list[str]:
        if self.told:
            return []
        line = unsupervised(self.name, self.supervisor_pid, os.getppid())
        self.told = line is not None
        return [line] if line else []


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass  # no terminal to tell: the job goes on all the same


def _flush() -> None:
    """Flush stdout and stderr; a reader that is gone is no reason to raise."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _fork_coordinator(run: Callable[[], int]) -> int:
    _flush()
    pid = os.fork()
    if pid:
        return pid
    code = CRASHED  # pragma: no cover - the child's side
    try:
        os.setpgid(0, 0)  # the terminal's signals reach the supervisor only
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
        # Until the coordinator takes it (``runner._host``): a hang-up never ends the job.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        code = crash_exit(run)
    finally:
        # Nothing may raise past here: the child would unwind into its supervisor's code.
        _flush()
        os._exit(code)


def _wait_for(child: int, reaped_w: int) -> int:
    """Reap children until ``child`` ends; returns its wait status. Any other child is an
    orphaned worker: its exit status goes to the coordinator that adopted it."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # pragma: no cover - the coordinator is always a child
            return 0
        if pid == child:
            return status
        try:
            os.write(reaped_w, f"{pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:
            pass  # nobody reads (a full pipe): the adopter reports the status unknown


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
