"""The coordinator's in-memory records of workers and generations."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.coordinator.records.snapshot import WorkerRow
from tidal.protocol import GenerationInfo, GenerationView, RecoveryPath, WorkerState
from tidal.store_keys import generation_prefix


@dataclass(kw_only=True)
class WorkerRecord:
    id: int
    state: WorkerState = WorkerState.STARTING
    pid: int | None = None
    host: str | None = None
    node: str | None = None
    rank: int | None = None
    last_heartbeat: float | None = None
    step: int = 0
    # What its last heartbeat said of its time in the script and its generation (``busy``).
    script_s: float | None = None
    beat_generation: int = 0
    # (step, generation) of its last holding heartbeat (``scale_rules.newer_forming``);
    # kept through plain heartbeats, which its other threads send while it holds.
    held: tuple[int, int] | None = None
    exit_code: int | None = None
    retired: bool = False  # asked to exit (scale-down, job end)
    kill_reason: str | None = None  # why the coordinator killed it, if it did
    stopping_since: float | None = None  # monotonic time it was asked to exit
    preempted: bool = False  # the coordinator sent it a preemption notice
    notice: str | None = None  # where the notice it announced came from (SIGTERM, a cloud's)
    # False for a worker a previous coordinator started, until it registers again with this
    # one (``recovery``): its calls are answered 409 (``ReRegister``) until then.
    adopted: bool = True

    @property
    def live(self) -> bool:
        # Identity, not ``in``: tested for every worker on every control-loop pass, and a
        # str-Enum's equality and hash are Python-level calls.
        return not (self.state is WorkerState.EXITED or self.state is WorkerState.FAILED)

    def ask_to_exit(self, now: float) -> None:
        """It is asked to exit: ``stopping``, no rank; ``now`` (monotonic) starts its grace
        period unless an earlier ask did (``exit_rules.to_kill``)."""
        self.state, self.rank = WorkerState.STOPPING, None
        if self.stopping_since is None:
            self.stopping_since = now

    def row(self) -> WorkerRow:
        """What SQLite holds of it, as a named tuple (1,024 pydantic views took ~50 ms of the
        loop's time a flush)."""
        return WorkerRow(
            id=self.id,
            pid=self.pid,
            host=self.host,
            state=self.state.value,
            rank=self.rank,
            last_heartbeat=self.last_heartbeat,
            exit_code=self.exit_code,
            node=self.node,
        )


#: A worker row whose only change is a newer ``last_heartbeat`` is rewritten once the saved
#: one is this old: the status's ``last_heartbeat`` lags the live one by at most this (plus
#: a flush interval); every other change is written at the next flush.
HEARTBEAT_SAVE_S = 5.0


def changed_rows(rows: list[WorkerRow], saved: dict[int, WorkerRow]) -> list[WorkerRow]:
    """The rows a flush must write, given what was last written (``saved``, by worker id).

    Contract: a row is written when it is new or any field other than ``last_heartbeat``
    differs; a heartbeat alone is written when the saved one is ``HEARTBEAT_SAVE_S`` behind
    or missing. So a flush costs the changes, not the job's size (at 1,024 workers, every
    row every 0.5 s held the server's heartbeats behind the loop for ~60 ms)."""
    out = []
    beat = WorkerRow._fields.index("last_heartbeat")  # the fields before and after it
    for row in rows:
        old = saved.get(row.id)
        if old == row:
            continue
        if (
            old is None
            or old[:beat] != row[:beat]
            or old[beat + 1 :] != row[beat + 1 :]
            or old.last_heartbeat is None
            or (
                row.last_heartbeat is not None
                and row.last_heartbeat - old.last_heartbeat >= HEARTBEAT_SAVE_S
            )
        ):
            out.append(row)
    return out


@dataclass(kw_only=True)
class GenerationRecord:
    id: int
    members: list[int]
    reason: str
    opened_at: float
    namespace: str  # the job's secret store namespace (``store_keys.generation_prefix``)
    committed_step: int = 0  # see ``GenerationInfo.committed_step``
    resume_from: str | None = None  # a checkpoint every member loads first (state lost)
    resume_step: int | None = None
    start_step: int | None = None
    pause_s: float | None = None
    pause_phases: dict[str, float] | None = None
    recovery: RecoveryPath | None = None  # the most severe its members reported
    redone_steps: int | None = None  # the most steps a member redid
    reported: set[int] = field(default_factory=set)
    # ``--torchrun``: when the world before it was stopped (wall time): its pause runs from
    # there to its process group's forming (``Effects.on_step_report``).
    stopped_at: float | None = None

    @property
    def store_prefix(self) -> str:
        return generation_prefix(self.namespace, self.id)

    @property
    def formed(self) -> bool:
        """True once a member completed a step in it."""
        return self.start_step is not None

    def member_set(self) -> frozenset[int]:
        """The members as a set (built once: membership is tested on every heartbeat)."""
        cached = self.__dict__.get("_member_set")
        if cached is None:
            cached = self.__dict__["_member_set"] = frozenset(self.members)
        return cached

    def info(self) -> GenerationInfo:
        return GenerationInfo(
            id=self.id,
            members=self.members,
            store_prefix=self.store_prefix,
            reason=self.reason,
            committed_step=self.committed_step,
            resume_from=self.resume_from,
            resume_step=self.resume_step,
        )

    def view(self) -> GenerationView:
        return GenerationView(
            id=self.id,
            world_size=len(self.members),
            members=self.members,
            start_step=self.start_step,
            reason=self.reason,
            pause_s=self.pause_s,
            opened_at=self.opened_at,
            pause_phases=self.pause_phases,
            recovery=self.recovery,
            redone_steps=self.redone_steps,
        )


@dataclass(frozen=True, kw_only=True)
class ReformRequest:
    """A member reported a failed collective in ``generation`` (the first report of it);
    ``reporters``: the members that have reported one in it since (the first included)."""

    at: float  # monotonic time of the report
    generation: int
    why: str  # the reason of the generation that answers it
    worker_id: int
    step: int  # the step the worker reported (its committed step count)
    error: str  # its error as reported (``repeated_failure`` quotes its first line)
    reporters: frozenset[int] = frozenset()


@dataclass(frozen=True, kw_only=True)
class Resume:
    """Where a resumed job starts: a verified checkpoint, and why newer ones were refused."""

    path: str
    step: int
    warnings: list[str] = field(default_factory=list)
    # The previous run's workers ``tidal resume`` ended first (``fencing``), one line each.
    ended: list[str] = field(default_factory=list)
