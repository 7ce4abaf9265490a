"""The job's phase and its one door: every decision of the job's outcome goes through
``decide``; the other moves of the phase through ``start_running`` and ``end``.

Pure: each takes the ``Job`` and returns the actions that record the move (``actions``),
which the coordinator hands to its executor. A move the table does not allow raises
``PhaseError``: a rule that decides twice is a bug to see, not an outcome to overwrite.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from tidal.coordinator.actions import Action, RecordControl, RecordEvent, RecordJob
from tidal.coordinator.records.recovery import control_of
from tidal.protocol import EventView, JobState

if TYPE_CHECKING:
    from tidal.coordinator.job import Job


class PhaseError(RuntimeError):
    """A move of the job's phase that ``TRANSITIONS`` does not allow."""


class Phase(Enum):
    """Where the job is in its life, as the coordinator's loop knows it (``Job.phase``;
    read from ``Job.state`` and ``Job.outcome``, the fields the records keep).

    Transitions (``TRANSITIONS``; ``tests/test_decisions.py`` tests the table):

    - ``PENDING`` -> ``RUNNING``: the first generation formed (``start_running``).
    - ``PENDING`` or ``RUNNING`` -> ``DECIDED``: the outcome is decided (``decide``):
      succeeded, failed or stopped. The loop winds the job down (``end_rules.wind_down``).
    - ``DECIDED`` -> ``DECIDED``: only a success overturned to a failure, when the final
      checkpoint the success counted on is reported failed (``decide(..., overturn=True)``).
    - ``DECIDED`` -> ``ENDED``: every process is gone; ``state`` reaches the outcome
      (``end``). ``ENDED`` is final; only its state may still say failed when the job's
      records could not be written (``records_broken``: a database that broke).
    """

    PENDING = "pending"  # no generation formed yet
    RUNNING = "running"  # a generation formed: training
    DECIDED = "decided"  # the outcome is decided: winding down
    ENDED = "ended"  # every process gone: the state is the outcome

    @staticmethod
    def of(state: JobState, outcome: JobState | None) -> Phase:
        if state.terminal:
            return Phase.ENDED
        if outcome is not None:
            return Phase.DECIDED
        return Phase.RUNNING if state == JobState.RUNNING else Phase.PENDING


#: The moves allowed from each phase (``Phase``'s docstring says what makes each).
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.PENDING: frozenset({Phase.RUNNING, Phase.DECIDED}),
    Phase.RUNNING: frozenset({Phase.DECIDED}),
    Phase.DECIDED: frozenset({Phase.DECIDED, Phase.ENDED}),
    Phase.ENDED: frozenset(),
}

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
