"""The coordinator's decisions, pass by pass, on values: a ``Job`` and facts in, actions
out. No store, no SQLite, no process: each test runs in milliseconds."""

from __future__ import annotations

import ast
import dataclasses
import json
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import ANY

import pytest

from tidal.backends import Exit
from tidal.config import JobSpec
from tidal.coordinator.actions import (
    AbandonGeneration,
    AdoptWorker,
    OpenGeneration,
    RecordControl,
    RecordEvent,
    RecordJob,
    RecordWorkers,
    SignalWorker,
    StartWorker,
)
from tidal.coordinator.control.effects import RequestError
from tidal.coordinator.control.parts import Parts, compose
from tidal.coordinator.job import TRANSITIONS, Job, Phase, PhaseError, Streak, durable_fields
from tidal.coordinator.records.accounting import Accounting
from tidal.coordinator.records.records import WorkerRecord
from tidal.coordinator.recovery import Control, Rebuilt, control_of
from tidal.coordinator.rules import phase
from tidal.policy.inputs import Decision, PolicyParams
from tidal.policy.registry import get_policy
from tidal.protocol import HeartbeatRequest, JobState, WorkerState

PENDING, RUNNING = JobState.PENDING, JobState.RUNNING
SUCCEEDED, FAILED, STOPPED = JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED
STANDBY = WorkerState.STANDBY


def _job(**kw) -> Job:
    return Job(target=2, requested=2, created=0.0, **kw)


# -- the job's phase ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "outcome", "phase_"),
    [
        (PENDING, None, Phase.PENDING),
        (RUNNING, None, Phase.RUNNING),
        (PENDING, FAILED, Phase.DECIDED),
        (RUNNING, STOPPED, Phase.DECIDED),
        (SUCCEEDED, SUCCEEDED, Phase.ENDED),
        (FAILED, FAILED, Phase.ENDED),
    ],
)
def test_the_phase_is_read_from_the_state_and_the_outcome(state, outcome, phase_) -> None:
    assert _job(state=state, outcome=outcome).phase is phase_


def test_the_transition_table() -> None:
    assert TRANSITIONS == {
        Phase.PENDING: {Phase.RUNNING, Phase.DECIDED},
        Phase.RUNNING: {Phase.DECIDED},
        Phase.DECIDED: {Phase.DECIDED, Phase.ENDED},
        Phase.ENDED: set(),
    }


@pytest.mark.parametrize("outcome", [SUCCEEDED, FAILED, STOPPED])
@pytest.mark.parametrize("state", [PENDING, RUNNING])
def test_decide_records_the_outcome_and_says_why(state, outcome) -> None:
    job = _job(state=state)
    actions = phase.decide(job, outcome, "because", now=5.0)
    assert job.outcome is outcome and job.phase is Phase.DECIDED
    assert isinstance(actions[0], RecordControl)
    assert actions[0].control["outcome"] == outcome.value  # a restart finishes the wind-down
    assert actions[1] == RecordEvent(
        event=actions[1].event.model_copy(update={"message": f"job {outcome.value}: because"})
    )
    assert actions[1].event.time == 5.0 and actions[1].event.kind == "job"


def test_a_stop_is_decided_without_an_event_of_its_own() -> None:
    job = _job(state=RUNNING)
    actions = phase.decide(job, STOPPED, None, now=0.0)
    assert [type(a) for a in actions] == [RecordControl] and job.outcome is STOPPED


@pytest.mark.parametrize(
    ("state", "outcome", "to", "overturn"),
    [
        (RUNNING, SUCCEEDED, FAILED, False),  # decided once: never overwritten
        (RUNNING, FAILED, SUCCEEDED, False),
        (RUNNING, FAILED, FAILED, True),  # only a success is overturned
        (RUNNING, SUCCEEDED, STOPPED, True),  # ... and only to a failure
        (RUNNING, None, FAILED, True),  # nothing to overturn
        (FAILED, FAILED, FAILED, False),  # ended
        (RUNNING, None, RUNNING, False),  # not an outcome
    ],
)
def test_moves_the_table_refuses(state, outcome, to, overturn) -> None:
    job = _job(state=state, outcome=outcome)
    with pytest.raises(PhaseError):
        phase.decide(job, to, "why", now=0.0, overturn=overturn)
    assert job.outcome is outcome and job.state is state


def test_a_success_is_overturned_by_its_final_checkpoint() -> None:
    job = _job(state=RUNNING, outcome=SUCCEEDED)
    phase.decide(job, FAILED, "disk full", now=0.0, overturn=True)
    assert job.outcome is FAILED and job.phase is Phase.DECIDED


