"""The job as the control loop knows it: one dataclass, the only place its state lives.

The coordinator holds one ``Job``; its handlers, the control loop's passes and a restarted
coordinator's recovery (``recovery.rebuild``) read and change it, always under the
coordinator's lock, and what of it must outlive a crash is written by the executor's
journal (``journal.Journal``: the job, worker and generation rows; ``control``: the
``recovery.Control`` record). Nothing else holds a copy that could drift: the answers
workers read (``answers.Answers``) and the dashboard's view (``views.LiveView``) are
snapshots published from it at the end of each pass.

What is *not* here: the coordinator's plumbing (the store, the backend, the lock, timers of
its own loop) and the accounting of capacity and cost (``accounting.Accounting``, its own
state over time).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import NamedTuple

from tidal.coordinator.records.records import GenerationRecord, ReformRequest, WorkerRecord
from tidal.coordinator.records.step_metrics import StepLog
from tidal.protocol import JobState

#: Marks a field a restarted coordinator needs and the job's rows do not hold: it is written
#: in the ``control`` record under its own name (``recovery.control_of``, one diff a write:
#: ``Ledger.save_control``) and read back from it (``lifecycle.recovered_job``). Each is a
#: field of ``recovery.Control`` (tested); ``outcome`` and ``stop_requested_at`` are kept
#: there too, in another form.
DURABLE = {"durable": True}


def durable_fields() -> tuple[str, ...]:
    """The names of ``Job``'s durable fields (``DURABLE``)."""
    return tuple(f.name for f in fields(Job) if f.metadata.get("durable"))


class PhaseError(RuntimeError):
    """A move of the job's phase that ``TRANSITIONS`` does not allow."""


class Phase(Enum):
    """Where the job is in its life, as the coordinator's loop knows it (``Job.phase``;
    read from ``Job.state`` and ``Job.outcome``, the fields the records keep).

    Transitions (``TRANSITIONS``; ``tests/test_decisions.py`` tests the table):

    - ``PENDING`` -> ``RUNNING``: the first generation formed (``phase.start_running``).
    - ``PENDING`` or ``RUNNING`` -> ``DECIDED``: the outcome is decided (``phase.decide``):
      succeeded, failed or stopped. The loop winds the job down (``end_rules.wind_down``).
    - ``DECIDED`` -> ``DECIDED``: only a success overturned to a failure, when the final
      checkpoint the success counted on is reported failed (``phase.decide(..., overturn=True)``).
    - ``DECIDED`` -> ``ENDED``: every process is gone; ``state`` reaches the outcome
      (``phase.end``). ``ENDED`` is final; only its state may still say failed when the job's
      records could not be written (``phase.records_broken``: a database that broke).
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


class Streak(NamedTuple):
    """The failed collectives in a row at one committed step (``repeated_failure``);
    a plain tuple, so the coordinator's ``control`` record keeps it as a JSON list."""

    step: int  # the job's committed step when they failed
    count: int  # failed collectives at that step, in a row, each answered by a re-form
    last: str  # the last one's report: "worker 1: RuntimeError: ..."


@dataclass(frozen=True, kw_only=True)
class ScriptStop:
    """The job's early stop, as its first report fixed it. ``worker_id``: the member that
    reported first and writes the final checkpoint (when ``checkpoint``: it can write one
    alone); ``members``: its generation's members, whose exits decide the outcome."""

    worker_id: int
    step: int
    generation: int
    members: tuple[int, ...]
    checkpoint: bool = True


@dataclass(kw_only=True)
class Job:
    """``requested``: what was asked (``--workers``, ``tidal scale``, the schedule, the
    policy); ``target``: that within the capacity available now. ``step``: the highest
    committed step any worker reported. ``outcome``: decided; ``state`` reaches it once
    every process is gone. Both change only through ``phase`` (``decide``, ``start_running``,
    ``end``)."""

    target: int
    requested: int = field(metadata=DURABLE)
    created: float
    step: int = 0
    state: JobState = JobState.PENDING
    target_changed_at: float | None = None  # monotonic
    metrics: dict[str, float] = field(default_factory=dict)
    step_log: StepLog = field(default_factory=StepLog)  # per-step values of tidal.log
    leaving: list[int] = field(default_factory=list)  # workers that got a preemption notice
    workers: dict[int, WorkerRecord] = field(default_factory=dict)
    generations: list[GenerationRecord] = field(default_factory=list)
    failures: int = field(default=0, metadata=DURABLE)  # lost workers, against --max-restarts
    #: Wall times of the latest losses, as many as a rate of --max-restarts needs.
    loss_times: list[float] = field(default_factory=list, metadata=DURABLE)
    outcome: JobState | None = None
    #: Why, in the words of the rule that decided it (None: a ``tidal stop``, or none yet):
    #: what ``tidal run`` prints at the end, read from here, not parsed back from events.
    outcome_why: str | None = field(default=None, metadata=DURABLE)
    stop_requested_at: float | None = None  # monotonic
    #: A member's collective failed in the latest generation: re-form it.
    reform_requested: ReformRequest | None = None
    #: The failed collectives in a row at one committed step (``reform_rules.repeated_failure``).
    failed_collectives: Streak | None = field(default=None, metadata=DURABLE)
    #: (generation, why): healing found no member of that generation holding the state.
    state_lost: tuple[int, str] | None = None
    #: The job's length (``Trainer.run(max_steps)``) as the first worker registered it.
    job_length: int | None = field(default=None, metadata=DURABLE)
    #: Checkpoints of this run that could not be written: step -> the error (one line).
    checkpoint_failed: dict[int, str] = field(default_factory=dict, metadata=DURABLE)
    #: Steps whose checkpoint this run recorded.
    checkpointed: set[int] = field(default_factory=set)
    #: (worker, step): a member completed the job's last step; with durable checkpoints the
    #: job succeeds once that step's checkpoint is recorded (``end_rules.final_checkpoint``).
    completing: tuple[int, int] | None = field(default=None, metadata=DURABLE)
    schedule_done: int = field(default=0, metadata=DURABLE)  # --schedule entries applied
    schedule_applied_at: float = 0.0  # monotonic, the last of them
    #: The last --schedule step whose membership is in place (members holding there go on);
    #: None: none yet.
    settled_step: int | None = field(default=None, metadata=DURABLE)
    wind_down_since: float | None = None  # monotonic: the outcome's wind-down began
    #: A member's script stopped the job early (``stop_rules``): no change after it.
    script_stop: ScriptStop | None = None
    #: Members alive and busy in their script, outside the collectives (``busy``).
    busy: frozenset[int] = frozenset()
    #: ``--torchrun`` (``worlds``): why the latest world restarts (a member lost, a change),
    #: the next world's reason; and when it was stopped (wall time): its pause's start.
    restart_why: str | None = None
    world_stopped_at: float | None = None

    @property
    def phase(self) -> Phase:
        """Where the job is in its life (``phase.Phase``, whose docstring has the moves)."""
        return Phase.of(self.state, self.outcome)

    @property
    def latest(self) -> GenerationRecord | None:
        return self.generations[-1] if self.generations else None

    @property
    def members(self) -> list[int]:
        return list(self.latest.members) if self.latest else []

    def formed(self) -> GenerationRecord | None:
        """The newest generation that formed (a member reported its first step)."""
        return next((g for g in reversed(self.generations) if g.formed), None)

    def world_size(self) -> int:
        formed = self.formed()
        return len(formed.members) if formed is not None and self.outcome is None else 0
