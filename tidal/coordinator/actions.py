"""What the coordinator does to the world, as values: one dataclass per kind of action.

The control loop's rules (the ``*_rules`` modules, ``phase``, ``policy``) decide; the coordinator's methods turn each
decision into actions and hand them to the one ``executor.Executor``, the only code that
touches the backend (worker processes), the rendezvous store and the job's records
(``journal``, SQLite). An action says everything needed to carry it out, so what a pass
did can be read back as a list of values (``Executor.recent``) and a test can assert it.

Three doors, one per kind of world:

- **processes** (the backend): ``StartWorker``, ``SignalWorker``, ``AdoptWorker``,
  ``KillEveryWorker``;
- **the rendezvous store** (keys named by ``protocol``): ``OpenGeneration``,
  ``AbandonGeneration``, ``Notify``;
- **the records** (the journal: SQLite and its copy in memory): ``Record*``,
  ``DropCheckpoint``; and the checkpoint folder's fence (``checkpoint.fence``):
  ``FenceCheckpoints``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.coordinator.records.snapshot import WorkerRow
from tidal.protocol import CheckpointView, EventView, GenerationView


# -- processes ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StartWorker:
    """Launch worker ``worker_id`` with ``env``; its result is the pid (None while the
    backend has not placed it)."""

    worker_id: int
    env: dict[str, str] = field(repr=False)  # holds the worker's credential


@dataclass(frozen=True, kw_only=True)
class SignalWorker:
    """Send ``signum`` to the worker (SIGTERM: leave at a step boundary, or cancel a
    pending one; SIGKILL: it is hung or the job is over). ``why`` is for the reader."""

    worker_id: int
    signum: int
    why: str = ""


@dataclass(frozen=True, kw_only=True)
class AdoptWorker:
    """Watch a live worker that a previous coordinator started; its result is True if the
    pid is that worker's process. ``pid`` 0: it never registered (the backend ends what it
    may have begun for it, and the worker counts as lost)."""

    worker_id: int
    pid: int
    env: dict[str, str] = field(repr=False)


@dataclass(frozen=True, kw_only=True)
class KillEveryWorker:
    """SIGKILL every live worker process (the grace period is over, or the coordinator
    closes)."""

    why: str = ""


# -- the rendezvous store -----------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class OpenGeneration:
    """Mark the generation under ``prefix`` open and, if ``previous`` is given, the one
    it supersedes abandoned (only if still open): a member still forming the previous one
    gives up at once (``group.Superseded``)."""

    prefix: str
    previous: str | None = None


@dataclass(frozen=True, kw_only=True)
class AbandonGeneration:
    """Mark the generation under ``prefix`` abandoned, if it is still open (the job is
    winding down: nobody forms it)."""

    prefix: str


@dataclass(frozen=True, kw_only=True)
class Notify:
    """Bump the job's notice counter and set the new count's wake key: rank 0's notice
    thread wakes, and rank 0 fetches the new answer at its next step instead of at its
    next heartbeat."""


# -- the records --------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RecordEvent:
    event: EventView


@dataclass(frozen=True, kw_only=True)
class RecordJob:
    """Set these columns of the job's row (``snapshot.JobRow``'s names)."""

    values: dict[str, object]


@dataclass(frozen=True, kw_only=True)
class RecordWorkers:
    rows: tuple[WorkerRow, ...]


@dataclass(frozen=True, kw_only=True)
class RecordGeneration:
    generation: GenerationView


@dataclass(frozen=True, kw_only=True)
class RecordControl:
    """The restart record (``recovery.Control.to_dict()``)."""

    control: dict


@dataclass(frozen=True, kw_only=True)
class RecordCheckpoint:
    checkpoint: CheckpointView


@dataclass(frozen=True, kw_only=True)
class DropCheckpoint:
    """Forget the record of a checkpoint its writer pruned."""

    step: int


@dataclass(frozen=True, kw_only=True)
class RecordCheckpointFailure:
    error: str


@dataclass(frozen=True, kw_only=True)
class FenceCheckpoints:
    """Write the checkpoint folder's fence: ``epoch`` the run whose workers may write there;
    ``sealed`` (why) once the job ended: nobody may. Yields why it could not be written
    (the folder cannot be written: its checkpoints fail too, and say so), or None."""

    directory: str
    epoch: str
    sealed: str | None = None
    # A run that starts with ``--checkpoint-dir`` copies the job's spec beside the fence
    # (``fence.SPEC``): what ``tidal resume NAME --checkpoint-dir`` reads when the home is gone.
    spec: dict | None = None


Action = (
    StartWorker
    | SignalWorker
    | AdoptWorker
    | KillEveryWorker
    | OpenGeneration
    | AbandonGeneration
    | Notify
    | RecordEvent
    | RecordJob
    | RecordWorkers
    | RecordGeneration
    | RecordControl
    | RecordCheckpoint
    | DropCheckpoint
    | RecordCheckpointFailure
    | FenceCheckpoints
)
