"""Cutting a gloo collective the worker waits on (``waits``, ``conns``, ``group``).

The race these guard against (a survivor blocked 120 s in "waiting for send operation" after
a peer's SIGKILL, docs/reliability.md) cannot be produced on demand; what the fix relies on
can: a tracked wait is released by ``abort`` whatever the collective does, a cut connection
fails the operations blocked on it at both ends, and a parked group neither blocks its
member's exit nor is freed under a blocked collective."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from tests.ranks import run_ranks
from tidal.worker.membership.conns import Conns, open_sockets
from tidal.worker.waits import Aborted, Waits


def test_a_tracked_future_passes_the_collectives_result_through() -> None:
    waits, fut = Waits(), torch.futures.Future()
    mine = waits.track(fut)
    assert not mine.done()
    fut.set_result([torch.tensor([3.0])])
    assert mine.wait().tolist() == [3.0]


def test_a_tracked_future_passes_the_collectives_error_through() -> None:
    waits, fut = Waits(), torch.futures.Future()
    mine = waits.track(fut)
    fut.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="closed by peer"):
        mine.wait()


def test_abort_fails_pending_waits_and_a_late_result_is_ignored() -> None:
    waits, fut = Waits(), torch.futures.Future()
    mine = waits.track(fut)
    waits.abort("gave up on step 7")
    assert waits.aborted
    with pytest.raises(Aborted, match="step 7"):
        mine.wait()
    fut.set_result([torch.tensor([1.0])])  # the collective completes after all: no effect
    with pytest.raises(Aborted):
        mine.wait()


def test_abort_is_sticky_until_reset() -> None:
    waits = Waits()
    waits.abort("broken group")
    late = waits.track(torch.futures.Future())
    assert late.done()
    with pytest.raises(Aborted, match="broken group"):
        late.wait()
    waits.reset()
    assert not waits.aborted
    fut = torch.futures.Future()
    fresh = waits.track(fut)
    fut.set_result([torch.tensor([2.0])])
    assert fresh.wait().tolist() == [2.0]


class _Work:
    """A point-to-point work as gloo gives it: ``wait`` only (no future)."""

    def __init__(self, gate: threading.Event, error: Exception | None = None) -> None:
        self._gate, self._error = gate, error

    def wait(self) -> bool:
        self._gate.wait()
        if self._error is not None:
            raise self._error
        return True


def test_wait_all_returns_when_every_work_is_done() -> None:
    gate = threading.Event()
    gate.set()
    Waits().wait_all([_Work(gate), _Work(gate)])


def test_wait_all_raises_the_first_failure() -> None:
    gate = threading.Event()
    gate.set()
    with pytest.raises(RuntimeError, match="peer gone"):
        Waits().wait_all([_Work(gate), _Work(gate, RuntimeError("peer gone"))])


def test_wait_all_is_released_by_abort_while_a_work_never_finishes() -> None:
    waits, never = Waits(), threading.Event()
    threading.Timer(0.2, waits.abort, args=("watch gave up",)).start()
    t = time.monotonic()
    with pytest.raises(Aborted, match="watch gave up"):
        waits.wait_all([_Work(never)])
    assert time.monotonic() - t < 10  # 0.2 s; unreleased it never returns


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return listener, client, server


def test_conns_captures_only_the_connected_tcp_sockets_opened_since() -> None:
    before = open_sockets()
    listener, client, server = _pair()
    unix_a, unix_b = socket.socketpair()
    excluded_listener, excluded_client, excluded_server = _pair()
    excluded_port = excluded_listener.getsockname()[1]
    try:
        # New since ``before``: the listener (not connected), client and server (TCP), a
        # unix pair, and a pair to an excluded port (the client's peer is that port; the
        # accepted end's peer is the client's ephemeral port, so exclude that too).
        exclude = (excluded_port, excluded_client.getsockname()[1])
        conns = Conns.opened_since(before, expected=2, exclude=exclude)
        assert len(conns) == 2
        conns.cut()
        assert server.recv(1) == b""  # the client end was shut down: EOF at once
        assert client.recv(1) == b""
        conns.close()
        assert len(conns) == 0
    finally:
        for s in (listener, client, server, unix_a, unix_b):
            s.close()
        for s in (excluded_listener, excluded_client, excluded_server):
            s.close()


def test_conns_captures_nothing_when_the_count_is_not_one_per_peer() -> None:
    before = open_sockets()
    listener, client, server = _pair()
    try:
        conns = Conns.opened_since(before, expected=1)  # two were opened: ambiguous
        assert len(conns) == 0
        conns.cut()  # does nothing: the connection still carries data
        client.sendall(b"x")
        assert server.recv(1) == b"x"
    finally:
        for s in (listener, client, server):
            s.close()


CUT_A_BLOCKED_ALLREDUCE = r"""
import json, sys, time, datetime, threading, torch, torch.distributed as dist
from tidal.worker.membership import group as grp
from tidal.worker.waits import Aborted, Waits
from tidal.protocol import GenerationInfo
from tidal.store_keys import generation_prefix
rank, port = int(sys.argv[1]), int(sys.argv[2])
# Rank 2 hosts the store, as the coordinator does for workers (a member hosting it would
# see its peers' store connections open while the group forms: nothing would be captured).
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 2, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
if rank == 2:
    store.wait(["done"], datetime.timedelta(seconds=90)); store.wait(["parked"])
    print(json.dumps({}), flush=True); sys.exit(0)
