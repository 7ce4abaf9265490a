"""The heartbeat's hot path (issue 15): answered from the published ``Answers`` without the
coordinator's lock, applied by the control loop in arrival order; a heartbeat carrying a
fact that must not be lost is applied before its answer, on a thread, never blocking the
server's event loop. A real coordinator and server (``served_coordinator``: it never ticks)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import httpx
import pytest

from tidal.coordinator.control.answers import Answers
from tidal.coordinator.records.records import WorkerRecord, changed_rows
from tidal.coordinator.records.snapshot import WorkerRow
from tidal.coordinator.rules.pacing import heartbeat_interval
from tidal.host.hot_path import HeartbeatHotPath
from tidal.protocol import (
    API_PREFIX,
    GenerationInfo,
    HeartbeatResponse,
    Role,
    WorkerState,
    worker_token,
)


@pytest.fixture
def served(served_coordinator):
    coord, url = served_coordinator
    with coord.lock:
        coord.job.workers[0] = WorkerRecord(id=0, state=WorkerState.STANDBY)
        coord.publisher.publish()
    auth = {"Authorization": f"Bearer {worker_token(coord.token, 0)}"}
    with httpx.Client(base_url=url + API_PREFIX, headers=auth, timeout=10) as client:
        yield coord, client


def beat(client: httpx.Client, **body) -> dict:
    resp = client.post("/workers/0/heartbeat", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_quick_heartbeat_is_answered_while_the_control_loop_holds_the_lock(served):
    coord, client = served
    with coord.lock:  # a control-loop pass in progress
        assert beat(client, step=5)["role"] == "standby"
        assert client.get("/workers/0/role").json()["role"] == "standby"
        assert coord.job.workers[0].step == 0 and coord.job.step == 0  # queued, not applied
        assert coord.job.workers[0].last_heartbeat is not None  # liveness is seen at once
    with coord.lock:
        coord.handlers.drain()
    assert coord.job.workers[0].step == 5 and coord.job.step == 5


def test_a_heartbeat_with_a_fact_applies_the_queue_first_and_never_blocks_the_server(served):
    coord, client = served
    beat(client, step=7)  # queued
    done: list[dict] = []
    with coord.lock:
        slow = threading.Thread(target=lambda: done.append(beat(client, step=8, leaving=True)))
        slow.start()
        slow.join(0.5)
        assert slow.is_alive() and not done  # it waits for the lock, on a worker thread...
        assert beat(client, step=8)["role"] == "standby"  # ...while the event loop answers
    slow.join(10)
    assert done and done[0]["role"] == "standby"
    assert coord.job.leaving == [0] and coord.job.workers[0].step == 8
    with coord.lock:
        coord.handlers.drain()  # the quick step-8 beat sent while the slow one waited
    assert coord.job.workers[0].step == 8 and not coord.inbox


def test_facts_holds_and_role_reads_are_answered_without_fastapi(served):
    """Every member's holding heartbeat, step report and role read come at a scheduled
    change, on busy cores: the hot path answers them itself (the fact applied on a worker
    thread, as the endpoint would), and only what it does not answer reaches FastAPI."""
    coord, client = served

    async def fastapi(scope, receive, send):
        raise AssertionError(f"reached FastAPI: {scope['method']} {scope['path']}")

    async def calls(headers: dict) -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=HeartbeatHotPath(fastapi, coord))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://t" + API_PREFIX, headers=headers
        ) as c:
            return [
                await c.post("/workers/0/heartbeat", json={"step": 8, "leaving": True}),
                await c.get("/workers/0/role"),
            ]

    left, role = asyncio.run(calls(dict(client.headers)))
    assert left.status_code == role.status_code == 200
    assert left.json()["role"] == role.json()["role"] == "standby"
    assert coord.job.leaving == [0] and coord.job.workers[0].step == 8  # applied first
    with pytest.raises(AssertionError, match="reached FastAPI"):  # no credential: FastAPI says 401
        asyncio.run(calls({"Authorization": "Bearer wrong"}))


def test_a_new_generation_is_answered_as_soon_as_it_is_opened(served):
    coord, client = served
    assert beat(client)["generation"] is None
    with coord.lock:
        coord.generations.open([0], "test")
    answer = beat(client)
    assert answer["role"] == "member" and answer["generation"]["members"] == [0]
    with coord.lock:
        coord.job.workers[0].retired = True
    assert beat(client)["role"] == "exit"  # the record is read directly, not the snapshot


def _hold_in_thread(client: httpx.Client, step: int) -> tuple[threading.Thread, list[dict]]:
    done: list[dict] = []
    t = threading.Thread(
        target=lambda: done.append(beat(client, step=step, generation=1, holding=True))
    )
    t.start()
    return t, done


def test_a_holding_member_is_answered_once_its_step_is_settled(served, monkeypatch):
    """The long poll of a member held at a scheduled step: applied at once, answered when
    the loop settles the step (no second round trip), the event loop free meanwhile."""
    monkeypatch.setattr("tidal.coordinator.control.handlers.HOLD_ANSWER_S", 60.0)
    coord, client = served
    with coord.lock:
        coord.generations.open([0], "test")
    held, done = _hold_in_thread(client, 10)
    held.join(0.5)
    assert held.is_alive() and not done  # not settled: kept back...
    assert coord.job.workers[0].step == 10  # ...though applied before the wait
    assert beat(client, step=10)["settled_step"] is None  # a quick beat is answered meanwhile
    with coord.lock:
        coord.job.settled_step = 10
        coord.publisher.publish()
    held.join(10)
    assert done and done[0]["settled_step"] == 10 and done[0]["role"] == "member"


def test_a_holding_heartbeat_at_a_settled_step_is_answered_on_the_event_loop(served):
    """The last member to reach a scheduled step finds it settled: answered at once from the
    published answers, while a control-loop pass holds the lock, and applied later."""
    coord, client = served
    with coord.lock:
        coord.generations.open([0], "test")
        coord.job.settled_step = 10
        coord.publisher.publish()
    with coord.lock:  # a control-loop pass in progress
        answer = beat(client, step=10, generation=1, holding=True)
        assert answer["settled_step"] == 10 and answer["role"] == "member"
        assert coord.job.workers[0].step == 0  # queued, not applied
    with coord.lock:
        coord.handlers.drain()
    assert coord.job.workers[0].step == 10 and not coord.inbox


def _held_beside_a_standby(coord, client: httpx.Client) -> tuple[threading.Thread, list[dict]]:
    """Worker 0 the one member, worker 1 a standby, and worker 0 held at step 10 (kept
    back: not settled)."""
    with coord.lock:
        coord.job.workers[1] = WorkerRecord(id=1, state=WorkerState.STANDBY)
        coord.generations.open([0], "test")
    held, done = _hold_in_thread(client, 10)
    held.join(0.5)
    assert held.is_alive() and not done
    return held, done


def test_members_held_at_a_scheduled_step_are_released_by_the_opening_publish(served, monkeypatch):
    """The generation a scheduled step asked for settles the step as it opens: the held
    members are answered before the rest of the loop's pass (its records) is done."""
    monkeypatch.setattr("tidal.coordinator.control.handlers.HOLD_ANSWER_S", 60.0)
    coord, client = served
    old, spec = coord.spec, dataclasses.replace(coord.spec, schedule=((10, 2),))
    for holder in (coord, *vars(coord).values()):  # the coordinator and its parts
        if getattr(holder, "spec", None) is old:
            holder.spec = spec
    held, done = _held_beside_a_standby(coord, client)
    with coord.lock:  # the pass that applies the schedule entry
        coord.scaling.apply_schedule()
        assert coord.job.target == 2 and coord.job.settled_step is None
        coord.generations.open([0, 1], "--schedule at step 10")
        held.join(10)  # answered while the pass still holds the lock
        assert done and done[0]["settled_step"] == 10
        assert done[0]["generation"]["members"] == [0, 1]