def test_the_first_formed_generation_starts_the_job_once() -> None:
    job = _job()
    actions = phase.start_running(job)
    assert job.phase is Phase.RUNNING
    assert actions == [RecordJob(values={"state": "running", "world_size": 0})]
    assert phase.start_running(job) == []


def test_a_job_decided_before_it_formed_shows_running_and_stays_decided() -> None:
    job = _job(outcome=FAILED)
    assert phase.start_running(job) != [] and job.state is RUNNING
    assert job.phase is Phase.DECIDED


def test_the_end_reaches_the_outcome_only_once_decided() -> None:
    job = _job(state=RUNNING)
    with pytest.raises(PhaseError):
        phase.end(job)
    phase.decide(job, SUCCEEDED, "done", now=0.0)
    phase.end(job)
    assert job.state is SUCCEEDED and job.phase is Phase.ENDED
    with pytest.raises(PhaseError):
        phase.decide(job, FAILED, "late", now=0.0, overturn=True)


# -- a pass, on values: the parts composed over an executor that only records --------------
class Recorder:
    """An executor that records the actions it is handed and carries none out: no store,
    no SQLite, no process. ``exits``: what its next ``poll`` reports; ``adoptable``: the
    workers an ``AdoptWorker`` finds alive."""

    max_starting = 8

    def __init__(self) -> None:
        self.actions: list = []
        self.exits: list[Exit] = []
        self.live: set[int] = set()
        self.adoptable: set[int] = set()
        self.records = SimpleNamespace(workers={})

    def do(self, action):
        self.actions.append(action)
        match action:
            case StartWorker(worker_id=wid):
                self.live.add(wid)
                return 1000 + wid
            case AdoptWorker(worker_id=wid):
                if wid in self.adoptable:
                    self.live.add(wid)
                return wid in self.adoptable
            case RecordWorkers(rows=rows):
                self.records.workers.update((r.id, r) for r in rows)
        return None

    def poll(self) -> list[Exit]:
        out, self.exits = self.exits, []
        self.live -= {e.worker_id for e in out}
        return out

    def alive(self) -> list[int]:
        return sorted(self.live)

    def waiting(self) -> set[int]:
        return set()

    def node(self, wid: int) -> str:
        return "node"

    def news(self) -> list[str]:
        return []

    def describe_exit(self, wid: int) -> str:
        return ""

    def checkpoints(self) -> list:
        return []

    def took(self, kind: type) -> list:
        """The actions of ``kind`` handed over so far."""
        return [a for a in self.actions if isinstance(a, kind)]

    def events(self) -> list[str]:
        return [a.event.message for a in self.took(RecordEvent)]


class _Wake:
    def set(self) -> None:
        pass


@dataclass(kw_only=True)
class Rig:
    job: Job
    ex: Recorder
    parts: Parts

    def pass_(self) -> bool:
        return self.parts.loop.tick()


def rig(*, standby=(), members=(), policy=None, job=None, **spec) -> Rig:
    """A job of ``workers`` (default 2) whose ``standby`` workers are registered and whose
    ``members`` form its first generation (formed: it runs)."""
    spec = JobSpec(name="d", script="/x.py", **{"workers": 2, "max_workers": 4, **spec})
    job = job or Job(target=spec.workers, requested=spec.workers, created=time.time())
    ex = Recorder()
    parts = compose(
        job=job,
        spec=spec,
        executor=ex,
        accounting=Accounting(
            price=0.0, trace=None, params=PolicyParams.from_spec(spec, assumed_pause_s=1.0)
        ),
        policy=policy or get_policy(spec.policy),
        lock=threading.RLock(),
        wake=_Wake(),
        inbox=deque(),
        namespace="ns",
        first_generation=1,
        first_worker=0,
        checkpoint_dir=None,
        token="t",
        url="http://127.0.0.1:1",
        config=None,
        resumed_step=None,
    )
    for wid in (*members, *standby):
        job.workers[wid] = WorkerRecord(
            id=wid, state=STANDBY, pid=1000 + wid, host="h", last_heartbeat=time.time()
        )
        ex.live.add(wid)
    if members:
        parts.generations.open(list(members), "the start")
        job.latest.start_step = 0
        phase.start_running(job)
    ex.actions.clear()
    return Rig(job=job, ex=ex, parts=parts)


