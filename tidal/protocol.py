"""The wire messages between the CLI, the coordinator and the workers.

All three import this module and nothing else of each other's: a worker imports the
coordinator's client, never its server. Every message is a pydantic model so that FastAPI
validates what arrives and the OpenAPI spec documents it.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, Field

API_PREFIX = "/api/v1"
TOKEN_HEADER = "Authorization"


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


class WorkerConfig(BaseModel):
    """Runtime settings the coordinator hands a worker at registration.

    ``hold_steps`` are the steps of ``--schedule``: a member that has committed one of them
    waits there until the coordinator has settled the membership the schedule asks for
    (``HeartbeatResponse.settled_step``), so scripted changes happen at exactly those steps.
    """

    heartbeat_interval_s: float
    collective_timeout_s: float
    store_host: str
    store_port: int
    hold_steps: list[int] = Field(default_factory=list)
    checkpoint_dir: str | None = None  # None: no durable checkpoints
    checkpoint_every: int | None = None
    checkpoint_interval_s: float | None = None
    keep_checkpoints: int = 3
    resume_from: str | None = None  # a verified checkpoint every worker loads at start


class RegisterRequest(BaseModel):
    pid: int
    host: str


class RegisterResponse(BaseModel):
    job: str
    config: WorkerConfig


class StepReport(BaseModel):
    """Timing facts a member sends when it completes its first step in a generation."""

    generation: int
    start_step: int
    prev_generation: int | None = None  # generation of this worker's previous step
    prev_last_step_time: float | None = None
    first_step_time: float
    # Where this member's pause went, in seconds (keys: see ``PAUSE_PHASES``); they add up to
    # first_step_time - prev_last_step_time.
    phases: dict[str, float] = Field(default_factory=dict)


#: The phases of a member's pause between its last step in one generation and its first step
#: in the next, in order: ``leave_s`` until it left the old generation (a hold at a scheduled
#: step, or the step whose collective failed), ``rendezvous_s`` until every member of the new
#: one arrived, ``form_s`` the process group's creation, ``heal_s`` the state transfer (and
#: the DDP wrapper), ``first_step_s`` the first step in the new generation.
PAUSE_PHASES = ("leave_s", "rendezvous_s", "form_s", "heal_s", "first_step_s")


class CheckpointView(BaseModel):
    step: int
    path: str
    bytes: int | None = None
    seconds_to_write: float | None = None


class HeartbeatRequest(BaseModel):
    """``leaving``: the worker got a preemption notice (SIGTERM) and asks to leave at the
    next step boundary, a planned leave rather than a failure."""

    step: int = 0
    generation: int = 0
    leaving: bool = False
    metrics: dict[str, float] = Field(default_factory=dict)
    reports: list[StepReport] = Field(default_factory=list)
    checkpoints: list[CheckpointView] = Field(default_factory=list)


class HeartbeatResponse(BaseModel):
    role: Role
    generation: GenerationInfo | None = None
    stop: bool = False
    settled_step: int = -1


class FailureReport(BaseModel):
    generation: int
    step: int
    error: str


class DoneReport(BaseModel):
    step: int
    completed: bool


class ScaleRequest(BaseModel):
    workers: int


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
    min_workers: int
    max_workers: int
    script: str
    created: float
    url: str | None = None
    workers: list[WorkerView] = Field(default_factory=list)
    generations: list[GenerationView] = Field(default_factory=list)
    events: list[EventView] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)
    checkpoints: list[CheckpointView] = Field(default_factory=list)
    cost: float = 0.0  # dollars spent so far (price per worker-hour x live workers x time)
    cost_per_1k_samples: float | None = None
    projected_cost: float | None = None  # at the current rate, when the job's length is known
    # The job's page on its coordinator's dashboard and its Prometheus endpoint; None when no
    # coordinator serves the job (``tidal dashboard`` serves finished jobs from SQLite).
    dashboard_url: str | None = None
    metrics_url: str | None = None
