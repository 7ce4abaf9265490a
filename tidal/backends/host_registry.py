"""The hosts of a job on joined hosts, as the coordinator knows them: their slots, the
workers placed on each, the orders each agent is to carry out, and their losses.

Two sides call it, each under its lock, neither blocking the other for long:

- the agents' (``tidal.hosts.agent``, through the API's ``/hosts`` calls, on the server's
  threads): ``register``, ``poll``, ``waiter``, ``cut`` (``tidal.hosts_protocol``);
- the coordinator's, through ``HostsBackend`` on the control loop: ``request`` a worker,
  ``place_waiting``, ``signal``, ``take_exits``, ``check`` for lost hosts, ``expect`` an
  adopted worker.

Contracts: a worker is placed on a host only within its slots (``placement.place``); the
agent's report of a worker's end is an ``Exit`` once, however often it is sent; a lost host
(``placement.lost_hosts``) is an ``Exit`` for each of its workers with the reason, and the
host is forgotten (its agent, if it comes back, joins as a new host and ends the workers it
still runs: nobody knows them any more). The local "host" (``--local-slots``, id 0) is placed
on like any other; ``HostsBackend`` runs its workers itself. Every change an agent or the
loop should act on writes a byte to the wake pipe (``wake_fd``): the control loop sleeps on
it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from tidal.backends.base import Exit
from tidal.backends.placement import Heard, Room, lost_hosts, place
from tidal.hosts_protocol import (
    HostJoined,
    HostOrders,
    HostPoll,
    HostRegister,
    SignalOrder,
    WorkerOrder,
)

LOCAL = 0  # the id of the coordinator's own machine, when it has ``--local-slots``
#: A poll whose connection closed (its agent died) counts the host lost this long after,
#: unless the agent calls again (a live agent whose connection broke does at once).
CUT_GRACE_S = 1.0
_CANCEL_SIGNALS = (signal.SIGTERM, signal.SIGKILL, signal.SIGINT)
_KILLED = -signal.SIGKILL  # a lost host's workers: as if killed


class UnknownHost(LookupError):
    """A host id the coordinator does not know (any more): the agent registers again."""


@dataclass(kw_only=True)
class Host:
    id: int
    node: str  # what ``Backend.node`` says of its workers: "NAME (ADDRESS)"
    slots: int
    pid: int = 0
    assigned: dict[int, dict[str, str]] = field(default_factory=dict)  # id -> env, until exit
    signals: list[SignalOrder] = field(default_factory=list)  # not yet applied
    version: int = 1
    next_seq: int = 1  # the next signal's number
    last_seen: float = 0.0  # monotonic
    cut_at: float | None = None
    leaving: bool = False
    waiters: list[Future] = field(default_factory=list)

    def room(self) -> Room:
        return Room(
            host_id=self.id, slots=self.slots, used=len(self.assigned), leaving=self.leaving
        )

    def orders(self) -> HostOrders:
        return HostOrders(
            version=self.version,
            workers=[WorkerOrder(worker_id=w, env=env) for w, env in self.assigned.items()],
            signals=list(self.signals),
        )

    def changed(self) -> None:
        """Its orders changed: a new version, and its waiting poll answered."""
        self.version += 1
        wake_all(self.waiters)


def wake_all(waiters: list[Future]) -> None:
    for f in waiters:
        if not f.done():
            try:
                f.set_result(None)
            except Exception:  # noqa: BLE001 - cancelled meanwhile by its poll's timeout
                pass
    waiters.clear()


class HostRegistry:
    def __init__(
        self,
        *,
        job: str,
        command: list[str],
        cwd: str,
        lost_after_s: float,
        orphan_timeout_s: float,
        local_node: str | None = None,
        local_slots: int = 0,
    ) -> None:
        """``command``: the script and its arguments every worker runs; ``lost_after_s``:
        silence after which a host is lost (the job's heartbeat timeout); ``local_slots``:
        workers the coordinator's machine (``local_node``) runs itself."""
        self.joined = HostJoined(
            host_id=1,  # a placeholder; each registration gets its own
            job=job,
            command=command,
            cwd=cwd,
            lost_after_s=lost_after_s,
            orphan_timeout_s=orphan_timeout_s,
        )
        self._lock = threading.Lock()
        self._hosts: dict[int, Host] = {}
        if local_slots > 0:
            self._hosts[LOCAL] = Host(id=LOCAL, node=local_node or "local", slots=local_slots)
        self._next_id = 1
        self._queue: dict[int, dict[str, str]] = {}  # waiting workers, oldest first
        self._where: dict[int, int] = {}  # worker -> host, while placed
        self._exits: list[Exit] = []
        self._last_lines: dict[int, str] = {}
        self._expected: dict[int, tuple[int, float]] = {}  # adopted: worker -> (pid, deadline)
        self._news: list[str] = []
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # -- the agents' side ----------------------------------------------------------------
    def register(self, req: HostRegister, *, peer: str = "") -> HostJoined:
        """A host joins with ``req.slots``; the workers it says it runs are adopted if a
        restarted coordinator expects them (``expect``), else left out of its orders (it
        ends them)."""
        with self._lock:
            hid = self._next_id
            self._next_id += 1
            node = f"{req.name} ({req.address})"
            host = Host(id=hid, node=node, slots=req.slots, pid=req.pid)
            host.last_seen = time.monotonic()
            self._hosts[hid] = host
            adopted = []
            for w in req.running:
                pid, _ = self._expected.get(w.worker_id, (None, 0.0))
                if pid == w.pid:
                    del self._expected[w.worker_id]
                    host.assigned[w.worker_id] = {}
                    self._where[w.worker_id] = hid
                    adopted.append(w.worker_id)
            self._record_exits(host, req.exits)
            for e in req.exits:  # ended while no coordinator ran: its real end, not "lost"
                if self._expected.pop(e.worker_id, None) is not None:
                    self._last_lines[e.worker_id] = e.last_line
                    self._exit(
                        Exit(worker_id=e.worker_id, returncode=e.returncode, reason=e.reason)
                    )
            seen = f" from {peer}" if peer and peer != req.address else ""
            self._news.append(
                f"host {hid} joined: {node}{seen}, {req.slots} slot{'s' if req.slots > 1 else ''}"
                + (f", running workers {adopted} (adopted)" if adopted else "")
            )
            self._wake()
            return self.joined.model_copy(update={"host_id": hid})

    def poll(self, hid: int, req: HostPoll) -> HostOrders:
        """An agent's report (see ``hosts_protocol``); its orders. ``UnknownHost`` if the
        host is not known (a restarted coordinator, or it was declared lost)."""
        with self._lock:
            host = self._agent(hid)
            host.last_seen, host.cut_at = time.monotonic(), None
            host.signals = [s for s in host.signals if s.seq > req.signal_seq]
            self._record_exits(host, req.exits)
            if req.leaving and not host.leaving:
                host.leaving = True
                self._news.append(f"host {hid} ({host.node}) is leaving: it takes no more workers")
            if req.goodbye:
                self._drop(host, "left", "its host left before starting it", code=0)
            return host.orders()

    def waiter(self, hid: int, version: int) -> Future | None:
        """A future that completes when host ``hid``'s orders change from ``version``, or
        None when they differ already (answer at once) or the registry is closed."""
        with self._lock:
            host = self._agent(hid)
            if self._closed or host.version != version:
                return None
            f: Future = Future()
            host.waiters.append(f)
            return f

    def orders(self, hid: int) -> HostOrders:
        with self._lock:
            return self._agent(hid).orders()

    def cut(self, hid: int) -> None:
        """The connection of host ``hid``'s waiting poll closed (``placement.Heard.cut_s``)."""
        with self._lock:
            host = self._hosts.get(hid)
            if host is not None and host.id != LOCAL:
                host.cut_at = time.monotonic()
                self._wake()

    # -- the coordinator's side ----------------------------------------------------------
    def request(self, wid: int, env: dict[str, str]) -> int | None:
        """Place worker ``wid`` (``placement.place``): its host's id, or None (it waits)."""
        with self._lock:
            self._queue[wid] = env
            placed = self._place()
            return next((h for w, h, _ in placed if w == wid), None)

    def place_waiting(self) -> list[tuple[int, int, dict[str, str]]]:
        """Place the waiting workers a host has room for now: ``(worker, host, env)`` each,
        oldest first."""
        with self._lock:
            return self._place()

    def _place(self) -> list[tuple[int, int, dict[str, str]]]:
        placed = []
        for wid in list(self._queue):
            hid = place([h.room() for h in self._hosts.values()])
            if hid is None:
                break
            env = self._queue.pop(wid)
            host = self._hosts[hid]
            host.assigned[wid] = env
            self._where[wid] = hid
            host.changed()
            placed.append((wid, hid, env))
        return placed

    def signal(self, wid: int, sig: int) -> bool:
        """Send ``sig`` to worker ``wid`` through its host's agent. A waiting worker is
        cancelled by SIGTERM, SIGKILL or SIGINT (an exit, code 0). False for a worker of the
        local host (the caller signals it) or none known."""
        with self._lock:
            if wid in self._queue:
                if sig in _CANCEL_SIGNALS:
                    del self._queue[wid]
                    self._exit(
                        Exit(worker_id=wid, returncode=0, reason="cancelled before a host took it")
                    )
                return True
            hid = self._where.get(wid)
            if hid is None or hid == LOCAL:
                return False
            host = self._hosts[hid]
            host.signals.append(SignalOrder(seq=host.next_seq, worker_id=wid, signum=sig))
            host.next_seq += 1
            host.changed()
            return True

    def ended(self, wid: int) -> None:
        """A worker of the local host ended (its exit reported by the local backend)."""
        with self._lock:
            hid = self._where.pop(wid, None)
            if hid is not None:
                self._hosts[hid].assigned.pop(wid, None)

    def adopt_local(self, wid: int) -> None:
        """Worker ``wid`` of a previous coordinator runs on this machine (adopted by the local
        backend): it holds a local slot."""
        with self._lock:
            if LOCAL in self._hosts:
                self._hosts[LOCAL].assigned[wid] = {}
                self._where[wid] = LOCAL

    def expect(self, wid: int, pid: int, wait_s: float) -> None:
        """Worker ``wid`` (process ``pid``) ran on a host of a previous coordinator: adopted
        when its agent registers again listing it, lost if none does within ``wait_s``."""
        with self._lock:
            self._expected[wid] = (pid, time.monotonic() + wait_s)

    def check(self, now: float | None = None) -> None:
        """Count lost hosts (``placement.lost_hosts``) and unclaimed adoptions as exits, as
        of ``now`` (monotonic; default: now)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            heard = [
                Heard(
                    host_id=h.id,
                    silent_s=now - h.last_seen,
                    cut_s=None if h.cut_at is None else now - h.cut_at,
                )
                for h in self._hosts.values()
                if h.id != LOCAL
            ]
            for hid, why in lost_hosts(
                heard, timeout_s=self.joined.lost_after_s, cut_grace_s=CUT_GRACE_S
            ):
                host = self._hosts[hid]
                self._drop(host, f"lost: {why}", f"lost with its host {host.node}: {why}")
            for wid, (_, deadline) in list(self._expected.items()):
                if now >= deadline:
                    del self._expected[wid]
                    why = "no host claimed it after the coordinator restarted"
                    self._exit(Exit(worker_id=wid, returncode=-9, reason=why, known=False))

    def _drop(self, host: Host, what: str, reason: str, code: int = _KILLED) -> None:
        """Forget ``host``; each worker still placed on it is an exit with ``reason``."""
        gone = sorted(host.assigned)
        for wid in gone:
            self._where.pop(wid, None)
            self._exit(Exit(worker_id=wid, returncode=code, reason=reason))
        host.assigned.clear()
        del self._hosts[host.id]
        wake_all(host.waiters)
        self._news.append(
            f"host {host.id} ({host.node}) {what}"
            + (f"; its workers {gone} with it" if gone else "")
        )

    def take_exits(self) -> list[Exit]:
        self._drain()
        with self._lock:
            exits, self._exits = self._exits, []
            return exits

    def take_news(self) -> list[str]:
        with self._lock:
            news, self._news = self._news, []
            return news

    # -- reading -------------------------------------------------------------------------
    def waiting(self) -> set[int]:
        with self._lock:
            return set(self._queue)

    def placed(self) -> list[int]:
        """Workers placed on a host (or expected back) whose end was not taken yet."""
        with self._lock:
            return [*self._where, *self._expected, *(e.worker_id for e in self._exits)]

    def host_of(self, wid: int) -> int | None:
        with self._lock:
            return self._where.get(wid)

    def node(self, wid: int) -> str | None:
        with self._lock:
            hid = self._where.get(wid)
            return self._hosts[hid].node if hid is not None else None

    def last_line(self, wid: int) -> str:
        with self._lock:
            return self._last_lines.get(wid, "")

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def close(self) -> None:
        """Answer every waiting poll now (the server is stopping); later polls still work."""
        with self._lock:
            self._closed = True
            for host in self._hosts.values():
                wake_all(host.waiters)

    def release(self) -> None:
        """Close the wake pipe: the backend is done."""
        self.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- inside the lock -----------------------------------------------------------------
    def _agent(self, hid: int) -> Host:
        host = self._hosts.get(hid)
        if host is None or hid == LOCAL:
            raise UnknownHost(f"host {hid} is not a host of this job (any more): register again")
        return host

    def _record_exits(self, host: Host, exits: list) -> None:
        for e in exits:
            if self._where.get(e.worker_id) != host.id:
                continue  # reported before (its answer was lost), or not this host's
            del self._where[e.worker_id]
            host.assigned.pop(e.worker_id, None)
            self._last_lines[e.worker_id] = e.last_line
            self._exit(Exit(worker_id=e.worker_id, returncode=e.returncode, reason=e.reason))
            host.changed()

    def _exit(self, ex: Exit) -> None:
        self._exits.append(ex)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # full (the loop will wake anyway) or closed

    def _drain(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:
            pass
