"""Plain hosts' decisions as tables, in milliseconds: where a worker goes among the joined
hosts (``placement.place``: spread), which members a scale-down removes
(``reconcile.leavers``: the most loaded host first), when a host is lost
(``placement.lost_hosts``), what ``--listen`` accepts, which credential a host's call needs
(``admission.admit``), and the coordinator's registry of hosts (``HostRegistry``: orders,
exits once, losses, adoption) driven directly, without a server or a process.
The agents and the server are in ``tests/test_hosts_agent.py``; three machines in network
namespaces in ``tests/test_hosts_netns.py``."""

from __future__ import annotations

import os
import select
import signal
import time

import pytest

from tidal.backends.host_registry import LOCAL, HostRegistry, UnknownHost
from tidal.backends.placement import Heard, Room, lost_hosts, place
from tidal.config import JobSpec, parse_listen
from tidal.host.admission import HOST_BODY_LIMIT, admit
from tidal.hosts_protocol import (
    HOSTS_PATH,
    HostExit,
    HostPoll,
    HostRegister,
    HostWorker,
    host_token,
)
from tidal.policy.reconcile import Pool, leavers, reconcile
from tidal.protocol import worker_token


# -- placement -------------------------------------------------------------------------------
def rooms(*hosts: tuple[int, int, int]) -> list[Room]:
    return [Room(host_id=h, slots=s, used=u) for h, s, u in hosts]


@pytest.mark.parametrize(
    "hosts, chosen",
    [
        ([], None),  # no host joined yet: the worker waits
        (rooms((1, 2, 2)), None),  # every slot taken
        (rooms((1, 2, 0)), 1),
        (rooms((1, 2, 1), (2, 2, 0)), 2),  # the emptier host: spread
        (rooms((1, 2, 1), (2, 2, 1)), 1),  # as loaded, as free: the first to join
        (rooms((1, 2, 1), (2, 8, 1)), 2),  # as loaded: the one with more room
        (rooms((1, 8, 3), (2, 2, 2)), 1),  # the emptier one is full
        (rooms((0, 1, 0), (1, 4, 0)), 1),  # the local host is a host like any: more room
        ([Room(host_id=1, slots=4, used=0, leaving=True)], None),  # leaving: no more workers
    ],
)
def test_a_worker_goes_to_the_least_loaded_host_with_room(hosts, chosen):
    assert place(hosts) == chosen


@pytest.mark.parametrize(
    "members, nodes, count, removed",
    [
        ([1, 2, 3], {}, 1, [3]),  # one node (a local job): the last ranks, as always
        ([1, 2, 3, 4], {m: "a" for m in (1, 2, 3, 4)}, 2, [3, 4]),
        ([1, 2, 3], {1: "b", 2: "b", 3: "c"}, 1, [2]),  # from the host holding two
        ([1, 2, 3], {1: "b", 2: "c", 3: "b"}, 1, [3]),
        ([1, 2, 3, 4], {1: "b", 2: "c", 3: "c", 4: "b"}, 2, [3, 4]),  # as loaded: high ranks
        ([1, 2, 3, 4, 5], {1: "b", 2: "b", 3: "b", 4: "c", 5: "d"}, 2, [2, 3]),
        ([1, 2], {1: "b", 2: "c"}, 0, []),
        ([1, 2], {1: "b", 2: "c"}, 5, [1, 2]),
    ],
)
def test_a_scale_down_takes_from_the_most_loaded_host(members, nodes, count, removed):
    assert leavers(members, nodes, count) == removed


def test_reconcile_keeps_a_spread_membership_and_its_rank_order():
    pool = Pool(members=[1, 2, 3], standby=[], starting=[], target=2)
    spread = reconcile(Pool(**{**vars(pool), "nodes": {1: "b", 2: "b", 3: "c"}}))
    assert spread.members == [1, 3] and spread.retire == [2]
    assert "worker 2 left" in spread.reason
    assert reconcile(pool).members == [1, 2]  # nodes unknown: the last rank leaves


@pytest.mark.parametrize(
    "heard, lost",
    [
        ([Heard(host_id=1, silent_s=0.5)], []),
        ([Heard(host_id=1, silent_s=10.0)], [1]),  # silent: a cut network, a dead machine
        ([Heard(host_id=1, silent_s=0.5, cut_s=0.5)], []),  # a broken connection: it may call
        ([Heard(host_id=1, silent_s=1.2, cut_s=1.0)], [1]),  # killed: its socket was closed
        ([Heard(host_id=1, silent_s=9.0), Heard(host_id=2, silent_s=11.0)], [2]),
    ],
)
def test_a_host_is_lost_when_silent_or_cut_off(heard, lost):
    verdicts = lost_hosts(heard, timeout_s=10.0, cut_grace_s=1.0)
    assert [h for h, _ in verdicts] == lost
    assert all(why for _, why in verdicts)


