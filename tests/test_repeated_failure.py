"""A collective that fails the same way in every generation (a bug, e.g. gloo refusing
``ReduceOp.PREMUL_SUM``) fails the job after ``REFORMS_WITHOUT_PROGRESS`` re-forms in a row
at one step, saying so, instead of re-forming forever (``reform_rules.repeated_failure``).

A real coordinator in this process, driven by its own loop (``tick``), with worker records
and no worker processes: members report failed collectives for the latest generation the
way workers do (``on_failure``), the loop re-forms after its grace, and the job's end is
read back from its status and the line ``tidal run`` prints."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2e_helpers import event_messages, summarize

from tidal.backends import Exit
from tidal.backends.local import LocalBackend
from tidal.config import JobSpec
from tidal.coordinator.control.controller import Coordinator
from tidal.coordinator.job import Streak
from tidal.coordinator.records.records import WorkerRecord
from tidal.coordinator.recovery import Control
from tidal.coordinator.rules.reform_rules import REFORMS_WITHOUT_PROGRESS
from tidal.display import print_outcome
from tidal.protocol import (
    FailureKind,
    FailureReport,
    HeartbeatRequest,
    JobState,
    RegisterRequest,
    StepReport,
    WorkerState,
)

PREMUL = "RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo"
REASON = (
    "the collective at step {step} failed 10 times in a row with every member alive "
    "(last: worker 1: RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo)"
)


def no_start(*_args, **_kwargs):
    raise AssertionError("the test's coordinator must not start a worker process")


def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **recover) -> Coordinator:
    """A coordinator of a 2-worker job (``recover``: ``recover=True``, a restarted one) whose
    backend may not start a process. A lost worker is not replaced (``--max-restarts 0``):
    the target shrinks to the survivor."""
    spec = JobSpec(
        name="repeat",
        script=str(tmp_path / "x.py"),
        workers=2,
        max_workers=3,
        max_restarts=0,
    )
    monkeypatch.setattr(LocalBackend, "start", no_start)
    return Coordinator(spec, tmp_path / "home", **recover)


@pytest.fixture
def coord(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    c = make(tmp_path, monkeypatch)
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


def fail_once(c: Coordinator, step: int, reporters: tuple[int, ...] = (1, 0)) -> int:
    """Both members report a failed collective at ``step`` in the latest generation (worker
    1 first, as the one whose op raised); the loop runs until it re-formed or decided the
    job. Returns the generation the reports were for."""
    gen = c.job.latest.id
    for wid in reporters:
        c.on_failure(wid, FailureReport(generation=gen, step=step, error=PREMUL))
    deadline = time.monotonic() + 5
    while c.job.latest.id == gen and c.job.outcome is None:
        assert time.monotonic() < deadline, "the loop neither re-formed nor decided the job"
        c.tick()
        time.sleep(0.01)
    return gen


def commit_step(c: Coordinator, step: int) -> None:
    """Every member of the latest generation committed ``step`` and says so, as a worker's
    heartbeat does (with its first step's report)."""
    gen = c.job.latest.id
    for wid in c.job.latest.members:
        report = StepReport(generation=gen, start_step=step - 1, first_step_time=time.time())
        c.on_heartbeat(wid, HeartbeatRequest(step=step, generation=gen, reports=[report]))


def job_failed_events(c: Coordinator) -> list[str]:
    status = c.status(fresh=True)
    return [e.message for e in status.events if e.message.startswith("job failed: ")]


def test_the_tenth_failure_in_a_row_at_one_step_fails_the_job_saying_so(
    coord: Coordinator, capsys: pytest.CaptureFixture
) -> None:
    first = coord.job.latest.id
    for _ in range(REFORMS_WITHOUT_PROGRESS - 1):
        fail_once(coord, 0)
    assert coord.job.outcome is None
    assert coord.job.latest.id == first + 9  # nine re-forms with the same members
    assert coord.job.latest.members == [0, 1]
    assert coord.job.failed_collectives == Streak(step=0, count=9, last=f"worker 1: {PREMUL}")

    last = fail_once(coord, 0)
    assert coord.job.outcome == JobState.FAILED
    assert coord.job.latest.id == last  # no eleventh generation
    while coord.tick():  # the wind-down: no process to wait for
        pass
    status = coord.status(fresh=True)
    assert status.state == JobState.FAILED
    assert job_failed_events(coord) == ["job failed: " + REASON.format(step=0)]
    # What `tidal run` prints, and its exit code.
    assert print_outcome(coord) == 1
    err = capsys.readouterr().err
    assert err == f"tidal: error: job repeat failed: {REASON.format(step=0)}\n"


@pytest.mark.parametrize("how", ["heartbeat", "report"])
def test_a_committed_step_in_between_starts_the_count_again(coord: Coordinator, how) -> None:
    for _ in range(REFORMS_WITHOUT_PROGRESS - 1):
        fail_once(coord, 0)
    if how == "heartbeat":  # a step committed and said before the next failure
        commit_step(coord, 1)
        assert coord.job.step == 1
    # else only the failure reports say it: their step is ahead of the heartbeats
    for _ in range(REFORMS_WITHOUT_PROGRESS - 1):
        fail_once(coord, 1)
    assert coord.job.outcome is None, job_failed_events(coord)
    assert coord.job.failed_collectives.step == 1 and coord.job.failed_collectives.count == 9
    assert len(coord.job.generations) == 1 + 2 * (REFORMS_WITHOUT_PROGRESS - 1)
    # ...and a new streak at step 1 fails at its own tenth.
    fail_once(coord, 1)
    assert coord.job.outcome == JobState.FAILED
    assert job_failed_events(coord) == ["job failed: " + REASON.format(step=1)]


def test_a_scale_does_not_start_the_count_again(coord: Coordinator) -> None:
    for _ in range(5):
        fail_once(coord, 0)
    with coord.lock:  # a warm standby, and a scale that takes it: a re-form for a scale
        coord.job.workers[2] = WorkerRecord(
            id=2, state=WorkerState.STANDBY, pid=1, host="h", last_heartbeat=time.time()
        )
        # Joiners wait for a generation being formed (``Pool.settling``): this one formed
        # (its members met and reported a first step) before the collective failed again.
        coord.job.latest.start_step = 0
    coord.on_scale(3)
    coord.tick()
    assert coord.job.latest.members == [0, 1, 2]
    assert coord.job.failed_collectives.count == 5  # it explains nothing: the count goes on
    for _ in range(4):
        fail_once(coord, 0)
    assert coord.job.outcome is None
    fail_once(coord, 0)
    assert coord.job.outcome == JobState.FAILED
    assert job_failed_events(coord) == ["job failed: " + REASON.format(step=0)]


def test_a_lost_member_starts_the_count_again(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(5):
        fail_once(coord, 0)
    exits = [Exit(worker_id=1, returncode=-9)]  # the backend sees worker 1 SIGKILLed
    monkeypatch.setattr(coord.executor.backend, "poll", lambda: [exits.pop()] if exits else [])
    coord.tick()
    assert coord.job.latest.members == [0]  # no replacement (--max-restarts 0)
    assert coord.job.failed_collectives is None  # its loss explains its peers' failures
    for _ in range(REFORMS_WITHOUT_PROGRESS - 1):
        fail_once(coord, 0, reporters=(0,))
    assert coord.job.outcome is None
    fail_once(coord, 0, reporters=(0,))
    assert coord.job.outcome == JobState.FAILED
    assert job_failed_events(coord) == [
        "job failed: " + REASON.format(step=0).replace("worker 1", "worker 0")
    ]


def test_the_count_survives_a_coordinator_restart(
    coord: Coordinator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(6):
        fail_once(coord, 0)
    saved = Control.from_dict(coord.executor.db.load_control("repeat"))
    assert saved.failed_collectives == Streak(step=0, count=6, last=f"worker 1: {PREMUL}")
    # It dies (the fixture closes it at the end); its workers train on, and the next one
    # adopts them.
    monkeypatch.setattr(LocalBackend, "adopt", lambda self, wid, pid, env: True)
    again = make(tmp_path, monkeypatch, recover=True)
    try:
        assert again.job.failed_collectives == saved.failed_collectives
        for wid in (0, 1):
            again.on_register(wid, RegisterRequest(pid=1, host="h", generation=7, step=0))
        for _ in range(REFORMS_WITHOUT_PROGRESS - 6 - 1):
            fail_once(again, 0)
        assert again.job.outcome is None
        fail_once(again, 0)
        assert again.job.outcome == JobState.FAILED
        assert job_failed_events(again) == ["job failed: " + REASON.format(step=0)]
    finally:
        again.close()


# -- end to end: `tidal run` with real workers -------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_tidal_run_fails_a_job_whose_collective_always_fails(tidal_home) -> None:
    """Worker 0 raises inside step 3's gradient all-reduce in every generation (more faults
    armed than the limit): ``tidal run`` exits 1 naming the repeat and the error, and the
    status says the same; no process is left."""
    faults = ";".join(f"raise@worker=0,phase=allreduce,step=3,id={i}" for i in range(15))
    proc, job = tidal_home.run(
        "always-fails", "--workers", "2", script_args=["--max-steps", "50"], faults=faults
    )
    status = job.status()
    reason = (
        "the collective at step 3 failed 10 times in a row with every member alive (last: worker "
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:], summarize(status))
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"tidal: error: job always-fails failed: {reason}"), proc.stderr
    assert "injected fault at step 3 (allreduce)" in line or "worker 1:" in line, line
    assert status["state"] == "failed", summarize(status)
    said = [m for m in event_messages(status, "job") if m.startswith("job failed: ")]
    assert len(said) == 1 and said[0] == "job failed: " + line.split(" failed: ", 1)[1]
    reformed = [g for g in status["generations"] if "reported a failed collective" in g["reason"]]
    assert len(reformed) == 9, summarize(status)
    tidal_home.assert_no_processes()


def test_a_script_mismatch_fails_the_job_at_once_quoting_it(
    coord: Coordinator, capsys: pytest.CaptureFixture
) -> None:
    # The source's send fails first (its peer left); the receiver's refusal then ends the
    # job at once, quoting the refusal, not the peer's error: no re-form can mend it.
    gen = coord.job.latest.id
    mismatch = "ModelMismatch: this worker's model differs from the source's at 0.weight"
    coord.on_failure(0, FailureReport(generation=gen, step=20, error=PREMUL))
    coord.on_failure(
        1,
        FailureReport(generation=gen, step=20, error=mismatch, kind=FailureKind.SCRIPT_MISMATCH),
    )
    while coord.tick():  # the wind-down: no process to wait for
        pass
    assert coord.job.outcome == JobState.FAILED
    assert coord.job.latest.id == gen  # never re-formed
    assert job_failed_events(coord) == [f"job failed: worker 1: {mismatch}"]
    assert print_outcome(coord) == 1
    assert f"failed: worker 1: {mismatch}\n" in capsys.readouterr().err
