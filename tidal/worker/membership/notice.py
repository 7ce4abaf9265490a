"""Rank 0's knowledge of the coordinator's change counter, kept current by a waiting thread.

Members learn of a new generation, a stop or the job's end from the coordinator's answer
(``Agent.latest``), and switch together through the control word, which needs only one
member to know. The coordinator adds 1 to ``store_keys.notice_key`` with every such change
(after publishing the answer) and sets ``store_keys.notice_wake_key`` for the new count.

Rank 0 once read the counter before each step's all-reduce: a store round trip that cost
0.2 to 0.3 ms a step on saturated cores (the coordinator's store thread must be scheduled),
0.5 to 0.8% of a step, on the step's critical path. Now a thread blocks in the store's
server-side ``wait`` on the next count's wake key (the GIL released, no polling) and, when
it appears, reads the counter into an attribute; ``changed`` compares two integers, no
network. The thread starts at the first ``changed`` (rank 0 alone asks), so other members
hold no connection for it.

Contract: ``mark`` (a synchronous read) before fetching an answer, so that a change made
after that answer is news to ``changed``. A change is seen at the first ``changed`` after
the thread woke (microseconds after the coordinator's ``set``), not necessarily the very
next call. When the store is gone (the coordinator died; its successor serves a new one)
the notices stop (``broken``) until ``follow`` names the new store, and members learn of
changes from heartbeats meanwhile.

Why ``close`` wakes the thread by moving the counter itself: a thread still inside the
store's C++ ``wait`` when the interpreter finalises aborts the process ("terminate called
without an active exception"), and a ``wait`` with a timeout logs a warning at every
expiry. So the thread waits without a timeout and ``close`` (also run at exit) adds 1 and
sets the wake key, then joins it. The extra count is at worst one spurious notice: a rank 0
that sees it fetches an answer that says nothing new.
"""

from __future__ import annotations

import atexit
import datetime
import threading

import torch.distributed as dist

from tidal.protocol import WorkerConfig
from tidal.store_auth import AuthStore
from tidal.store_keys import notice_key, notice_wake_key

TIMEOUT_S = 2.0
#: How long ``close`` waits for the thread to leave the store's ``wait``.
JOIN_S = 1.0
_FOREVER = datetime.timedelta(days=365)


def _connect(host: str, port: int, store_key: str) -> AuthStore:
    """A client of the store; the wake keys it sets are authenticated (``store_auth``: the
    counter itself is not, and need not be: a forged count only makes rank 0 fetch an answer
    from the authenticated API for nothing)."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    return AuthStore(dist.TCPStore(host, port, is_master=False, timeout=timeout), store_key)


class _Waiter:
    """One thread following one store's counter: ``latest`` is the highest count it read
    (None before its first read), ``failed`` is set when the store went away."""

    def __init__(self, host: str, port: int, namespace: str, store_key: str) -> None:
        self._host, self._port, self._namespace = host, port, namespace
        self._store_key = store_key
        self.latest: int | None = None
        self.failed = False
        self.moved = threading.Condition()  # notified at each new count, and on failure
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tidal-notice", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        key = notice_key(self._namespace)
        try:
            client = _connect(self._host, self._port, self._store_key)
            while True:
                n = client.add(key, 0)
                if self.latest is None or n > self.latest:
                    with self.moved:
                        self.latest = n
                        self.moved.notify_all()
                # Checked after the read: a ``close`` that sets the flag after this check
                # moves the count past ``n`` after it, so the key waited on below is (or
                # will be) set, and the thread returns.
                if self._stop:
                    return
                client.wait([notice_wake_key(self._namespace, n + 1)], _FOREVER)
        except (dist.DistError, RuntimeError):
            with self.moved:
                self.failed = not self._stop
                self.moved.notify_all()

    def close(self) -> None:
        """Stop the thread: move the counter so its ``wait`` returns, then join it."""
        if self._stop:
            return
        self._stop = True
        if not self._thread.is_alive():
            return
        try:
            client = _connect(self._host, self._port, self._store_key)
            n = client.add(notice_key(self._namespace), 1)
            client.set(notice_wake_key(self._namespace, n), b"")
        except (dist.DistError, RuntimeError):
            return  # the store is gone: so is the thread's connection, it returns by itself
        self._thread.join(JOIN_S)


class Notices:
    def __init__(self) -> None:
        self._where: tuple[str, int, str, str] | None = None
        self._client: dist.Store | None = None
        self._waiter: _Waiter | None = None
        self._seen: int | None = None
        self.broken = False
        self._at_exit = False

    def follow(self, cfg: WorkerConfig) -> None:
        """Follow the counter of the store ``cfg`` names (a new registration may name a new
        one)."""
        where = (cfg.store_host, cfg.store_port, cfg.store_namespace, cfg.store_key)
        if where != self._where:
            self.close()
            self._where, self._client, self._seen, self.broken = where, None, None, False

    def mark(self) -> None:
        """Remember the counter now (one store round trip), before fetching an answer."""
        self._seen = self._read()

    def changed(self) -> bool:
        """True if the coordinator published a change since ``mark`` or the last True, as
        far as the waiting thread has seen (no network)."""
        if self.broken or self._where is None:
            return False
        if self._waiter is None:
            self._start()
            return False
        if self._waiter.failed:
            self.broken = True
            return False
        n = self._waiter.latest
        if n is None or (self._seen is not None and n <= self._seen):
            return False
        self._seen = n
        return True

    def wait(self, timeout_s: float) -> bool:
        """Block until the counter moved past the last ``mark`` (or the last True of
        ``changed``), or for ``timeout_s``; False at once when there is no counter to follow
        (no store named, or it is gone): the caller then polls for what it waits for.

        A standby waits here between its fetches of the answer: its admission (a new
        generation), a stop and the job's end all move the counter, so it learns of them
        as soon as rank 0 would, without polling the store (a 2 ms poll and an answer every
        50 ms cost ~10% of a core beside the members' training on two cores)."""
        if self.broken or self._where is None:
            return False
        if self._waiter is None:
            self._start()
        waiter, seen = self._waiter, self._seen
        with waiter.moved:
            waiter.moved.wait_for(
                lambda: (
                    waiter.failed
                    or (waiter.latest is not None and (seen is None or waiter.latest > seen))
                ),
                timeout_s,
            )
        if waiter.failed:
            self.broken = True
        return True

    def close(self) -> None:
        """Stop the waiting thread, if any (also run at exit)."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.close()

    def _start(self) -> None:
        assert self._where is not None
        if not self._at_exit:  # before the interpreter finalises: see the module's doc
            atexit.register(self.close)
            self._at_exit = True
        self._waiter = _Waiter(*self._where)

    def _read(self) -> int | None:
        if self.broken or self._where is None:
            return None
        host, port, namespace, store_key = self._where
        try:
            if self._client is None:
                self._client = _connect(host, port, store_key)
            return self._client.add(notice_key(namespace), 0)
        except (dist.DistError, RuntimeError):
            self._client, self.broken = None, True
            return None