def test_a_holding_member_left_out_of_the_next_generation_is_answered_at_once(served, monkeypatch):
    monkeypatch.setattr("tidal.coordinator.control.handlers.HOLD_ANSWER_S", 60.0)
    coord, client = served
    held, done = _held_beside_a_standby(coord, client)
    with coord.lock:
        coord.generations.open([1], "a scheduled shrink leaves 0 out")  # publishes
    held.join(10)
    assert done and done[0]["role"] == "standby" and done[0]["settled_step"] is None


def test_a_hold_never_settled_is_answered_after_the_bound(served, monkeypatch):
    """The coordinator keeps a holding answer back at most ``HOLD_ANSWER_S``: the member
    asks again, so a loop that never settles cannot hang a request."""
    monkeypatch.setattr("tidal.coordinator.control.handlers.HOLD_ANSWER_S", 0.05)
    coord, client = served
    with coord.lock:
        coord.generations.open([0], "test")
    answer = beat(client, step=10, generation=1, holding=True)
    assert answer["role"] == "member" and answer["settled_step"] is None


def test_a_worker_of_a_previous_coordinator_must_register_again_on_the_quick_path(served):
    coord, client = served
    coord.job.workers[0].adopted = False
    resp = client.post("/workers/0/heartbeat", json={"step": 1})
    assert resp.status_code == 409 and "register again" in resp.json()["detail"]
    assert not coord.inbox
    assert client.get("/workers/0/role").status_code == 409


