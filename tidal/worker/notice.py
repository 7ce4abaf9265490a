"""Rank 0's look, once a step, at the coordinator's change counter in the store.

Members learn of a new generation, a stop or the job's end from the coordinator's answer
(``Agent.latest``), and switch together through the control word, which needs only one
member to know. Waiting for the next heartbeat put up to its interval between the change
and the switch, so heartbeats ran at 10 a second per worker, ~2% of a core each on cores
the training fills. Instead the coordinator adds 1 to ``protocol.notice_key`` with every
such change (after publishing the answer), and rank 0 reads the counter before each step's
all-reduce (one store round trip, ~25 us): when it moved, rank 0 fetches the answer at
once. Heartbeats now carry only liveness and telemetry, once a second.

Contract: ``mark`` before fetching an answer, so that a change made after that answer is
news to ``changed``. The counter lives in the coordinator's store: when the store is gone
(the coordinator died; its successor serves a new one) the notices stop until ``follow``
names the new store, and members learn of changes from heartbeats meanwhile. The client has
its own short timeout: a hung coordinator stalls a step at most ``TIMEOUT_S`` once.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from tidal.protocol import WorkerConfig, notice_key

TIMEOUT_S = 2.0


class Notices:
    def __init__(self) -> None:
        self._where: tuple[str, int, str] | None = None
        self._client: dist.Store | None = None
        self._seen: int | None = None
        self.broken = False

    def follow(self, cfg: WorkerConfig) -> None:
        """Read the counter of the store ``cfg`` names (a new registration may name a new
        one)."""
        where = (cfg.store_host, cfg.store_port, cfg.store_namespace)
        if where != self._where:
            self._where, self._client, self._seen, self.broken = where, None, None, False

    def mark(self) -> None:
        """Remember the counter now, before fetching an answer."""
        self._seen = self._read()

    def changed(self) -> bool:
        """True if the coordinator published a change since ``mark`` or the last True."""
        n = self._read()
        if n is None or n == self._seen:
            return False
        self._seen = n
        return True

    def _read(self) -> int | None:
        if self.broken or self._where is None:
            return None
        host, port, namespace = self._where
        try:
            if self._client is None:
                timeout = datetime.timedelta(seconds=TIMEOUT_S)
                self._client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
            return self._client.add(notice_key(namespace), 0)
        except (dist.DistError, RuntimeError):
            self._client, self.broken = None, True
            return None
