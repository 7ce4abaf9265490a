"""The coordinator's one executor: the only code that touches the world.

``Executor.do`` carries out one action (``actions``) on the backend (worker processes), the
rendezvous store or the job's records (the ``Journal``: SQLite and its copy in memory), and
keeps the newest ``RECENT`` actions it did in ``recent`` for whoever reads what a pass did
(tests, a debugging session). The rest of the coordinator decides and changes its job in
memory (``job.Job``); what it reads of the world (exits, placement, the records' copy) it
reads here too, so nothing else holds the backend, the store or the database.

Contract: ``do`` runs under the coordinator's lock, in the order the decisions were made,
and at once: a pass that opens a generation and then answers a heartbeat has the store's
key set before the answer tells a member (workers look the key up when told). A write to a
broken database does not raise here: the journal marks the database ``broken`` and the
host stops the job (``host.runner``), the copy in memory still changing.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from typing import TYPE_CHECKING

from tidal.checkpoint import fence, location
from tidal.coordinator.actions import (
    AbandonGeneration,
    Action,
    AdoptWorker,
    DropCheckpoint,
    FenceCheckpoints,
    KillEveryWorker,
    Notify,
    OpenGeneration,
    RecordCheckpoint,
    RecordCheckpointFailure,
    RecordControl,
    RecordEvent,
    RecordGeneration,
    RecordJob,
    RecordWorkers,
    SignalWorker,
    StartWorker,
)
from tidal.protocol import EventView
from tidal.store_auth import ForgedValue
from tidal.store_keys import (
    GEN_ABANDONED,
    GEN_OPEN,
    notice_key,
    notice_wake_key,
    settled_key,
    state_key,
)

if TYPE_CHECKING:
    import torch.distributed as dist

    from tidal.backends import Backend, Exit
    from tidal.backends.host_registry import HostRegistry
    from tidal.backends.zygote import Zygote
    from tidal.coordinator.records.db import Database
    from tidal.coordinator.records.journal import Journal
    from tidal.coordinator.records.snapshot import Records
    from tidal.protocol import CheckpointView, JobStatus

RECENT = 256


class Executor:
    """Carries out actions for one job's coordinator: ``backend`` its worker processes,
    ``store`` its rendezvous store (keys under ``namespace``; an ``AuthStore``, so every value
    it writes is authenticated), ``journal`` its records."""

    def __init__(
        self,
        *,
        backend: Backend,
        store: dist.Store,
        namespace: str,
        journal: Journal,
    ) -> None:
        self.backend = backend
        self.store = store
        self.namespace = namespace
        self.journal = journal
        self._notices = 0  # the notice counter's last count this executor set
        self.recent: deque[Action] = deque(maxlen=RECENT)

    @property
    def db(self) -> Database:
        return self.journal.db

    # -- doing ------------------------------------------------------------------------------
    def do(self, action: Action) -> object:
        """Carry out ``action``; returns what it yields (a pid, an adoption's verdict) or
        None."""
        self.recent.append(action)
        match action:
            case StartWorker(worker_id=wid, env=env):
                return self.backend.start(wid, env)
            case SignalWorker(worker_id=wid, signum=sig):
                self.backend.signal(wid, sig)
            case AdoptWorker(worker_id=wid, pid=pid, env=env):
                return self.backend.adopt(wid, pid, env)
            case KillEveryWorker():
                for wid in self.backend.alive():
                    self.backend.signal(wid, signal.SIGKILL)
            case OpenGeneration(prefix=prefix, previous=previous):
                self.store.set(state_key(prefix), GEN_OPEN)
                if previous is not None:
                    self._abandon(previous)
            case AbandonGeneration(prefix=prefix):
                self._abandon(prefix)
            case Notify():
                count = self._next_notice()
                self.store.set(notice_wake_key(self.namespace, count), b"")
            case RecordEvent(event=e):
                self.journal.add_event(e)
            case RecordJob(values=values):
                self.journal.update_job(**values)
            case RecordWorkers(rows=rows):
                self.journal.save_workers(list(rows))
            case RecordGeneration(generation=g):
                self.journal.save_generation(g)
            case RecordControl(control=c):
                self.journal.save_control(c)
            case RecordCheckpoint(checkpoint=c):
                self.journal.add_checkpoint(c)
            case DropCheckpoint(step=step):
                self.journal.drop_checkpoint(step)
            case RecordCheckpointFailure(error=error):
                self.journal.add_checkpoint_failure(error)
            case FenceCheckpoints(directory=directory, epoch=epoch, sealed=sealed, spec=spec):
                try:  # returns why it could not be written (the job goes on), or None
                    where = location.of(directory)
                    if spec is not None:
                        fence.write_spec(where, spec)
                    fence.write(where, fence.Fence(epoch=epoch, sealed=sealed))
                except OSError as exc:
                    return f"{exc.strerror or exc}: {exc.filename or directory}"
            case _:
                raise TypeError(f"not an action: {action!r}")
        return None

    def _next_notice(self) -> int:
        """Move the notice counter to its next count with ``set``, never ``add``, and return
        it. The counter is not authenticated (a count only wakes rank 0 to ask the
        authenticated API, ``worker.notice``), so anyone who reaches the store can write any
        value into it, and the store's ``add`` on a value that is no integer closes the
        asking client's connection: a forger crashed the coordinator this way (the racing
        forger of ``tests/test_forged_store.py``). The count goes past what the key holds (a
        member's ``close`` adds 1 too) and past this executor's own last count."""
        key = notice_key(self.namespace)
        plain = getattr(self.store, "inner", self.store)  # the counter is stored unsealed
        held = 0
        if plain.check([key]):
            try:
                held = int(plain.get(key))
            except ValueError:  # not a count: written by an outsider, and overwritten now
                held = 0
        self._notices = max(self._notices, held) + 1
        plain.set(key, str(self._notices))
        return self._notices

    def _abandon(self, prefix: str) -> None:
        """Abandon generation ``prefix`` unless it formed, and wake its waiting members
        (``store_keys.settled_key``). A state the coordinator's key does not authenticate
        (``store_auth.ForgedValue``: an outsider overwrote it) is replaced by ``abandoned``,
        with a security event naming the key: a newer generation is open by then, so no
        member of this one may form it anyway."""
        key = state_key(prefix)
        try:
            self.store.compare_set(key, GEN_OPEN, GEN_ABANDONED)
        except ForgedValue as exc:
            self.store.set(key, GEN_ABANDONED)
            event = EventView(time=time.time(), kind="security", message=f"coordinator: {exc}")
            self.do(RecordEvent(event=event))
        self.store.set(settled_key(prefix), b"")

    def prepare(self, zygote: Zygote | None) -> None:
        """Get the backend ready to start workers fast (``Backend.prepare``)."""
        self.backend.prepare(zygote)

    def wait_ready(self) -> bool:
        return self.backend.wait_ready()

    def close(self, *, kill_workers: bool = True) -> None:
        """Release the backend and the database; ``kill_workers``: kill what is left first
        (the job ended), else leave the workers to a successor (``Backend.leave``)."""
        if kill_workers:
            self.do(KillEveryWorker(why="the coordinator closes"))
            self.backend.close()
        else:
            self.backend.leave()
        self.journal.db.close()

    # -- reading the world ------------------------------------------------------------------
    def poll(self) -> list[Exit]:
        """Worker exits since the last poll."""
        return self.backend.poll()

    def alive(self) -> list[int]:
        return self.backend.alive()

    def waiting(self) -> set[int]:
        """Workers asked for but not placed yet."""
        return self.backend.waiting()

    def node(self, worker_id: int) -> str | None:
        return self.backend.node(worker_id)

    def wake_fds(self) -> list[int]:
        """Descriptors that become readable when a worker exits (the loop waits on them)."""
        return self.backend.wake_fds()

    def describe_exit(self, worker_id: int) -> str:
        return self.backend.describe_exit(worker_id)

    def news(self) -> list[str]:
        """The backend's lines for the job's events (a host joined, left, was lost)."""
        return self.backend.news()

    @property
    def hosts(self) -> HostRegistry | None:
        """What joined hosts' agents call (``Backend.hosts``); None unless the backend takes
        hosts. Its own lock guards it: the API's threads call it without the coordinator's."""
        return self.backend.hosts

    @property
    def max_starting(self) -> int:
        """How many workers the backend brings up at once."""
        return self.backend.max_starting

    @property
    def store_port(self) -> int:
        return self.store.port

    @property
    def records(self) -> Records:
        """The journal's copy of what SQLite holds."""
        return self.journal.records

    def saved_control(self) -> dict | None:
        """The restart record a previous coordinator of the job wrote, if any."""
        return self.journal.db.load_control(self.journal.name)

    def saved_step_metrics(self, worker_id: int) -> tuple[int, int] | None:
        """The worker's newest per-step record the job's rows hold (``db.UPSERT_SAVED``)."""
        return self.journal.db.saved_step_metrics(self.journal.name, worker_id)

    def status(self) -> JobStatus:
        return self.journal.status()

    def checkpoints(self) -> list[CheckpointView]:
        return self.journal.checkpoints()