info = GenerationInfo(id=1, members=[0, 1], store_prefix=generation_prefix("ns", 1), reason="")
grp.form_group(store, info, rank, namespace="ns", timeout_s=60, connect_s=1)
out = {"connections": grp.connections()}
x = torch.ones(2); dist.all_reduce(x); out["sum"] = x.tolist()
waits = Waits()
if rank == 0:  # rank 1 never joins this all-reduce: the watch gives up after 0.5 s
    cut = threading.Event()
    def give_up():
        waits.abort("the watch gave up"); grp.cut_group(); cut.set()
    threading.Timer(0.5, give_up).start()
    t = time.monotonic()
    try:
        waits.track(dist.all_reduce(torch.ones(2), async_op=True).get_future()).wait()
        out["returned"] = True
    except Aborted:
        out["released_after_s"] = time.monotonic() - t
    # The abort releases this thread before the watch's thread has cut: rank 1 is told only
    # once the cut is done (told earlier, its all-reduce could pair with the one still
    # pending here in gloo, and then wait for rank 1's own watch: none in this test).
    cut.wait(10)
    store.set("cut", "1")
    t = time.monotonic()
    grp.destroy_group(failed=True, park=True)
    out["destroy_s"] = time.monotonic() - t
    store.wait(["done"], datetime.timedelta(seconds=60))
    store.set("parked", "1")
else:  # after the cut, this member's next collective on the group fails
    store.wait(["cut"])
    # Bounded as every collective of a member is (its own abort watch): the cut fails it
    # at once as a rule, but once in CI it blocked past the store's 30 s (it can pair with
    # rank 0's chunk still queued in this gloo before the end of the connection is read),
    # and then only the watch releases it. Either way it never returns.
    watch = threading.Timer(15, waits.abort, args=("rank 1's watch gave up",))
    watch.start()
    t = time.monotonic()
    try:
        waits.track(dist.all_reduce(torch.ones(2), async_op=True).get_future()).wait()
        out["returned"] = True
    except Aborted:
        out["failed_after_s"], out["released_by"] = time.monotonic() - t, "watch"
    except Exception:
        out["failed_after_s"], out["released_by"] = time.monotonic() - t, "cut"
    watch.cancel()
    grp.destroy_group(failed=True, park=out.get("released_by") == "watch")
    store.set("done", "1")
print(json.dumps(out), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_blocked_gloo_allreduce_is_released_cut_and_parked() -> None:
    """Real gloo on 127.0.0.1: the group's one connection per peer is captured; rank 0's
    wait on an all-reduce rank 1 never joins is released by the abort within seconds (the
    collective timeout is 60 s); rank 1's next collective fails (at once by the cut, or by
    its own watch where it paired with rank 0's queued chunk first); and rank 0 parks its
    group (destroy returns at once) and its process still exits promptly."""
    t = time.monotonic()
    first, second, _ = run_ranks(CUT_A_BLOCKED_ALLREDUCE, 3, timeout=100)
    elapsed = time.monotonic() - t
    assert first["connections"] == second["connections"] == 1, (first, second)
    assert first["sum"] == second["sum"] == [2.0, 2.0]
    assert "returned" not in first and first["released_after_s"] < 10, first
    assert first["destroy_s"] < 5, first
    assert "returned" not in second and second["failed_after_s"] < 20, second
    assert elapsed < 50, elapsed  # a parked group waited out (60 s) would exceed this