INFO = GenerationInfo(id=3, members=[0, 1], store_prefix="ns/gen3", reason="r")


def answers(**kw) -> Answers:
    base = dict(
        generation=INFO,
        members=frozenset(INFO.members),
        stop=False,
        ended=False,
        settled_step=None,
        workers=3,
        base_s=0.1,
        timeout_s=10.0,
    )
    return Answers(**(base | kw))


@pytest.mark.parametrize(
    "kw, wid, retired, role",
    [
        ({}, 0, False, Role.MEMBER),
        ({}, 2, False, Role.STANDBY),
        ({}, 0, True, Role.EXIT),  # retired: exits even if named a member
        ({"ended": True}, 0, False, Role.EXIT),
        ({"stop": True}, 1, False, Role.MEMBER),  # a stop is a flag; members finish the step
    ],
)
def test_roles(kw, wid, retired, role):
    assert answers(**kw).role(wid, retired=retired) == role


def test_answers_are_paced_and_encoded_once():
    big = frozenset(range(1000))
    a = answers(members=big, workers=1010)
    member = HeartbeatResponse.model_validate_json(a.encoded(Role.MEMBER))
    assert member.interval_s == heartbeat_interval(base_s=0.1, peers=1000, timeout_s=10.0) > 0.1
    standby = HeartbeatResponse.model_validate_json(a.encoded(Role.STANDBY))
    assert standby.interval_s is None  # 10 outside: the job's own interval
    assert a.encoded(Role.MEMBER) is a.encoded(Role.MEMBER)
    gone = HeartbeatResponse.model_validate_json(answers(stop=True).encoded(Role.EXIT))
    assert gone == HeartbeatResponse(role=Role.EXIT, stop=True)


