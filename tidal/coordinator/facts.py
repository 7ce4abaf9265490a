"""What the coordinator is told: the facts its API calls bring, as values.

Every API call that changes the job becomes one of these and joins the coordinator's inbox
(``Handlers._submit``); the inbox is applied in arrival order, by the control loop or by the
caller itself under the lock, whichever comes first (``Handlers.drain``), and each fact's
effect on the job is one method (``Handlers._apply``). So a worker's facts apply in the
order it sent them, whatever thread answered it, and there is one door through which the
job's state changes from outside. A call that needs an answer (a registration, a refusal)
waits for its fact to be applied and gets the result; a quick heartbeat is answered at once
from the published answers and applied by the next pass.

The backend's reports (exits, placement) are facts too, read by the loop itself from the
backend (``Backend.poll``), and the loop's own observations (silence, the clock) are taken
where the rules need them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.protocol import (
    DoneReport,
    FailureReport,
    HeartbeatRequest,
    RegisterRequest,
    StopReport,
)


@dataclass(frozen=True)
class Registered:
    """A worker registered (first time, or again with a restarted coordinator)."""

    worker_id: int
    request: RegisterRequest


@dataclass(frozen=True)
class Beat:
    """A heartbeat: the worker's step, metrics, and any reports it carries."""

    worker_id: int
    request: HeartbeatRequest


@dataclass(frozen=True)
class FailureReported:
    """A member's collective (or heal) failed in a generation."""

    worker_id: int
    report: FailureReport


@dataclass(frozen=True)
class Done:
    """A worker's training loop ended (completed, stopped, or told to exit)."""

    worker_id: int
    report: DoneReport


@dataclass(frozen=True)
class ScriptStopped:
    """A member's script ended the job early (``trainer.stop()``, ``break``): ``stop_rules``."""

    worker_id: int
    report: StopReport


@dataclass(frozen=True)
class ScaleRequested:
    """``tidal scale N`` (already within ``--min-workers`` and ``--max-workers``)."""

    workers: int


@dataclass(frozen=True)
class StopRequested:
    """``tidal stop``."""


@dataclass(frozen=True)
class Refused:
    """A worker's call was refused at the API's edge (invalid values): an event says why."""

    worker_id: int
    message: str


Fact = (
    Registered
    | Beat
    | FailureReported
    | Done
    | ScriptStopped
    | ScaleRequested
    | StopRequested
    | Refused
)
