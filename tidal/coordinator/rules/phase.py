"""The job's phase and its one door: every decision of the job's outcome goes through
``decide``; the other moves of the phase through ``start_running`` and ``end``.

Pure: each takes the ``Job`` and returns the actions that record the move (``actions``),
which the coordinator hands to its executor. A move the table does not allow raises
``PhaseError``: a rule that decides twice is a bug to see, not an outcome to overwrite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.coordinator.actions import Action, RecordControl, RecordEvent, RecordJob
from tidal.coordinator.job import TRANSITIONS, Phase, PhaseError
from tidal.coordinator.recovery import control_of
from tidal.protocol import EventView, JobState

if TYPE_CHECKING:
    from tidal.coordinator.job import Job


OUTCOMES = (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


def _move(job: Job, to: Phase) -> None:
    if to not in TRANSITIONS[job.phase]:
        raise PhaseError(f"the job cannot go from {job.phase.value} to {to.value}")


def decide(
    job: Job, outcome: JobState, why: str | None, *, now: float, overturn: bool = False
) -> list[Action]:
    """Decide the job's ``outcome`` (succeeded, failed or stopped), for ``why``: the one
    door of every outcome. Returns the actions that record it: the ``control`` record (a
    restarted coordinator finishes the wind-down) and the event ``job OUTCOME: why`` (none
    when ``why`` is None: a ``tidal stop``, whose own event said it). ``overturn``: the
    decided success becomes a failure (its final checkpoint failed); otherwise the job must
    not be decided yet."""
    if outcome not in OUTCOMES:
        raise PhaseError(f"{outcome.value} is not an outcome")
    if overturn:
        if job.outcome != JobState.SUCCEEDED or outcome != JobState.FAILED:
            raise PhaseError("only a decided success may be overturned, to a failure")
    elif job.outcome is not None:
        raise PhaseError(f"the job's outcome is decided already ({job.outcome.value})")
    _move(job, Phase.DECIDED)
    job.outcome, job.outcome_why = outcome, why
    actions: list[Action] = [RecordControl(control=control_of(job).to_dict())]
    if why is not None:
        event = EventView(time=now, kind="job", message=f"job {outcome.value}: {why}")
        actions.append(RecordEvent(event=event))
    return actions


def start_running(job: Job) -> list[Action]:
    """The first generation formed: the job runs. Its row says so with its world size (a
    reader never sees a running job of no members). Nothing once it runs. A job decided
    before its first generation formed shows running too once one forms, and stays
    ``DECIDED``."""
    if job.state != JobState.PENDING:
        return []
    if job.outcome is None:
        _move(job, Phase.RUNNING)
    job.state = JobState.RUNNING
    return [RecordJob(values={"state": job.state.value, "world_size": job.world_size()})]


def end(job: Job) -> None:
    """Every process is gone: the job's state reaches its decided outcome. The caller
    flushes the records (``Coordinator.flush``) and records the end's event."""
    _move(job, Phase.ENDED)
    job.state = job.outcome


def records_broken(job: Job) -> None:
    """The job ended while its records could not be written (a broken database: the host
    stopped it): whatever its outcome, it ended failed, which is what its records will
    say if they can take it. Only once ended."""
    if job.phase is not Phase.ENDED:
        raise PhaseError(f"the job has not ended ({job.phase.value})")
    job.state = JobState.FAILED