def test_a_body_too_long_for_the_hot_path_is_replayed_to_fastapi_whole(served):
    coord, client = served
    pad = b" " * (3 << 20)  # 3 MiB of whitespace: valid JSON, read in several chunks
    resp = client.post(
        "/workers/0/heartbeat",
        content=b'{"step": 11,' + pad + b'"metrics": {"loss": 0.5}}',
        headers={"Content-Type": "application/json"},
    )
    assert resp.status_code == 200 and resp.json()["role"] == "standby", resp.text
    assert coord.status(fresh=True).metrics["loss"] == 0.5 and coord.job.workers[0].step == 11
    resp = client.post(  # and what FastAPI refuses, it still refuses, naming the field
        "/workers/0/heartbeat",
        content=b'{"step": -1' + pad + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["body", "step"]


# (what SQLite holds, the live row) -> written by the flush? Rows:
# (id, pid, host, state, rank, last_heartbeat, exit_code, node)
BASE = (3, 100, "h", "running", 0, 1000.0, None, "n")


@pytest.mark.parametrize(
    "saved, row, written",
    [
        (None, BASE, True),  # never written
        (BASE, BASE, False),  # unchanged
        (BASE, BASE[:3] + ("exited",) + BASE[4:], True),  # a state change at once
        (BASE, BASE[:4] + (None,) + BASE[5:], True),  # lost its rank
        (BASE, BASE[:6] + (-9,) + BASE[7:], True),  # an exit code
        (BASE, BASE[:7] + ("m",), True),  # placed elsewhere
        (BASE, BASE[:5] + (1004.9,) + BASE[6:], False),  # a heartbeat alone, < 5 s newer
        (BASE, BASE[:5] + (1005.0,) + BASE[6:], True),  # ... 5 s newer
        (BASE[:5] + (None,) + BASE[6:], BASE, True),  # the first heartbeat
    ],
)
def test_a_flush_writes_the_rows_that_changed(saved, row, written):
    row, saved = WorkerRow(*row), None if saved is None else WorkerRow(*saved)
    assert changed_rows([row], {} if saved is None else {saved[0]: saved}) == (
        [row] if written else []
    )


def test_a_flush_writes_changes_only_and_the_status_shows_them(served):
    coord, _ = served
    with coord.lock:
        for wid in range(1, 50):
            coord.job.workers[wid] = WorkerRecord(id=wid, state=WorkerState.STANDBY)
        coord.flush()
        assert coord.executor.journal.records.workers == {
            w.id: w.row() for w in coord.job.workers.values()
        }
        writes = []
        write = coord.executor.db.upsert_worker_rows
        coord.executor.db.upsert_worker_rows = lambda job, rows: (
            writes.append(list(rows)),
            write(job, rows),
        )
        coord.flush()  # nothing changed: nothing written
        coord.job.workers[7].state = WorkerState.EXITED
        coord.job.workers[8].last_heartbeat = 1.0
        coord.flush()
    assert writes == [[coord.job.workers[7].row(), coord.job.workers[8].row()]]
    states = {w.id: w.state for w in coord.status(fresh=True).workers}
    assert states[7] == WorkerState.EXITED and states[9] == WorkerState.STANDBY


def _standby_agent(served_coordinator):
    """A real ``Agent`` of worker 0, a standby of the served coordinator."""
    from tidal.protocol import WorkerEnv
    from tidal.worker.agent.client import Agent

    coord, url = served_coordinator
    with coord.lock:
        coord.job.workers[0] = WorkerRecord(id=0, state=WorkerState.STANDBY, adopted=False)
        coord.publisher.publish()
    return coord, Agent(WorkerEnv(url=url, token=worker_token(coord.token, 0), worker_id=0))


def _paused_after(call):
    """``call``, pausing after the coordinator answered, before its caller reads the answer:
    the wrapper, the event set when it answered, and the event that releases it."""
    answered, release = threading.Event(), threading.Event()

    def then_pause(*args, **kwargs):
        resp = call(*args, **kwargs)
        answered.set()
        release.wait(10)
        return resp

    return then_pause, answered, release


def test_an_answer_from_a_new_coordinator_waits_for_the_registration_that_made_it(
    served_coordinator,
) -> None:
    """Seeds 320000039, -49, -114: a restarted coordinator answered the training thread as soon
    as it had processed the heartbeat thread's registration, before that thread took the new
    config and bumped ``epoch``; the trainer saw the old epoch and joined the new generation
    in the dead coordinator's store. ``registered_epoch`` waits for the registration."""
    coord, agent = _standby_agent(served_coordinator)
    # the coordinator has adopted the worker, and this thread has not taken its answer yet
    agent._beat_client.register, processed, release = _paused_after(agent._beat_client.register)
    try:
        beat = threading.Thread(target=agent._register, args=(agent._beat_client, 0))
        beat.start()
        assert processed.wait(10)
        assert agent.fetch().role == Role.STANDBY  # answered: the registration is processed
        assert agent.epoch == 0  # the race: the answer is in hand, the epoch is not bumped
        got: list[int] = []
        reader = threading.Thread(target=lambda: got.append(agent.registered_epoch()))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive() and not got  # it waits for the registration in flight
        release.set()
        reader.join(10)
        assert got == [1] and agent.config is not None
    finally:
        release.set()
        beat.join(10)
        agent._client.close()
        agent._beat_client.close()


def test_an_answer_read_late_does_not_replace_a_newer_one(served_coordinator) -> None:
    """The slow suite, 2026-12-04: a job hung 138 s after its first step. A heartbeat was
    answered before generation 1 opened (standby), and its thread read that answer after
    the trainer's fetch had brought generation 1 (member): the stale answer replaced the
    newer one, the member saw itself a standby, switched out of its group at the next step
    and waited for a generation that never came. The answer to the request sent last is
    kept (``Agent._set_latest``)."""
    coord, agent = _standby_agent(served_coordinator)
    real = agent._beat_client.heartbeat
    # answered (a standby, no generation), and the heartbeat thread has not read it yet
    agent._beat_client.heartbeat, answered, release = _paused_after(real)
    kept = agent._set_latest
    offered: list[int] = []  # the numbers of the answers offered to ``_set_latest``
    agent._set_latest = lambda resp, asked: (kept(resp, asked), offered.append(asked))
    try:
        agent.register()  # starts the heartbeat thread; its first beat pauses
        assert answered.wait(10)
        with coord.lock:
            coord.generations.open([0], "test")
            coord.publisher.publish()
        fetched = agent.fetch()
        assert fetched.role == Role.MEMBER and fetched.generation.id == 1
        agent._beat_client.heartbeat = real
        release.set()
        deadline = time.monotonic() + 10
        while 0 not in offered and time.monotonic() < deadline:
            time.sleep(0.01)  # the heartbeat thread reads its late answer meanwhile
        assert 0 in offered  # the first heartbeat's answer, read after the fetch's
        latest = agent.latest()
        assert latest.role == Role.MEMBER and latest.generation.id == 1
    finally:
        release.set()
        agent.close()
