"""The worker zygote: an interpreter that imported torch and Tidal's worker runtime once and
forks each worker from itself, so a worker starts in milliseconds instead of the ~2.4 s of a
core an interpreter spends importing torch, on every launch, scale-up and replacement.

Started by the local backend (``tidal.backends.zygote.Zygote``) as ``PYTHON -P -m
tidal.host.zygote FD`` with the workers' common environment; ``FD`` is a socket to the
backend. Messages are JSON lines:

- backend -> zygote: ``{"id": ID, "ping": true}``, or a fork: ``{"id": ID, "argv": [SCRIPT,
  ARG...], "env": {...}, "cwd": DIR|null, "log": PATH}`` (``argv`` ``["-m", MODULE, ARG...]``:
  a module run as ``PYTHON -m MODULE ARG...`` runs it);
- zygote -> backend: ``{"id": ID, "ready": PID}`` for a ping, ``{"id": ID, "pid": N}`` (or
  ``{"id": ID, "error": TEXT}``) for a fork, and ``{"exit": PID, "code": C}`` when a worker it
  forked ends (C as ``Popen.returncode``: ``-N`` for signal N).

Requests are read only once the imports are done, so a ping's answer says the zygote is
ready. The ids let a restarted coordinator, which shares the socket with its supervisor and
its dead predecessor, ignore the answers to requests it did not make.

The job's supervisor starts the zygote, before it imports the coordinator (the two imports
overlap), and shares it with every coordinator it forks; the zygote exits when the socket
closes, i.e. when the supervisor and its coordinators have ended. If the zygote dies first,
its workers train on: they become children of the supervisor, the job's subreaper, which
reports their exits to the coordinator (``tidal.coordinator.process.supervisor``).

Contract: a forked worker cannot tell itself from ``PYTHON SCRIPT ARG...`` (or ``PYTHON -m
MODULE ARG...``) started by ``subprocess`` with ``start_new_session``:

- its own session; stdin ``/dev/null``; stdout and stderr appended to ``log``;
- exactly ``env`` as its environment (``os.environ``, so C's ``getenv`` sees it too), ``cwd``,
  ``sys.argv`` and ``sys.path[0]`` the script's real directory (``-P``: the zygote itself
  put nothing there; a module's: the working directory, as with ``-m``);
- the signal dispositions of a fresh interpreter, and no death signal;
- its own random state: ``random`` reseeds itself at a fork, numpy's global generator is
  reseeded here from the OS (the torch generator's default seed is fixed in any process);
- ``sitecustomize`` run again once ``env`` is set: start-up hooks see the worker's own
  variables (``tidal.testing``'s fault injector reads ``TIDAL_WORKER_ID``);
- the script run as ``__main__`` ending as an interpreter ends: the traceback and exit code
  1 of an uncaught exception, ``sys.exit`` codes, ``atexit``, non-daemon threads joined.
- one difference by design: what the zygote imported is frozen (``gc.freeze``), never
  collected; the script's own objects are collected as anywhere.

What it cannot get is a variable a library reads when it is loaded (``OMP_NUM_THREADS``,
``PYTHONPATH``...): the backend forks only workers whose environment differs from the zygote's
in variables read later (``tidal.backends.zygote.fork_refusal``), and starts others with exec.
The zygote creates no thread and runs no torch operation, so a fork copies no held lock (the
fork-started DataLoader workers of every training script rely on the same).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys

#: What the zygote imports before it forks: what nearly every worker imports first
#: (``torch._dynamo``: every optimizer's constructor imports it, 1.5 s; ``safetensors``: the
#: checkpoint format).
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.nn.parallel",
    "numpy",
    "safetensors.torch",
    "tidal.worker.trainer.runtime",
)


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the worker imports it (or fails to) itself


def _send(chan: socket.socket, msg: dict) -> None:
    chan.sendall(json.dumps(msg).encode() + b"\n")


def _reap(chan: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(chan, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(fd: int) -> dict | None:
    """Answer requests on ``fd`` until it closes (returns None, in the zygote) or a fork is
    made (returns the request, in the forked worker)."""
    chan = socket.socket(fileno=fd)
    _preload()
    # What the imports made (torch's ~10^6 objects) lives as long as each worker: out of the
    # collector's sight, in the zygote and so in every worker forked from it. A full
    # collection no longer walks it, and neither does the one at the worker's exit: 0.6 s
    # of every exit here (docs/decisions/zygote.md).
    gc.collect()
    gc.freeze()
    wake_r, wake_w = os.pipe()
    for w in (wake_r, wake_w):
        os.set_blocking(w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    buf = b""
    while True:
        ready, _, _ = select.select([chan, wake_r], [], [])
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        _reap(chan)
        if chan not in ready:
            continue
        data = chan.recv(1 << 20)
        if not data:
            return None
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                request = json.loads(line)
            except ValueError:
                continue  # the tail of a request whose sender died while writing it
            if request.get("ping"):
                _send(chan, {"id": request.get("id"), "ready": os.getpid()})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as exc:
                _send(chan, {"id": request.get("id"), "error": f"fork failed: {exc}"})
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for w in (wake_r, wake_w):
                    os.close(w)
                chan.close()
                return request
            _send(chan, {"id": request.get("id"), "pid": pid})


def become(request: dict) -> list[str]:
    """Turn this forked process into the requested worker (the module's contract); returns
    its ``argv`` (the script's path or ``-m MODULE``, then the arguments), for ``run``."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("cwd"):
        os.chdir(request["cwd"])
    argv = list(request["argv"])
    if argv[0] == "-m":  # as ``python -m``: argv[0] "-m" until runpy names the module's file
        sys.argv = ["-m", *argv[2:]]
        sys.path.insert(0, os.getcwd())
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.realpath(argv[0])))
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "sitecustomize" in sys.modules:
        import importlib

        importlib.reload(sys.modules["sitecustomize"])
    return argv


def run(argv: list[str]) -> None:
    """Run the worker ``become`` made: its script, or its module as ``python -m`` does."""
    import runpy

    if argv[0] == "-m":
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    _request = serve(int(sys.argv[1]))
    if _request is None:
        sys.exit(0)
    run(become(_request))
