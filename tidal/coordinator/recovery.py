"""What a restarted coordinator knows: the job's rows in SQLite, read back into records.

A coordinator writes the job's rows (``db``) as it goes, and beside them a ``Control``
record: what the rows do not hold but the control loop needs (the requested count, the
failures so far and the times of the latest, for a rate of ``--max-restarts``, the job's
length, the schedule's progress, a decided outcome, the latest generation's committed
step, why workers were asked to leave, the failed collectives in a row at one step).
``rebuild`` turns both into
the records a new coordinator starts from; it is pure, so every rule has a table test.

Rules (the new coordinator then applies them, see ``lifecycle.recovered_job`` and ``Lifecycle.adopt``):

- Every worker that was live (not exited or failed) is kept, awaiting its re-registration
  (``WorkerRecord.adopted`` False: its calls are answered 409 until it registers again).
  Its heartbeat clock restarts now: one that does not come back within the heartbeat
  timeout is killed as hung, like any silent worker.
- The latest generation stays current if it had formed (a member completed a step in it):
  its members train on through the restart and nothing is redone. One that had not formed
  is re-opened with the same members: its rendezvous was in the dead coordinator's store.
- A decided outcome (the job succeeded, failed or was stopped, and was winding down) stays
  decided: the new coordinator finishes the wind-down.
- A member the dead coordinator retired (a leaver, a scale-down) is in no generation the new
  one keeps: the retirement is recorded before the generation without it, so a coordinator
  killed between the two left a formed generation that still names it, and nothing would
  open one without it (``regenerate``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from tidal.coordinator.job import Streak
from tidal.coordinator.records.records import GenerationRecord, WorkerRecord
from tidal.protocol import JobState, JobStatus, WorkerState

if TYPE_CHECKING:
    from tidal.coordinator.job import Job


@dataclass(kw_only=True)
class WorkerFlags:
    retired: bool = False
    preempted: bool = False
    kill_reason: str | None = None


@dataclass(kw_only=True)
class Control:
    """The control loop's state that the rows of ``db`` do not hold (``jobs.control``)."""

    requested: int
    failures: int = 0
    loss_times: list[float] = field(default_factory=list)  # ``Job.loss_times``
    job_length: int | None = None
    settled_step: int | None = None  # ``Job.settled_step``
    schedule_done: int = 0
    stop_requested: bool = False
    outcome: str | None = None  # a decided ``JobState``, not yet reached
    outcome_why: str | None = None  # ``Job.outcome_why``
    completing: tuple[int, int] | None = None  # (worker, step): awaiting the final checkpoint
    checkpoint_failed: dict[int, str] = field(default_factory=dict)
    # The failed collectives in a row at one step (``reform_rules.repeated_failure``): the count
    # goes on across a restart (a record of an older coordinator has none: it starts at 0).
    failed_collectives: Streak | None = None
    committed_step: int = 0  # the latest generation's
    resume_from: str | None = None
    resume_step: int | None = None
    workers: dict[int, WorkerFlags] = field(default_factory=dict)  # only non-default flags

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Control:
        data = dict(data)
        data["checkpoint_failed"] = {
            int(k): v for k, v in data.get("checkpoint_failed", {}).items()
        }
        data["workers"] = {int(k): WorkerFlags(**v) for k, v in data.get("workers", {}).items()}
        if data.get("settled_step") == -1:  # a record of an older coordinator: none yet
            data["settled_step"] = None
        if data.get("completing") is not None:
            data["completing"] = tuple(data["completing"])
        if data.get("failed_collectives") is not None:
            data["failed_collectives"] = Streak(*data["failed_collectives"])
        return cls(**data)


def control_of(job: Job) -> Control:
    """The ``Control`` record of ``job`` now: its durable fields (``job.DURABLE``) under
    their own names, and what else a restarted coordinator needs that the rows do not hold
    (the flags only of live workers that have one)."""
    from tidal.coordinator.job import durable_fields  # at call time: job -> phase -> here

    latest = job.latest
    flags = {
        w.id: WorkerFlags(retired=w.retired, preempted=w.preempted, kill_reason=w.kill_reason)
        for w in job.workers.values()
        if w.live and (w.retired or w.preempted or w.kill_reason)
    }
    durable = {name: getattr(job, name) for name in durable_fields()}
    return Control(
        **durable,
        stop_requested=job.stop_requested_at is not None,
        outcome=job.outcome.value if job.outcome else None,
        committed_step=latest.committed_step if latest else 0,
        resume_from=latest.resume_from if latest else None,
        resume_step=latest.resume_step if latest else None,
        workers=flags,
    )


@dataclass(kw_only=True)
class Rebuilt:
    workers: dict[int, WorkerRecord]
    generations: list[GenerationRecord]
    reopen: bool  # the latest generation had not formed: open it again
    state: JobState
    outcome: JobState | None
    step: int
    control: Control


LIVE = (
    WorkerState.PENDING,
    WorkerState.STARTING,
    WorkerState.STANDBY,
    WorkerState.RUNNING,
    WorkerState.STOPPING,
)


def rebuild(status: JobStatus, control: Control, *, namespace: str, now: float) -> Rebuilt:
    """The records a restarted coordinator starts from (see the module's rules). ``now``:
    wall time, the restart of every heartbeat clock; ``namespace``: the new store's."""
    workers: dict[int, WorkerRecord] = {}
    for v in status.workers:
        flags = control.workers.get(v.id, WorkerFlags())
        live = v.state in LIVE
        workers[v.id] = WorkerRecord(
            id=v.id,
            state=v.state,
            pid=v.pid,
            host=v.host,
            node=v.node,
            rank=v.rank,
            last_heartbeat=now if live else v.last_heartbeat,
            exit_code=v.exit_code,
            retired=flags.retired,
            preempted=flags.preempted,
            kill_reason=flags.kill_reason,
            adopted=not live,
        )
    generations = [
        GenerationRecord(
            id=g.id,
            members=list(g.members),
            reason=g.reason,
            opened_at=g.opened_at,
            namespace=namespace,
            start_step=g.start_step,
            pause_s=g.pause_s,
            pause_phases=g.pause_phases,
            recovery=g.recovery,
            redone_steps=g.redone_steps,
        )
        for g in status.generations
    ]
    if generations:
        latest = generations[-1]
        latest.committed_step = control.committed_step
        latest.resume_from, latest.resume_step = control.resume_from, control.resume_step
    outcome = JobState(control.outcome) if control.outcome else None
    reopen = bool(generations) and not generations[-1].formed and outcome is None
    return Rebuilt(
        workers=workers,
        generations=generations,
        reopen=reopen,
        state=JobState(status.state),
        outcome=outcome,
        step=status.step,
        control=control,
    )


def regenerate(
    *, members: list[int], formed: bool, live: set[int], retired: set[int]
) -> tuple[list[int], str] | None:
    """The generation a restarted coordinator opens after adopting the workers, if any:
    (its members, why). One that had not formed is re-opened with its live members (its
    rendezvous was in the dead coordinator's store); a formed one that names a retired
    member is replaced by one without it (module doc). None: the latest generation stays."""
    keep = [m for m in members if m in live and m not in retired]
    if not formed:
        return keep, "re-formed: the coordinator restarted before the generation formed"
    gone = sorted(set(members) & retired)
    if gone:
        who = ", ".join(map(str, gone))
        return keep, f"worker(s) {who} left: retired by the coordinator before it restarted"
    return None
