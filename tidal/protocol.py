"""The wire messages between the CLI, the coordinator and the workers.

All three import this module and nothing else of each other's: a worker imports the
coordinator's client, never its server. Every message is a pydantic model so that FastAPI
validates what arrives and the OpenAPI spec documents it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from dataclasses import dataclass, fields
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, Field, PlainSerializer

from tidal.preemption import DEFAULT_POLL_S

if TYPE_CHECKING:
    from tidal.config import JobSpec

API_PREFIX = "/api/v1"
TOKEN_HEADER = "Authorization"


def worker_token(job_token: str, worker_id: int) -> str:
    """One worker's credential: HMAC-SHA256 of ``worker:ID`` keyed by the job's token (hex).
    A worker holds only its own, so it can speak for no other worker, nor scale or stop the
    job (those need the job's token)."""
    msg = f"worker:{worker_id}".encode()
    return hmac.new(job_token.encode(), msg, hashlib.sha256).hexdigest()


# -- bounds of what the API accepts (FastAPI answers 422 outside them) ----------------------
MAX_STEP = 2**62  # steps, byte counts: SQLite holds signed 64-bit integers
MAX_ID = 2**31 - 1  # worker and generation ids, pids, worker counts
MAX_TIME = 1e11  # seconds: wall-clock times and durations

Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Id = Annotated[int, Field(ge=0, le=MAX_ID)]
Seconds = Annotated[float, Field(ge=-MAX_TIME, le=MAX_TIME, allow_inf_nan=False)]


def wire_float(value: float) -> float | str:
    """JSON has no NaN or infinity: they travel as the strings ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"`` (what Python's ``float()`` and JavaScript's ``Number()`` read back)."""
    if math.isfinite(value):
        return float(value)  # an int logged as a metric: a float, as the field says
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


#: A metric the script logs: any float, NaN and infinities included (a diverged loss is a
#: fact worth showing); JSON carries the non-finite ones as strings (``wire_float``).
MetricValue = Annotated[float, PlainSerializer(wire_float, when_used="json")]
MetricName = Annotated[str, Field(min_length=1, max_length=200)]
MAX_METRICS = 1000


class JobState(str, Enum):
    """Life of a job.

    ``pending`` -> ``running`` when the first generation forms.
    ``running`` -> ``succeeded`` when the members finish the script's steps and exit 0;
    ``failed`` when no worker is left to train, or the script raised;
    ``stopped`` after ``tidal stop``.
    ``interrupted`` is never written by a coordinator: ``tidal status`` reports it for a job
    whose records say pending/running while no coordinator answers (the coordinator died).
    """

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    INTERRUPTED = "interrupted"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


class WorkerState(str, Enum):
    """Life of one worker process.

    ``pending`` (asked of the backend, which has no room for it yet: on Ray, no node can
    take its resource request; it starts when one can) -> ``starting`` (process launched,
    importing torch, not yet registered) -> ``standby``
    (registered and warmed up, not a member) -> ``running`` (member of the current
    generation). A member removed by a scale-down goes back to ``standby`` when a scheduled
    scale-up will need it again, else to ``stopping`` and ``exited``. A process that exits
    without being asked, or that misses heartbeats and is killed, is ``failed``; so is a
    worker whose script raised. Nothing leaves ``exited`` or ``failed``.
    """

    PENDING = "pending"
    STARTING = "starting"
    STANDBY = "standby"
    RUNNING = "running"
    STOPPING = "stopping"
    EXITED = "exited"
    FAILED = "failed"


class Role(str, Enum):
    """What the coordinator wants a registered worker to do now."""

    MEMBER = "member"  # train in ``generation``
    STANDBY = "standby"  # stay warm, outside any process group
    EXIT = "exit"  # leave the training loop and exit 0


class GenerationInfo(BaseModel):
    """One membership epoch: its members in rank order and the store prefix they meet on.

    A generation is opened by the coordinator in the rendezvous store with the state
    ``open``; the member whose arrival completes the count sets it to ``go``; the coordinator
    sets an ``open`` generation it supersedes to ``abandoned``. Exactly one of the two wins
    (compare-and-set), so either every member forms the group or every member moves on.
    """

    id: int
    members: list[int]
    store_prefix: str
    reason: str
    # The highest step the coordinator knows a worker committed when it opened the
    # generation (a lower bound: heartbeats lag). Members are at most one step apart, so a
    # generation whose most advanced member is more than one step behind it holds nobody
    # with the job's state: healing refuses to train it from scratch (``heal.StateLost``).
    committed_step: int = 0
    # Set when no live worker held the job's state: every member loads this verified
    # checkpoint (of step ``resume_step``) before healing, and the steps after it are redone.
    resume_from: str | None = None
    resume_step: int | None = None


class WorkerConfig(BaseModel):
    """Runtime settings the coordinator hands a worker at registration (``from_spec``).

    ``hold_steps`` are the steps of ``--schedule``: a member that has committed one of them
    waits there until the coordinator has settled the membership the schedule asks for
    (``HeartbeatResponse.settled_step``), so scripted changes happen at exactly those steps.
    """

    heartbeat_interval_s: float
    collective_timeout_s: float
    store_host: str
    store_port: int
    # Every store key of the job lives under it (``store_keys.generation_prefix``); it
    # keeps jobs and coordinators apart, it is no secret (a store client can list keys).
    store_namespace: str
    # The job's store key, hex (``store_auth.derive_key`` of the job's token): every value a
    # member reads from the store is authenticated with it (``store_auth.AuthStore``). Only
    # authenticated workers receive it (in their registration answer); never shown.
    store_key: str = Field(repr=False, min_length=64, max_length=64)
    hold_steps: list[int] = Field(default_factory=list)
    checkpoint_dir: str | None = None  # None: no durable checkpoints
    # The run that owns ``checkpoint_dir`` (``checkpoint.fence``): writes of a run that a
    # ``tidal resume`` replaced, or of a job that ended, are refused. None: not fenced.
    checkpoint_fence: str | None = None
    checkpoint_every: int | None  # None: no step-based checkpoints
    checkpoint_interval_s: float | None
    keep_checkpoints: int
    resume_from: str | None = None  # a verified checkpoint every worker loads at start
    # A worker that reaches no coordinator for this long exits (its job was interrupted and
    # nobody else will stop it); meanwhile it trains on in its generation (``tidal attach``).
    orphan_timeout_s: float
    # The process groups' backend, ``--comm``: nccl, gloo, or auto (nccl where the worker
    # has CUDA). A default, so a worker and a coordinator of different versions still agree.
    comm: Literal["nccl", "gloo", "auto"] = "auto"
    # The job's name: the same in every worker, through resizes and ``tidal resume`` (the
    # stable run id a tracker needs: ``Trainer.job_name``). A default, as ``comm``.
    name: str | None = None
    # ``--preemption-notice`` (None: SIGTERM only) and its polling period (``cloud_watch``).
    preemption_notice: str | None = None
    preemption_poll_s: float = DEFAULT_POLL_S
    # ``--max-restarts`` as given (a count, ``N/h`` or ``unlimited``): a ``--torchrun``
    # script's ``TORCHELASTIC_MAX_RESTARTS`` (``worker.torchrun``). A default, as ``comm``.
    max_restarts: int | str | None = None

    @classmethod
    def from_spec(cls, spec: JobSpec, **runtime: object) -> WorkerConfig:
        """The one place a worker's settings are drawn from its job: every field named as a
        ``JobSpec`` field takes the spec's value, ``hold_steps`` its schedule's steps;
        ``runtime`` is what the coordinator chose (the store's address, namespace and key, the
        checkpoint folder, a checkpoint to resume from)."""
        names = {f.name for f in fields(spec)} & set(cls.model_fields)
        shared = {name: getattr(spec, name) for name in names}
        shared["heartbeat_interval_s"] = spec.beat_interval_s
        if spec.share_gpus and spec.comm == "auto":
            # NCCL cannot hold two members of one group on one GPU: sharing means gloo.
            shared["comm"] = "gloo"
        return cls(**shared, hold_steps=[at for at, _ in spec.schedule], **runtime)


class RegisterRequest(BaseModel):
    """``max_steps``: the length of the job, ``Trainer.run(max_steps)``; the coordinator
    records the first one it is told and decides completion against it."""

    pid: Id
    host: str = Field(max_length=255)
    max_steps: Step | None = None
    # A worker that registers again (its coordinator was restarted: ``ReRegister``) says where
    # it stands: the generation it trains in (0: none yet) and its committed step.
    generation: Id = 0
    step: Step = 0


class RegisterResponse(BaseModel):
    """``saved_step_metrics``, to a worker that registers again (its coordinator restarted):
    ``(generation, step)`` such that the job's records hold every per-step record
    (``StepMetrics``) of this worker below that key; it sends those it delivered from that
    key on again, which the dead coordinator may have taken without writing them down (None:
    every one it kept). See ``tidal.worker.agent.client``."""

    job: str
    config: WorkerConfig
    saved_step_metrics: tuple[Id, Step] | None = None


#: The phases of a member's pause between its last step in one generation and its first step
#: in the next, in order: ``leave_s`` until it left the old generation (a hold at a scheduled
#: step, or the step whose collective failed), ``rendezvous_s`` until every member of the new
#: one arrived, ``form_s`` the process group's creation, ``heal_s`` the state transfer (and
#: the DDP wrapper), ``first_step_s`` the first step in the new generation.
PAUSE_PHASES = ("leave_s", "rendezvous_s", "form_s", "heal_s", "first_step_s")


class RecoveryPath(str, Enum):
    """How a generation's members came to hold the job's state, least to most severe (the
    order of declaration; the coordinator keeps a generation's most severe, ``rules``).

    ``none``: they already held the same state, nothing moved (a scale-down under DDP).
    ``heal``: DDP, the state broadcast from the most advanced member.
    ``reshard``: FSDP, the live shards moved to the new layout; nothing redone.
    ``neighbour_copy``: FSDP, a lost member's shard rebuilt from the copy its ring
    neighbour kept in memory; every member rolled back to the copy's step.
    ``checkpoint``: rolled back to a durable checkpoint.
    """

    NONE = "none"
    HEAL = "heal"
    RESHARD = "reshard"
    NEIGHBOUR_COPY = "neighbour_copy"
    CHECKPOINT = "checkpoint"


class StepReport(BaseModel):
    """Timing facts a member sends when it completes its first step in a generation, and
    how its state was recovered (``recovery``; None from a worker that predates it) and the
    steps it redoes (``redone_steps``: its committed step before the change minus the step
    the generation starts from)."""

    generation: Id
    start_step: Step
    prev_generation: Id | None = None  # generation of this worker's previous step
    prev_last_step_time: Seconds | None = None
    first_step_time: Seconds
    # Where this member's pause went, in seconds (keys: see ``PAUSE_PHASES``); they add up to
    # first_step_time - prev_last_step_time.
    phases: dict[Annotated[str, Field(max_length=32)], Seconds] = Field(
        default_factory=dict, max_length=len(PAUSE_PHASES)
    )
    recovery: RecoveryPath | None = None
    redone_steps: Step = 0


class CheckpointView(BaseModel):
    step: Step
    path: str = Field(max_length=4096)
    bytes: Step | None = None
    seconds_to_write: Seconds | None = None


class CheckpointFailure(BaseModel):
    """A checkpoint a worker could not write (the step, and the error in one line)."""

    step: Step
    error: str = Field(max_length=2000)


#: Per-step records one heartbeat carries at most; a worker's outbox holds more and sends them
#: over the next heartbeats (``tidal.worker.agent.client``).
MAX_STEP_RECORDS = 1000
#: The longest a coordinator keeps a holding heartbeat's answer back (``HeartbeatRequest``);
#: well inside any client's timeout, and a member whose hold is not settled by then asks again.
HOLD_ANSWER_S = 0.25


class StepMetrics(BaseModel):
    """What ``tidal.log`` recorded for one step (the step in flight, or after the loop the
    job's final step count) in one generation. The coordinator keeps one value per (step,
    name): the newest generation's (a step redone after a failure replaces what its first
    attempt logged), averaged over the members of that generation that reported it (only
    rank 0 reports unless the script asked ``reduce="mean"``)."""

    step: Step
    generation: Id
    values: dict[MetricName, MetricValue] = Field(max_length=MAX_METRICS)


class StepSeries(BaseModel):
    """One metric's per-step series, columnar (``tidal status --json --history``)."""

    step: list[int] = Field(default_factory=list)
    value: list[MetricValue] = Field(default_factory=list)


class Departure(BaseModel):
    """A member left a scheduled change before its update of ``step`` in ``generation``,
    that step uncommitted (``worker.leaving``): the coordinator records it as an event of
    kind ``leave`` (what ``bench.chaos`` counts, read from the job's events)."""

    step: Step
    generation: Id
    why: str = Field(max_length=300)


class HeartbeatRequest(BaseModel):
    """``leaving``: the worker got a preemption notice (SIGTERM, or its cloud's metadata:
    ``notice`` says which) and asks to leave at the
    next step boundary, a planned leave rather than a failure. ``holding``: the member has
    committed ``step``, one of ``WorkerConfig.hold_steps``, and waits there; the coordinator
    answers once it has settled that step, or changed the generation, stopped or ended the
    job, or after at most ``HOLD_ANSWER_S`` (a long poll: no second round trip).
    ``approaching``: the member is about to commit ``step``, the step before one of
    ``hold_steps``; answered as a holding heartbeat of the next step is, so the coordinator
    applies that scheduled change one step early (``scale_rules.schedule_ahead``) and the member
    learns its place in the next generation while it runs its last step before it."""

    step: Step = 0
    generation: Id = 0
    leaving: bool = False
    # Where the notice came from: "SIGTERM", or the cloud's words (``--preemption-notice``).
    notice: str | None = Field(default=None, max_length=200)
    holding: bool = False
    approaching: bool = False
    # Seconds this member has been in the script outside Tidal's collectives (its step's
    # all-reduce, a heal) while a member of a formed group; None otherwise (``busy``).
    script_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    metrics: dict[MetricName, MetricValue] = Field(default_factory=dict, max_length=MAX_METRICS)
    reports: list[StepReport] = Field(default_factory=list, max_length=1000)
    checkpoints: list[CheckpointView] = Field(default_factory=list, max_length=1000)
    checkpoint_failures: list[CheckpointFailure] = Field(default_factory=list, max_length=1000)
    step_metrics: list[StepMetrics] = Field(default_factory=list, max_length=MAX_STEP_RECORDS)
    departures: list[Departure] = Field(default_factory=list, max_length=100)

    @property
    def held_at(self) -> int | None:
        """The scheduled step whose settling this heartbeat's answer waits for (``holding``:
        its own step; ``approaching``: the next); None for a plain heartbeat."""
        if self.holding:
            return self.step
        return self.step + 1 if self.approaching else None


class HeartbeatResponse(BaseModel):
    """``interval_s``: when to send the next heartbeat, if the coordinator paces them (None:
    the ``WorkerConfig.heartbeat_interval_s`` of the registration). Members learn of a
    change through the store (``notice_key``), so a large generation's members can each
    beat less often without learning of it later; see docs/benchmarks.md, "Control plane
    capacity"."""

    role: Role
    generation: GenerationInfo | None = None
    stop: bool = False
    # The newest ``--schedule`` step whose membership is settled: members held there go on
    # (``Membership.hold``); None before any.
    settled_step: int | None = None
    interval_s: float | None = Field(default=None, gt=0, le=3600, allow_inf_nan=False)
    # A member's script stopped the job (``StopReport``): every member ends at this step, and
    # only the worker told so (``StopAnswer.writer``) writes the final checkpoint.
    stop_step: int | None = None
    # Members of the formed generation known alive and busy in the script, outside Tidal's
    # collectives (an evaluation, a save): a peer waiting for them in a collective does not
    # give up at the collective timeout (``tidal.worker.membership.watch``).
    busy: list[int] = Field(default_factory=list)


class FailureKind(str, Enum):
    """Why a member left a generation it was forming or training in."""

    COLLECTIVE = "collective"  # a collective (or the forming) failed: a peer died or hung
    STATE_LOST = "state_lost"  # healing found no member holding the job's committed state
    # This member's script set up the job differently from the others': its model (the
    # heal's ``ModelMismatch``) or its data split (``identity.ScriptMismatch``). No re-form
    # can mend it; the job fails saying so.
    SCRIPT_MISMATCH = "script_mismatch"
    # A value read from the rendezvous store was not authenticated by the job's store key
    # (``store_auth.ForgedValue``, naming the key): refused, never acted on; the coordinator
    # records it as a security event and re-forms, as after a failed collective.
    FORGED_STORE = "forged_store"


class FailureReport(BaseModel):
    generation: Id
    step: Step
    error: str = Field(max_length=2000)
    kind: FailureKind = FailureKind.COLLECTIVE


class DoneReport(BaseModel):
    """``completed``: the worker reached the job's ``max_steps``. The coordinator decides
    success only from a member of the current generation whose ``step`` reaches the length
    registered for the job (``RegisterRequest.max_steps``), never from the flag alone."""

    step: Step
    completed: bool


class StopReport(BaseModel):
    """A member's script ended the job early (``trainer.stop()``, or ``break`` out of
    ``trainer.run``) with ``step`` steps committed in ``generation``; sent before it leaves
    its group, so its peers find the stop when their next collective fails. ``writes``: it
    can write the job's final checkpoint alone (False under ``sharding="fsdp"``)."""

    generation: Id
    step: Step
    writes: bool = True


class StopAnswer(BaseModel):
    """``step``: the step the job stops at (the first report's), None when the report did
    not stop the job (its outcome was already decided, or the reporter was no member of
    the current generation); ``writer``: this worker writes the final checkpoint."""

    step: Step | None = None
    writer: bool = False


class ScaleRequest(BaseModel):
    workers: Annotated[int, Field(strict=True, ge=0, le=MAX_ID)]  # 2.0, "2", true: refused


class WorkerView(BaseModel):
    id: int
    rank: int | None
    pid: int | None
    state: WorkerState
    host: str | None = None
    node: str | None = None  # where the backend placed it: a host, or a Ray node id
    last_heartbeat: float | None = None
    exit_code: int | None = None


class GenerationView(BaseModel):
    id: int
    world_size: int
    members: list[int]
    start_step: int | None
    reason: str
    pause_s: float | None
    opened_at: float
    # The phases of the largest pause (the member whose pause is ``pause_s``).
    pause_phases: dict[str, float] | None = None
    # The most severe recovery its members reported, and the most steps one redid (None:
    # no member said, e.g. a worker of an older version).
    recovery: RecoveryPath | None = None
    redone_steps: int | None = None


class EventView(BaseModel):
    time: float
    kind: str
    message: str


class JobStatus(BaseModel):
    """What ``tidal status --json`` prints (DESIGN.md section 4)."""

    name: str
    state: JobState
    step: int
    world_size: int
    target_workers: int
    pending_workers: int = 0  # asked for, waiting for room in the cluster (state pending)
    # Warm workers outside the generation (state standby; billed) and how many ``--spares``
    # asks to keep: a scale-up or a replacement takes one at the next step.
    standby_workers: int = 0
    spares: int = 0
    min_workers: int
    max_workers: int
    script: str
    created: float
    url: str | None = None
    workers: list[WorkerView] = Field(default_factory=list)
    generations: list[GenerationView] = Field(default_factory=list)
    events: list[EventView] = Field(default_factory=list)
    metrics: dict[str, MetricValue] = Field(default_factory=dict)  # NaN etc.: see wire_float
    checkpoints: list[CheckpointView] = Field(default_factory=list)
    # Checkpoints of this job that could not be written, and the last one's error.
    checkpoint_failures: int = 0
    last_checkpoint_error: str | None = None
    # The job's coordinator is alive (it holds the job's lock) but did not answer: ``state`` is
    # then what it last recorded (pending or running), never ``interrupted``.
    coordinator_unresponsive: bool = False
    cost: float = 0.0  # dollars spent so far (price per worker-hour x live workers x time)
    cost_per_1k_samples: float | None = None
    projected_cost: float | None = None  # at the current rate, when the job's length is known
    # The job's page on its coordinator's dashboard and its Prometheus endpoint; None when no
    # coordinator serves the job (``tidal dashboard`` serves finished jobs from SQLite).
    dashboard_url: str | None = None
    metrics_url: str | None = None
    # The process that hosts the job's control loop now (it changes when its supervisor
    # restarts it); None when no coordinator serves the job.
    coordinator_pid: int | None = None


# -- a worker's launch environment ----------------------------------------------------
ENV_URL = "TIDAL_COORDINATOR_URL"
ENV_TOKEN = "TIDAL_TOKEN"
ENV_WORKER_ID = "TIDAL_WORKER_ID"


@dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """What the backend puts in a worker's environment when it launches it."""

    url: str
    token: str
    worker_id: int

    @classmethod
    def from_environ(cls) -> WorkerEnv | None:
        """The launch environment, or None when the script runs outside ``tidal run``."""
        if ENV_URL not in os.environ:
            return None
        return cls(
            url=os.environ[ENV_URL],
            token=os.environ.get(ENV_TOKEN, ""),
            worker_id=int(os.environ[ENV_WORKER_ID]),
        )

    def to_environ(self) -> dict[str, str]:
        return {ENV_URL: self.url, ENV_TOKEN: self.token, ENV_WORKER_ID: str(self.worker_id)}
