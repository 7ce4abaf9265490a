"""The coordinator's decisions, pass by pass, on values: a ``Job`` and facts in, actions
out. No store, no SQLite, no process: each test runs in milliseconds."""

from __future__ import annotations

import pytest

from tidal.coordinator import phase
from tidal.coordinator.actions import RecordControl, RecordEvent, RecordJob
from tidal.coordinator.job import Job
from tidal.coordinator.phase import TRANSITIONS, Phase, PhaseError
from tidal.protocol import JobState

PENDING, RUNNING = JobState.PENDING, JobState.RUNNING
SUCCEEDED, FAILED, STOPPED = JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED


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