# -- settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, parsed",
    [("10.0.0.5:7000", ("10.0.0.5", 7000)), ("[::1]:0", ("::1", 0)), ("node-a:80", ("node-a", 80))],
)
def test_listen_takes_host_and_port(text, parsed):
    assert parse_listen(text) == parsed


@pytest.mark.parametrize(
    "text, says",
    [
        ("10.0.0.5", "takes HOST:PORT"),
        (":7000", "takes HOST:PORT"),
        ("10.0.0.5:99999", "takes HOST:PORT"),
        ("0.0.0.0:7000", "not 0.0.0.0"),
        ("[::]:7000", "not ::"),
    ],
)
def test_listen_refuses_what_workers_cannot_call(text, says):
    with pytest.raises(ValueError, match=says):
        parse_listen(text)


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(listen="10.0.0.5:7000"), "not the local backend"),
        (dict(backend="hosts"), "needs --listen"),
        (dict(local_slots=2), "goes with --listen"),
        (dict(backend="hosts", listen="10.0.0.5:7000", local_slots=-1), "at least 0"),
    ],
)
def test_hosts_settings_are_refused_with_the_fix(kw, says):
    with pytest.raises(ValueError, match=says):
        JobSpec(name="j", script="/x.py", **kw)


def test_a_hosts_spec_round_trips():
    spec = JobSpec(name="j", script="/x.py", backend="hosts", listen="10.0.0.5:0", local_slots=1)
    assert JobSpec.from_dict(spec.to_dict()) == spec


# -- credentials ------------------------------------------------------------------------------
TOKEN = "t0ken"


@pytest.mark.parametrize(
    "authorization, status",
    [
        (f"Bearer {host_token(TOKEN)}", None),
        (None, 401),
        (f"Bearer {TOKEN}", 401),  # the job's token is not the hosts' (least privilege)
        (f"Bearer {worker_token(TOKEN, 0)}", 401),
    ],
)
def test_a_host_call_needs_the_hosts_token(authorization, status):
    for path in (HOSTS_PATH + "/register", HOSTS_PATH + "/3/poll"):
        verdict = admit(
            "POST",
            path,
            authorization=authorization,
            host=None,
            content_length="100",
            token=TOKEN,
            guarded=True,
            allowed_hosts=set(),
        )
        assert verdict.status == status, (path, verdict)
        if status is None:
            assert verdict.body_limit == HOST_BODY_LIMIT


def test_the_hosts_token_is_none_of_the_others():
    assert host_token(TOKEN) not in (TOKEN, worker_token(TOKEN, 0), host_token("other"))


# -- the registry -----------------------------------------------------------------------------
def registry(**kw) -> HostRegistry:
    return HostRegistry(
        job="j", command=["/x.py"], cwd="/", lost_after_s=10.0, orphan_timeout_s=600.0, **kw
    )


def join(reg: HostRegistry, slots: int = 2, **kw) -> int:
    req = HostRegister(name="box", address="10.0.0.2", slots=slots, pid=100, **kw)
    return reg.register(req).host_id


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_workers_wait_for_a_host_and_are_spread_when_hosts_join():
    reg = registry()
    assert reg.request(0, {"ID": "0"}) is None and reg.waiting() == {0}
    a = join(reg)
    assert readable(reg.wake_fd)  # the loop wakes to place the waiting worker
    assert reg.place_waiting() == [(0, a, {"ID": "0"})] and reg.waiting() == set()
    b = join(reg)
    assert reg.request(1, {}) == b  # the emptier host
    assert reg.request(2, {}) == a and reg.request(3, {}) == b
    assert reg.request(4, {}) is None  # both full: it waits
    assert [o.worker_id for o in reg.orders(a).workers] == [0, 2]
    assert reg.node(0) == "box (10.0.0.2)" and sorted(reg.placed()) == [0, 1, 2, 3]
    news = reg.take_news()
    assert news[0].startswith(f"host {a} joined: box (10.0.0.2), 2 slots") and len(news) == 2


def test_an_exit_is_reported_once_and_frees_its_slot():
    reg = registry()
    a = join(reg, slots=1)
    reg.request(0, {})
    reg.request(1, {})  # waits for the slot
    version = reg.orders(a).version
    gone = HostExit(worker_id=0, returncode=-9, last_line="Killed")
    for _ in range(2):  # sent again: its first answer was lost
        reg.poll(a, HostPoll(exits=[gone]))
    (ex,) = reg.take_exits()
    assert (ex.worker_id, ex.returncode, ex.known) == (0, -9, True)
    assert reg.last_line(0) == "Killed" and reg.orders(a).version > version
    assert reg.place_waiting() == [(1, a, {})]
    reg.poll(a, HostPoll(exits=[HostExit(worker_id=1, returncode=0)], running=[]))
    assert [e.worker_id for e in reg.take_exits()] == [1]


