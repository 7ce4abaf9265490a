"""Workers as Ray actors on a Ray cluster (``tidal run --backend ray``).

The coordinator stays where ``tidal run`` runs and joins the cluster as a Ray driver. Each
worker is one ``WorkerHost`` actor holding the job's resource request (``--worker-cpus``,
``--worker-gpus``) on whichever node Ray picks; the actor runs the training script as its
child (see ``tidal.backends.ray_actor``). Ray places, the coordinator decides: Ray never
restarts a worker (``max_restarts=0``), Tidal's membership protocol replaces it.

Contracts:

- A worker Ray cannot place yet (no node with room) is *waiting*: the request stays queued
  in Ray, which places it when a node with room joins (its autoscaler, or ``ray start`` by
  hand). The coordinator keeps its target and shows the worker as ``pending``.
- A lost actor (its node's raylet died, its process was killed) is reported as an exit
  with SIGKILL's code and a reason: to the coordinator, a lost machine to recover from.
- Actors are *detached* and named after the worker's credential (``actor_name``): they
  outlive the coordinator's Ray driver, so a restarted coordinator (a new driver) adopts
  them by name (``adopt``) and the job trains on through the outage. Only the coordinator
  ends them (``signal`` SIGKILL, ``close``), or they end themselves once their script has
  ended and nobody collected it (``ray_actor.LINGER_S``).
- One monitor thread waits on every actor's calls; ``poll``, ``waiting`` and ``alive`` read
  what it recorded, so the coordinator's control loop never blocks on Ray.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.backends.base import Backend, Exit
from tidal.config import ClusterSpec, JobSpec
from tidal.protocol import ENV_TOKEN

log = logging.getLogger(__name__)

WAIT_S = 0.05
NAMESPACE = "tidal"  # where the workers' named actors live, whatever the driver's namespace
ADOPT_TIMEOUT_S = 10.0
_CANCEL_SIGNALS = (signal.SIGTERM, signal.SIGKILL, signal.SIGINT)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "the ray backend needs Ray: pip install -e '.[ray]' (or pip install 'ray[default]')"
        ) from None
    return ray


def node_address() -> str:
    """This node's address as Ray knows it (what workers on other nodes reach it at),
    without joining the cluster."""
    return import_ray().util.get_node_ip_address()


def connect(cluster: ClusterSpec) -> None:
    """Join the cluster at ``cluster.address`` as a driver (``local``: start a private one)."""
    ray = import_ray()
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if cluster.address != "local":
        kwargs["address"] = cluster.address
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(
            f"cannot join a Ray cluster at {cluster.address!r}: {first} (start one with "
            "`ray start --head`, or pass --ray-address HOST:PORT or local)"
        ) from None


def actor_name(env: dict[str, str]) -> str:
    """The name of a worker's actor: a digest of its credential (``protocol.worker_token``,
    derived from the job's token and the worker's id), so that only a coordinator of the
    same job, which holds the token, can name it, and two jobs of one name never clash."""
    return "tidal-worker-" + hashlib.sha256(env[ENV_TOKEN].encode()).hexdigest()[:24]


@dataclass(kw_only=True)
class _Actor:
    handle: Any
    start_ref: Any
    wait_ref: Any = None
    placed: dict | None = None  # what WorkerHost.start returned, once Ray placed it
    cancelled: bool = False
    last_line: str = ""


class RayBackend(Backend):
    def __init__(self, *, spec: JobSpec, log_dir: Path, cwd: Path | None = None) -> None:
        connect(spec.cluster)
        ray = import_ray()
        from tidal.backends.ray_actor import WorkerHost

        self._ray = ray
        self.host = ray.util.get_node_ip_address()
        self._command: list[str | None] = [None, *spec.worker_argv]
        self._cwd = str(cwd or Path.cwd())
        self._log_dir = log_dir
        self._host_cls = ray.remote(WorkerHost)
        self._host_options = dict(
            num_cpus=spec.cluster.worker_cpus,
            num_gpus=spec.cluster.worker_gpus,
            max_concurrency=4,  # wait() blocks while signal() must still get through
            max_restarts=0,
            lifetime="detached",  # it outlives this driver: a restarted coordinator adopts it
            namespace=NAMESPACE,
        )
        self._actors: dict[int, _Actor] = {}
        self._exits: list[Exit] = []
        self._last_lines: dict[int, str] = {}  # each ended worker's last log line
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._warned = False
        self._monitor = threading.Thread(target=self._watch, name="tidal-ray-monitor", daemon=True)
        self._monitor.start()

    # -- the Backend interface -----------------------------------------------------------
    def start(self, worker_id: int, env: dict[str, str]) -> int | None:
        """The worker's environment is its node's, plus this process's ``TIDAL_*`` variables
        and ``PYTHONPATH`` (a test's armed faults, ``tidal.testing.fault_env``, as the local
        backend passes them on), plus ``env``."""
        ours = {k: v for k, v in os.environ.items() if k.startswith("TIDAL_") or k == "PYTHONPATH"}
        options = {**self._host_options, "name": actor_name(env)}
        handle = self._host_cls.options(**options).remote(
            str(self._log_dir / f"worker-{worker_id}.log")
        )
        ref = handle.start.remote(self._command, {**ours, **env}, self._cwd)
        with self._lock:
            self._actors[worker_id] = _Actor(handle=handle, start_ref=ref)
        return None  # the pid is known once Ray places it; the worker reports it

    def adopt(self, worker_id: int, pid: int, env: dict[str, str]) -> bool:
        """Find the worker's actor by name (a previous coordinator of the job made it) and
        watch it: True if it runs the script ``pid``. ``pid`` 0 (the worker never
        registered: perhaps not even placed): its actor, if any, is ended, and the worker
        counts as lost; so is one that does not answer, or runs another script."""
        ray = self._ray
        try:
            handle = ray.get_actor(actor_name(env), namespace=NAMESPACE)
        except ValueError:  # no such actor (any more)
            return False
        try:
            where = ray.get(handle.where.remote(), timeout=ADOPT_TIMEOUT_S) if pid else None
        except ray.exceptions.RayError:  # dead, or not answering
            where = None
        if where is None or where["pid"] != pid:
            ray.kill(handle)  # a detached actor nobody watches would hold its CPUs for ever
            return False
        with self._lock:
            self._actors[worker_id] = _Actor(
                handle=handle, start_ref=None, placed=where, wait_ref=handle.wait.remote()
            )
        return True

    def poll(self) -> list[Exit]:
        with self._lock:
            exits, self._exits = self._exits, []
        return exits

    def signal(self, worker_id: int, sig: int) -> None:
        with self._lock:
            actor = self._actors.get(worker_id)
            if actor is None:
                return
            if actor.placed is None:
                if sig in _CANCEL_SIGNALS:
                    actor.cancelled = True
                    self._ray.kill(actor.handle)
                return
            if sig == signal.SIGKILL:
                # Killing the actor's process takes the script with it (PR_SET_PDEATHSIG),
                # even when the actor is too wedged to run a method.
                self._ray.kill(actor.handle)
            else:
                actor.handle.signal.remote(sig)

    def alive(self) -> list[int]:
        with self._lock:
            return list(self._actors)

    def waiting(self) -> set[int]:
        with self._lock:
            return {wid for wid, a in self._actors.items() if a.placed is None}

    def node(self, worker_id: int) -> str | None:
        with self._lock:
            actor = self._actors.get(worker_id)
            return actor.placed["node_id"] if actor and actor.placed else None

    def describe_exit(self, worker_id: int) -> str:
        return self._last_lines.get(worker_id, "")

    def leave(self) -> None:
        """Disconnect this driver; the detached actors and their scripts train on."""
        self._disconnect(kill=False)

    def close(self) -> None:
        self._disconnect(kill=True)

    def _disconnect(self, *, kill: bool) -> None:
        """Stop the monitor, forget the actors (ending them if ``kill``), leave Ray."""
        self._closing.set()
        self._monitor.join(timeout=5)
        with self._lock:
            for actor in self._actors.values() if kill else ():
                self._ray.kill(actor.handle)
            self._actors.clear()
        self._ray.shutdown()

    # -- the monitor thread --------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing.is_set():
            with self._lock:
                refs = {}
                for wid, a in self._actors.items():
                    refs[a.start_ref if a.wait_ref is None else a.wait_ref] = wid
            if not refs:
                self._closing.wait(WAIT_S)
                continue
            try:
                ready, _ = self._ray.wait(list(refs), num_returns=1, timeout=WAIT_S)
            except Exception as exc:  # noqa: BLE001 - the driver lost its cluster (head gone)
                # Workers still heartbeat the coordinator; a lost one misses its heartbeats
                # and is handled as hung. Keep trying: the connection may come back.
                if not self._warned:
                    self._warned = True
                    log.warning("Ray is not answering: %s", exc)
                self._closing.wait(1.0)
                continue
            for ref in ready:
                self._settle(refs[ref], ref)

    def _settle(self, wid: int, ref: Any) -> None:
        ray = self._ray
        try:
            value, error = ray.get(ref), None
        except ray.exceptions.RayError as exc:
            value, error = None, exc
        with self._lock:
            actor = self._actors.get(wid)
            if actor is None:
                return
            if ref is actor.start_ref and error is None:
                actor.placed = value
                actor.wait_ref = actor.handle.wait.remote()
                return
            if error is None and value.get("running"):  # ``wait`` returns every few seconds
                actor.wait_ref = actor.handle.wait.remote()
                return
            if error is None:
                exit_ = Exit(worker_id=wid, returncode=value["returncode"])
                self._last_lines[wid] = value["last_line"]
            elif actor.cancelled:
                exit_ = Exit(worker_id=wid, returncode=0, reason="cancelled before Ray placed it")
            elif isinstance(error, ray.exceptions.RayTaskError):  # start() itself raised
                exit_ = Exit(worker_id=wid, returncode=1, reason="could not start on its node")
                self._last_lines[wid] = str(error).strip().splitlines()[-1][:300]
            else:
                exit_ = Exit(
                    worker_id=wid,
                    returncode=-signal.SIGKILL,
                    reason="lost with its Ray actor: node down or actor process killed",
                )
            self._exits.append(exit_)
            del self._actors[wid]
            ray.kill(actor.handle)  # frees its resources for the next request