def test_join_opens_the_first_generation_once_the_target_is_ready() -> None:
    r = rig(standby=(0,))
    r.pass_()
    assert r.ex.took(StartWorker) == [StartWorker(worker_id=1, env=ANY)]  # one more
    assert r.ex.took(OpenGeneration) == []
    r.job.workers[1].state = STANDBY  # it registered
    r.pass_()
    assert len(r.ex.took(OpenGeneration)) == 1
    assert r.job.members == [0, 1] and "generation 1: 2 workers [0, 1] (" in r.ex.events()[-1]


def test_a_joiner_is_admitted_at_the_next_generation() -> None:
    r = rig(members=(0, 1), standby=(2,), workers=3)
    r.pass_()
    assert r.job.members == [0, 1, 2] and r.job.latest.id == 2


@pytest.mark.parametrize(
    ("ours", "target", "members"),
    [
        (False, 1, [0]),  # the cloud's notice: capacity went with it
        (True, 2, [0]),  # ours (capacity): the target counted it already
    ],
)
def test_a_leaver_leaves_at_a_step_boundary(ours, target, members) -> None:
    r = rig(members=(0, 1))
    w = r.job.workers[1]
    w.preempted = ours
    r.parts.effects.apply_heartbeat(w, HeartbeatRequest(step=5, generation=1, leaving=True))
    r.pass_()
    assert r.job.latest.members == members and r.job.target == target
    assert w.retired and w.state == WorkerState.STOPPING
    assert any("(worker 1 left: preemption notice (SIGTERM))" in e for e in r.ex.events())
    assert r.job.failures == 0  # a planned leave, no failure


@pytest.mark.parametrize(
    ("code", "outcome", "failures", "members"),
    [
        (1, FAILED, 0, [0, 1]),  # the script raised: every worker would
        (-9, None, 1, [0]),  # a lost member: re-form without it, replace it
    ],
)
def test_a_member_ends(code, outcome, failures, members) -> None:
    r = rig(members=(0, 1))
    r.ex.exits.append(Exit(worker_id=1, returncode=code))
    r.pass_()
    assert r.job.outcome is outcome and r.job.failures == failures
    assert r.job.latest.members == members
    if outcome is FAILED:
        assert "job failed: worker 1 exited with code 1" in r.ex.events()
        assert r.ex.took(AbandonGeneration)  # the wind-down began in the same pass
    else:  # its replacement starts once the re-formed generation formed (``reconcile``)
        assert r.ex.took(StartWorker) == []
        r.job.latest.start_step = 5
        r.pass_()
        assert r.ex.took(StartWorker) == [StartWorker(worker_id=2, env=ANY)]


def test_a_hung_worker_is_killed_and_replaced() -> None:
    r = rig(members=(0, 1), heartbeat_timeout_s=10.0)
    r.job.workers[1].last_heartbeat = time.time() - 11.0
    r.pass_()
    kills = r.ex.took(SignalWorker)
    assert [(k.worker_id, k.signum) for k in kills] == [(1, signal.SIGKILL)]
    assert "missed heartbeats" in kills[0].why
    r.ex.exits.append(Exit(worker_id=1, returncode=-9))
    r.pass_()
    assert r.job.latest.members == [0] and r.job.failures == 1


@pytest.mark.parametrize(("n", "starts", "retired"), [(3, [2], []), (1, [], [1])])
def test_scale(n, starts, retired) -> None:
    r = rig(members=(0, 1))
    r.parts.effects.apply_scale(n)
    assert r.job.target == n and RecordJob(values={"target_workers": n}) in r.ex.actions
    r.pass_()
    assert [a.worker_id for a in r.ex.took(StartWorker)] == starts
    assert [w.id for w in r.job.workers.values() if w.retired] == retired


def test_the_policy_moves_the_target_saying_why() -> None:
    r = rig(members=(0, 1), policy=lambda m: Decision(target=3, reason="more is faster"))
    r.pass_()
    assert r.job.requested == r.job.target == 3
    assert any(e.endswith(": more is faster") for e in r.ex.events())
    assert [a.worker_id for a in r.ex.took(StartWorker)] == [2]


def test_a_stop_decides_stopped_and_winds_down() -> None:
    r = rig(members=(0, 1))
    r.parts.effects.apply_stop()
    r.pass_()
    assert r.job.outcome is STOPPED and r.job.phase is Phase.DECIDED
    assert not any(e.startswith("job stopped") for e in r.ex.events())  # the stop's own said it
    assert r.ex.took(AbandonGeneration)
    r.ex.exits += [Exit(worker_id=0, returncode=0), Exit(worker_id=1, returncode=0)]
    for w in r.job.workers.values():
        w.ask_to_exit(time.monotonic())  # their done reports
    assert r.pass_() is False
    assert r.job.state is STOPPED and r.ex.events()[-1] == "job ended: stopped at step 0"