def test_signals_are_numbered_orders_forgotten_once_applied():
    reg = registry()
    a = join(reg)
    reg.request(0, {})
    assert reg.signal(0, signal.SIGTERM) and reg.signal(0, signal.SIGKILL)
    sigs = reg.orders(a).signals
    assert [(s.worker_id, s.signum) for s in sigs] == [(0, 15), (0, 9)]
    assert sigs[0].seq < sigs[1].seq
    assert [s.signum for s in reg.poll(a, HostPoll(signal_seq=sigs[0].seq)).signals] == [9]
    assert reg.poll(a, HostPoll(signal_seq=sigs[1].seq)).signals == []
    assert not reg.signal(7, signal.SIGTERM)  # no such worker


def test_a_waiting_worker_is_cancelled_by_a_stop_signal():
    reg = registry()
    reg.request(0, {})
    assert reg.signal(0, signal.SIGTERM) and reg.waiting() == set()
    (ex,) = reg.take_exits()
    assert ex.returncode == 0 and "cancelled" in ex.reason


def test_a_held_poll_is_answered_when_the_orders_change():
    reg = registry()
    a = join(reg)
    version = reg.orders(a).version
    assert reg.waiter(a, version - 1) is None  # news already: answer at once
    held = reg.waiter(a, version)
    assert held is not None and not held.done()
    reg.request(0, {})
    assert held.done() and reg.orders(a).version > version
    later = reg.waiter(a, reg.orders(a).version)
    reg.close()  # the server stops: nothing is left waiting
    assert later.done()


def test_a_silent_or_cut_off_host_is_lost_with_its_workers():
    reg = registry()
    a, b = join(reg), join(reg)
    reg.request(0, {})
    reg.request(1, {})
    reg.take_news()
    now = time.monotonic()
    reg.check(now)
    assert reg.take_exits() == []
    reg.cut(b)
    reg.check(now + 1.5)  # cut a second ago and silent since: its agent died
    (ex,) = reg.take_exits()
    assert ex.worker_id == 1 and ex.returncode == -9 and "lost with its host" in ex.reason
    assert "connection closed" in ex.reason
    with pytest.raises(UnknownHost):
        reg.poll(b, HostPoll())  # it joins again as a new host
    reg.check(now + 11.0)  # silent past the heartbeat timeout
    (ex,) = reg.take_exits()
    assert ex.worker_id == 0 and "no word from its agent" in ex.reason
    assert [n.split(":")[0] for n in reg.take_news()] == [
        f"host {b} (box (10.0.0.2)) lost",
        f"host {a} (box (10.0.0.2)) lost",
    ]


def test_a_restarted_coordinator_adopts_what_a_host_lists_and_loses_the_rest():
    reg = registry()
    reg.expect(3, 4242, wait_s=5.0)
    reg.expect(4, 4343, wait_s=5.0)
    reg.expect(5, 4444, wait_s=5.0)
    running = [HostWorker(worker_id=3, pid=4242), HostWorker(worker_id=9, pid=99)]
    ended = [HostExit(worker_id=5, returncode=0, last_line="done")]  # during the restart
    a = join(reg, running=running, exits=ended)
    assert [o.worker_id for o in reg.orders(a).workers] == [3]  # 9: unknown, its agent kills it
    assert "running workers [3] (adopted)" in reg.take_news()[0]
    assert [(e.worker_id, e.returncode) for e in reg.take_exits()] == [(5, 0)]  # its own end
    reg.check(time.monotonic() + 6.0)
    exits = reg.take_exits()
    assert [(e.worker_id, e.known) for e in exits] == [(4, False)]  # no host claimed it


def test_a_leaving_host_takes_no_more_and_its_goodbye_ends_what_it_never_started():
    reg = registry()
    a = join(reg, slots=2)
    reg.request(0, {})
    reg.poll(a, HostPoll(leaving=True))
    assert reg.request(1, {}) is None  # waits for another host
    reg.poll(a, HostPoll(goodbye=True))
    (ex,) = reg.take_exits()
    assert ex.worker_id == 0 and ex.returncode == 0
    with pytest.raises(UnknownHost):
        reg.orders(a)


def test_the_local_host_is_placed_on_but_never_polled_nor_lost():
    reg = registry(local_node="me (10.0.0.1)", local_slots=1)
    assert reg.request(0, {}) == LOCAL and reg.node(0) == "me (10.0.0.1)"
    with pytest.raises(UnknownHost):
        reg.poll(LOCAL, HostPoll())
    assert not reg.signal(0, signal.SIGTERM)  # the backend signals its local workers itself
    reg.check(time.monotonic() + 1e6)
    assert reg.take_exits() == []
    reg.ended(0)
    assert reg.request(1, {}) == LOCAL


def test_the_wake_pipe_is_drained_by_taking_the_exits():
    reg = registry()
    join(reg)
    assert readable(reg.wake_fd)
    reg.take_exits()
    assert not readable(reg.wake_fd)
    reg.release()
    with pytest.raises(OSError):
        os.fstat(reg.wake_fd)
