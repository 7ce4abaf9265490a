"""A joined host's agent: ``tidal worker --join URL --token-file FILE [--slots N]``.

It registers the host's slots with the job's coordinator, then polls it for as long as the
job runs (``tidal.hosts_protocol``: a long poll, pull only, so the coordinator never has to
reach the host) and carries out the orders: the workers placed here are started as its
children (``children``), signals are forwarded to them, their ends reported at once.

- Workers bind the address this host's route to the coordinator leaves from
  (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, unless set: ``backends.addresses``), and
  call the coordinator at the URL the agent joined with (a TLS proxy in front of it works
  for them too). Their logs are ``HOME/jobs/JOB/logs/worker-ID.log`` on this host. With
  GPUs, each worker gets one (``CUDA_VISIBLE_DEVICES``), as on the local backend.
- SIGTERM or SIGINT (Ctrl-C): the host leaves. Its workers get SIGTERM (a planned leave:
  they leave at a step boundary, nothing redone), the coordinator places nothing more here,
  and the agent exits 0 once they are gone. A second signal kills them.
- The coordinator cannot be reached: the agent keeps its workers (they train on through a
  coordinator's restart) and retries; past the job's ``--orphan-timeout`` it ends them and
  exits 1. A refused connection with no worker running here means the job has ended (its
  supervisor no longer listens): the agent exits 0.
- The coordinator no longer knows the host (a restarted coordinator, or it counted the host
  lost): the agent registers again, listing what it runs; workers its new orders do not list
  are killed (the coordinator counted them lost).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tidal.backends.addresses import route_source, socket_env
from tidal.backends.gpus import assign_gpu, device_entry
from tidal.backoff import capped
from tidal.client import CoordinatorClient, CoordinatorError
from tidal.coordinator.records.home import job_dir
from tidal.hosts.children import Children
from tidal.hosts_protocol import HostJoined, HostOrders, HostPoll, HostRegister
from tidal.protocol import ENV_URL

log = logging.getLogger("tidal.hosts")

#: How long the coordinator may hold a poll with no news (its orders reach the host at once
#: when they change; this only bounds the call).
POLL_WAIT_S = 1.0
#: How long a starting agent waits for a coordinator that is not listening yet.
START_WAIT_S = 30.0
_ENDING = (signal.SIGTERM, signal.SIGKILL, signal.SIGINT)


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    url: str
    token: str = ""
    slots: int
    home: Path
    name: str
    gpus: int = 0  # this host's GPUs (``gpus.visible_gpus``): one per worker


class Stopped(Exception):
    """The agent was told to stop (SIGTERM, Ctrl-C) while it waited to (re)join."""


def transient(exc: CoordinatorError) -> bool:
    """An error answer worth retrying: a 5xx (a proxy in front of a coordinator that is
    restarting answers 502 or 503), not a refusal (4xx)."""
    return exc.status >= 500


def refused(exc: BaseException) -> bool:
    """Whether a failed call met a closed port (nothing listens at the URL any more)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or "Connection refused" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class HostAgent:
    def __init__(self, settings: AgentSettings) -> None:
        self.s = settings
        parts = urlsplit(settings.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--join takes the job's URL (http://HOST:PORT), got {settings.url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            self.address = route_source(parts.hostname, port)
        except OSError as exc:
            raise ValueError(
                f"no route from this machine to {parts.hostname}: {exc.strerror or exc}"
            ) from None
        self.socket_env = socket_env(self.address, os.environ)
        self.client = CoordinatorClient(settings.url, settings.token, timeout_s=10)
        self.reporter = CoordinatorClient(settings.url, settings.token, timeout_s=10)
        self.joined: HostJoined | None = None
        self.children: Children | None = None
        self.version = 0
        self.signal_seq = 0
        self.leaving = 0  # stop signals received
        self._gpu: dict[int, int] = {}
        self._report = threading.Event()

    # -- registration --------------------------------------------------------------------
    def register(self, *, wait_s: float) -> HostJoined:
        """Register (again), retrying while nothing listens for up to ``wait_s``."""
        failures, deadline = 0, time.monotonic() + wait_s
        while True:
            if self.leaving:
                raise Stopped("stopped before the coordinator answered")
            req = HostRegister(
                name=self.s.name,
                address=self.address,
                slots=self.s.slots,
                pid=os.getpid(),
                running=self.children.running() if self.children else [],
                exits=self.children.exits() if self.children else [],
            )
            try:
                joined = self.client.register_host(req)
                break
            except (httpx.TransportError, CoordinatorError) as exc:
                if isinstance(exc, CoordinatorError) and not transient(exc):
                    raise ValueError(self._refusal(exc)) from None
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"cannot reach the job's coordinator at {self.s.url}: {exc}"
                    ) from None
                if failures == 0:
                    log.info("waiting for the job's coordinator at %s (%s)", self.s.url, exc)
            time.sleep(capped(failures, base_s=0.1, cap_s=2.0, draw=random.random()))
            failures += 1
        if self.children is None:
            logs = job_dir(self.s.home, joined.job).logs  # the name is checked there
            self.children = Children(log_dir=logs, on_exit=self._report.set)
        else:
            self.children.acknowledge(req.exits)
        self.joined, self.version, self.signal_seq = joined, 0, 0
        log.info(
            "joined job %s at %s as host %d: %d slot%s, workers bind %s",
            joined.job,
            self.s.url,
            joined.host_id,
            self.s.slots,
            "s" if self.s.slots > 1 else "",
            self.address,
        )
        return joined

    def _refusal(self, exc: CoordinatorError) -> str:
        if exc.status == 401:
            return f"the coordinator at {self.s.url} refused the token (not this job's hosts')"
        return f"the coordinator at {self.s.url} refused this host: {exc}"

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> int:
        """Serve the job until it ends; the exit code (0: the job ended, or the host left)."""
        old = {s: signal.signal(s, self._on_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.register(wait_s=START_WAIT_S)
            threading.Thread(target=self._reporter, name="tidal-report", daemon=True).start()
            return self._loop()
        except Stopped as exc:
            log.info("%s: leaving", exc)
            return 0
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if self.children is not None:
                self.children.signal_all(signal.SIGKILL)
            self.client.close()

    def _on_stop(self, signum: int, _frame: object) -> None:
        """The host leaves: the reporter thread forwards it (a handler takes no lock)."""
        self.leaving += 1
        self._report.set()

    def _loop(self) -> int:
        assert self.joined is not None and self.children is not None
        failures, last_ok = 0, time.monotonic()
        while True:
            children = self.children
            exits = children.exits()
            done = bool(self.leaving) and not children.running_ids()
            req = HostPoll(
                running=children.running(),
                exits=exits,
                version=self.version,
                signal_seq=self.signal_seq,
                wait_s=0.0 if exits or done else POLL_WAIT_S,
                leaving=bool(self.leaving),
                goodbye=done,
            )
            problem: Exception | None = None
            try:
                orders = self.client.poll_host(self.joined.host_id, req)
            except CoordinatorError as exc:
                if exc.status == 404:
                    log.warning(
                        "the coordinator no longer knows this host (%s): joining again", exc
                    )
                    self.register(wait_s=self.joined.orphan_timeout_s)
                    continue
                if not transient(exc):
                    log.error("%s", self._refusal(exc))
                    return 1
                problem = exc  # a proxy's 502 while the coordinator restarts
            except httpx.TransportError as exc:
                if refused(exc) and not children.running_ids():
                    log.info(
                        "the job's coordinator at %s is gone (the job ended): leaving", self.s.url
                    )
                    return 0
                problem = exc
            if problem is not None:
                if time.monotonic() - last_ok > self.joined.orphan_timeout_s:
                    log.error(
                        "no answer from the job's coordinator for %.0f s (%s): ending this "
                        "host's workers",
                        self.joined.orphan_timeout_s,
                        problem,
                    )
                    return 1
                time.sleep(capped(failures, base_s=0.1, cap_s=2.0, draw=random.random()))
                failures += 1
                continue
            failures, last_ok = 0, time.monotonic()
            children.acknowledge(exits)
            if done:
                log.info("left the job: every worker of this host has ended")
                return 0
            self.apply(orders)

    def apply(self, orders: HostOrders) -> None:
        """Carry out the orders (``hosts_protocol``): signals in order, then starts, then the
        end of workers the coordinator no longer knows."""
        children = self.children
        assert children is not None and self.joined is not None
        self.version = orders.version
        wanted = {o.worker_id: o.env for o in orders.workers}
        for s in sorted(orders.signals, key=lambda s: s.seq):
            if s.seq <= self.signal_seq:
                continue
            self.signal_seq = s.seq
            if children.signal(s.worker_id, s.signum):
                continue
            if s.worker_id in wanted and not children.started(s.worker_id) and s.signum in _ENDING:
                children.cancel(s.worker_id, "cancelled before its host started it")
        for wid, env in wanted.items():
            if children.started(wid):
                continue
            if self.leaving:
                children.cancel(wid, "its host was leaving")
            else:
                self.start(wid, env)
        for wid in children.running_ids():
            if wid not in wanted:
                log.warning("worker %d is no longer this job's (its host was counted lost)", wid)
                children.signal(wid, signal.SIGKILL)

    def start(self, wid: int, order_env: dict[str, str]) -> None:
        assert self.children is not None and self.joined is not None
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.socket_env, **order_env}
        env.setdefault("OMP_NUM_THREADS", "1")
        env[ENV_URL] = self.s.url.rstrip("/")  # the URL this host reaches the coordinator at
        running = set(self.children.running_ids())
        self._gpu = {w: g for w, g in self._gpu.items() if w in running}
        gpu = assign_gpu(n_gpus=self.s.gpus, in_use=self._gpu, share=True)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = device_entry(gpu, os.environ.get("CUDA_VISIBLE_DEVICES"))
            self._gpu[wid] = gpu
        cwd = self.joined.cwd if os.path.isdir(self.joined.cwd) else None
        pid = self.children.start(wid, [sys.executable, *self.joined.command], env, cwd)
        log.info("started worker %d (pid %d)", wid, pid)

    def _reporter(self) -> None:
        """Forward a stop signal to the workers (SIGTERM, then SIGKILL at a second), and
        report each worker's end and the host's leaving at once, beside the held poll (on a
        connection of its own)."""
        forwarded = 0
        while True:
            self._report.wait()
            self._report.clear()
            children, joined = self.children, self.joined
            if children is None or joined is None:
                continue
            if self.leaving > forwarded:
                forwarded = self.leaving
                children.signal_all(signal.SIGTERM if forwarded == 1 else signal.SIGKILL)
                log.info(
                    "leaving: %s to this host's workers", "SIGTERM" if forwarded == 1 else "SIGKILL"
                )
            exits = children.exits()
            req = HostPoll(
                running=children.running(),
                exits=exits,
                version=self.version,
                signal_seq=self.signal_seq,
                leaving=bool(self.leaving),
            )
            try:
                self.reporter.poll_host(joined.host_id, req)
            except (httpx.TransportError, CoordinatorError):
                continue  # the main loop reports them with its next poll
            children.acknowledge(exits)
