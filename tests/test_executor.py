"""The coordinator's one door to the world (``coordinator.executor``): its decisions come out
as action values, carried out in the order they were made, and no other code of the
coordinator holds the backend, the rendezvous store or the records.

A real coordinator in this process (a real ``TCPStore``, real SQLite) with worker records
and no worker processes: the backend's ``signal`` and ``poll`` are replaced so that the test
plays the processes."""

from __future__ import annotations

import ast
import signal
import time
from pathlib import Path

import pytest

from tidal.backends import Exit
from tidal.backends.local import LocalBackend
from tidal.config import JobSpec
from tidal.coordinator.actions import (
    OpenGeneration,
    RecordEvent,
    RecordGeneration,
    SignalWorker,
)
from tidal.coordinator.control.controller import Coordinator
from tidal.coordinator.records.records import WorkerRecord
from tidal.protocol import WorkerState
from tidal.store_keys import GEN_ABANDONED, GEN_OPEN, state_key

COORDINATOR = Path(__file__).resolve().parents[1] / "tidal" / "coordinator"
# What may hold the world: the executor, and the journal and database it writes through.
DOORS = {"executor.py", "journal.py", "db.py"}
WORLD = {"backend", "store", "journal", "db"}


def test_only_the_executor_holds_the_backend_the_store_and_the_records() -> None:
    """``self.backend``, ``self.store``, ``self.journal`` or ``self.db`` anywhere in the
    coordinator's other modules would be a side effect past the executor."""
    offenders = []
    for path in sorted(COORDINATOR.glob("*.py")):
        if path.name in DOORS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in WORLD
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                offenders.append(f"{path.name}:{node.lineno}: self.{node.attr}")
    assert not offenders, offenders


@pytest.fixture
def coord(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    sent: list[tuple[int, int]] = []
    exits: list[Exit] = []

    def no_start(*_args, **_kwargs):
        raise AssertionError("the test's coordinator must not start a worker process")

    monkeypatch.setattr(LocalBackend, "start", no_start)
    monkeypatch.setattr(LocalBackend, "signal", lambda self, wid, sig: sent.append((wid, sig)))
    monkeypatch.setattr(LocalBackend, "poll", lambda self: [exits.pop()] if exits else [])
    spec = JobSpec(
        name="door",
        script=str(tmp_path / "x.py"),
        workers=2,
        max_workers=3,
        max_restarts=0,  # a lost member is not replaced: the job goes on with one
        heartbeat_timeout_s=5.0,
    )
    c = Coordinator(spec, tmp_path / "home")
    c.sent, c.exits = sent, exits
    with c.lock:
        for wid in (0, 1):
            c.job.workers[wid] = WorkerRecord(
                id=wid, state=WorkerState.STANDBY, pid=1, host="h", last_heartbeat=time.time()
            )
        c.generations.open([0, 1], "two members")
    try:
        yield c
    finally:
        c.close()


def test_a_hung_member_is_killed_and_the_generation_reopened_through_the_executor(
    coord: Coordinator,
) -> None:
    first = coord.job.latest
    store = coord.executor.store
    assert store.get(state_key(first.store_prefix)) == GEN_OPEN
    coord.executor.recent.clear()
    with coord.lock:  # worker 1 fell silent 60 s ago: beyond the 5 s heartbeat timeout
        coord.job.workers[1].last_heartbeat = time.time() - 60
    coord.tick()
    kills = [a for a in coord.executor.recent if isinstance(a, SignalWorker)]
    assert kills == [SignalWorker(worker_id=1, signum=signal.SIGKILL, why=kills[0].why)]
    assert "heartbeat" in kills[0].why
    assert coord.sent == [(1, signal.SIGKILL)]  # carried out, once
    assert coord.job.latest is first  # nothing re-forms before its exit is seen

    coord.executor.recent.clear()
    coord.exits.append(Exit(worker_id=1, returncode=-9))
    coord.tick()
    second = coord.job.latest
    assert second.id == first.id + 1 and second.members == [0]
    kinds = [type(a) for a in coord.executor.recent if not isinstance(a, RecordEvent)]
    opened = kinds.index(OpenGeneration)
    # The store's key is set before the generation is recorded and before anyone is told.
    assert kinds.index(RecordGeneration) > opened
    assert (
        OpenGeneration(prefix=second.store_prefix, previous=first.store_prefix)
        in coord.executor.recent
    )
    assert store.get(state_key(second.store_prefix)) == GEN_OPEN
    assert store.get(state_key(first.store_prefix)) == GEN_ABANDONED  # its formers give up


def test_the_executor_refuses_what_is_not_an_action(coord: Coordinator) -> None:
    with pytest.raises(TypeError, match="not an action"):
        coord.executor.do(("signal", 1, 9))


def test_a_coordinator_that_crashes_leaves_its_workers_to_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close(kill_workers=False)`` (the coordinator raised: its supervisor restarts it)
    signals nobody and lets the backend go (``Backend.leave``); the job's end kills what is
    left."""
    sent: list[tuple[int, int]] = []
    left: list[bool] = []
    monkeypatch.setattr(LocalBackend, "signal", lambda self, wid, sig: sent.append((wid, sig)))
    monkeypatch.setattr(LocalBackend, "alive", lambda self: [0, 1])
    monkeypatch.setattr(LocalBackend, "leave", lambda self: left.append(True))
    spec = JobSpec(name="crash", script=str(tmp_path / "x.py"), workers=2, max_workers=2)
    Coordinator(spec, tmp_path / "a").close(kill_workers=False)
    assert sent == [] and left == [True]
    Coordinator(spec, tmp_path / "b").close()
    assert sent == [(0, signal.SIGKILL), (1, signal.SIGKILL)] and left == [True]


def test_the_notice_counter_moves_by_set_and_survives_a_forged_value() -> None:
    """A real ``TCPStore`` as the coordinator hosts it: ``Notify`` moves the unsealed counter
    and sets the count's wake key; a value an outsider wrote that is no count is overwritten
    (the store's ``add`` on it closed the coordinator's connection: it crashed); a count a
    member's ``close`` moved is gone past; and members still read it with ``add(key, 0)``."""
    import datetime

    import torch.distributed as dist

    from tidal.coordinator.actions import Notify
    from tidal.coordinator.executor import Executor
    from tidal.store_auth import AuthStore, derive_key
    from tidal.store_keys import notice_key, notice_wake_key

    timeout = datetime.timedelta(seconds=5)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    store = AuthStore(server, derive_key("t" * 32))
    outsider = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
    ex = Executor(backend=None, store=store, namespace="ns", journal=None)
    key = notice_key("ns")

    ex.do(Notify())
    ex.do(Notify())
    assert outsider.add(key, 0) == 2 and outsider.check([notice_wake_key("ns", 2)])
    outsider.set(key, b"\x7f not a count")
    ex.do(Notify())  # no error: the counter is set past this executor's own count
    assert outsider.add(key, 0) == 3 and outsider.check([notice_wake_key("ns", 3)])
    outsider.add(key, 4)  # a member's close (and then some)
    ex.do(Notify())
    assert outsider.add(key, 0) == 8 and outsider.check([notice_wake_key("ns", 8)])
