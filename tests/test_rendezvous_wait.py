"""How a member waits at a generation's rendezvous (``group.rendezvous``): one that arrives
before the last blocks in the store until the state moves, instead of polling it, and
wakes when the last member arrives or when the coordinator abandons the generation. A real
``TCPStore``; the coordinator's half is its real executor."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from test_executor import coord  # noqa: F401 - the fixture

from tidal.coordinator.actions import OpenGeneration
from tidal.coordinator.control.controller import Coordinator
from tidal.protocol import GenerationInfo
from tidal.store_auth import AuthStore
from tidal.store_keys import GEN_OPEN, generation_prefix, state_key
from tidal.worker.membership import group as grp


class Counting:
    """The store calls ``rendezvous`` makes, counted (a real store underneath)."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.gets = store, 0

    def get(self, key: str) -> bytes:
        self.gets += 1
        return self.store.get(key)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)


def wait_in_thread(store, info: GenerationInfo, timeout_s: float = 30.0):
    out: list = []
    t = threading.Thread(
        target=lambda: out.append(grp.rendezvous(store, info, timeout_s=timeout_s))
    )
    t.start()
    return t, out


@pytest.mark.timeout(60)
def test_an_early_member_waits_in_the_store_and_wakes_when_the_last_arrives() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    info = GenerationInfo(id=1, members=[0, 1], store_prefix="ns/gen1", reason="test")
    server.set(state_key(info.store_prefix), GEN_OPEN)
    early = Counting(client(server.port))
    t, out = wait_in_thread(early, info)
    time.sleep(0.3)  # a poll every millisecond would have read the state ~300 times
    assert t.is_alive() and not out
    assert early.gets <= 2
    arrived = time.monotonic()
    assert grp.rendezvous(client(server.port), info, timeout_s=5) == grp.Arrival.FORMED
    t.join(10)
    assert out == [grp.Arrival.FORMED] and time.monotonic() - arrived < 5
    assert early.gets <= 3


@pytest.mark.timeout(60)
def test_a_waiting_member_wakes_when_the_coordinator_abandons_its_generation(
    coord: Coordinator,  # noqa: F811 - the fixture
) -> None:
    latest = coord.job.latest
    info = latest.info()
    # a member's client: the coordinator's values are authenticated (``store_auth``)
    waiting = Counting(AuthStore(client(coord.executor.store_port), coord.store_key))
    t, out = wait_in_thread(waiting, info)
    time.sleep(0.3)
    assert t.is_alive() and not out
    newer = generation_prefix(coord.store_namespace, latest.id + 1)
    coord.executor.do(OpenGeneration(prefix=newer, previous=info.store_prefix))
    t.join(10)
    assert out == [grp.Arrival.ABANDONED] and waiting.gets <= 3


@pytest.mark.timeout(60)
def test_a_rendezvous_nobody_completes_times_out(tmp_path: Path) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    info = GenerationInfo(id=1, members=[0, 1], store_prefix="ns/gen1", reason="test")
    server.set(state_key(info.store_prefix), GEN_OPEN)
    began = time.monotonic()
    assert grp.rendezvous(client(server.port), info, timeout_s=0.3) == grp.Arrival.TIMED_OUT
    assert time.monotonic() - began >= 0.3
    assert grp.rendezvous(client(server.port), info, timeout_s=5) == grp.Arrival.FORMED