def test_a_scale_is_refused_once_the_job_is_finishing() -> None:
    r = rig(members=(0, 1))
    r.parts.effects.apply_stop()
    with pytest.raises(RequestError):
        r.parts.effects.apply_scale(3)


def test_a_restarted_coordinator_adopts_the_live_and_counts_the_gone_as_lost() -> None:
    r = rig(members=(0, 1))
    for w in r.job.workers.values():
        w.adopted = False  # the previous coordinator's
    r.ex.live.clear()
    r.ex.adoptable = {0}
    rebuilt = Rebuilt(
        workers=r.job.workers,
        generations=r.job.generations,
        reopen=False,
        state=RUNNING,
        outcome=None,
        step=0,
        control=Control(requested=2),
    )
    r.parts.lifecycle.adopt(rebuilt, incarnation=1)
    events = r.ex.events()
    assert "1 live workers [0] adopted, awaiting their re-registration; [1] gone" in events[0]
    assert r.job.workers[1].state == WorkerState.FAILED and r.job.failures == 1
    assert r.job.latest.members == [0]  # re-formed without the lost one
    assert r.ex.took(RecordControl)[-1].control["failures"] == 1  # a restart's restart


def test_decisions_take_milliseconds() -> None:
    began = time.perf_counter()
    for _ in range(20):
        r = rig(members=(0, 1))
        r.ex.exits.append(Exit(worker_id=1, returncode=-9))
        r.pass_()
    assert (time.perf_counter() - began) / 20 < 0.05


# -- what a restart keeps ---------------------------------------------------------------------
def test_every_durable_field_of_the_job_is_in_the_control_record() -> None:
    names = durable_fields()
    assert {"requested", "failures", "settled_step", "failed_collectives"} <= set(names)
    assert set(names) <= {f.name for f in dataclasses.fields(Control)}


def test_the_durable_fields_survive_the_control_record() -> None:
    job = _job(
        failures=2,
        loss_times=[1.0, 2.0],
        job_length=100,
        settled_step=20,
        schedule_done=1,
        checkpoint_failed={30: "disk full"},
        completing=(1, 100),
        failed_collectives=Streak(step=5, count=2, last="worker 1: boom"),
    )
    back = Control.from_dict(json.loads(json.dumps(control_of(job).to_dict())))
    for name in durable_fields():
        assert getattr(back, name) == getattr(job, name), name


def test_a_control_record_of_an_older_coordinator_has_no_settled_step() -> None:
    assert Control.from_dict({"requested": 2, "settled_step": -1}).settled_step is None


def test_the_control_record_is_written_once_per_change() -> None:
    r = rig(members=(0, 1))  # its first generation's opening wrote it
    for _ in range(3):
        r.parts.ledger.save_control()
    assert r.ex.took(RecordControl) == []
    r.job.failures += 1
    r.parts.ledger.save_control()
    r.parts.ledger.save_control()
    assert [a.control["failures"] for a in r.ex.took(RecordControl)] == [1]


# -- the shape that makes these tests possible ----------------------------------------------
COORDINATOR = Path(__file__).resolve().parents[1] / "tidal" / "coordinator"


def test_the_coordinator_is_composed_not_inherited() -> None:
    from tidal.coordinator.control.controller import Coordinator

    assert Coordinator.__bases__ == (object,)
    assert [f.name for f in dataclasses.fields(Parts)] == [
        "ledger",
        "publisher",
        "generations",
        "lifecycle",
        "worlds",
        "scaling",
        "effects",
        "handlers",
        "views",
        "loop",
    ]


@pytest.mark.parametrize("path", sorted(COORDINATOR.glob("*.py")), ids=lambda p: p.name)
def test_no_part_reads_another_parts_private_names(path: Path) -> None:
    """``self.part._name`` anywhere in the coordinator: a part reaching into another."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
        ):
            raise AssertionError(f"{path.name}:{node.lineno}: self.{node.value.attr}.{node.attr}")


def test_an_ended_job_whose_records_broke_ends_failed() -> None:
    job = _job(state=RUNNING)
    with pytest.raises(PhaseError):
        phase.records_broken(job)
    phase.decide(job, STOPPED, None, now=0.0)
    phase.end(job)
    phase.records_broken(job)
    assert job.state is FAILED and job.phase is Phase.ENDED
