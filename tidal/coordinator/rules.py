"""The control loop's rules about workers' lives: pure functions from facts to verdicts.

Each takes what the coordinator knows (a small frozen dataclass of facts, or plain values)
and returns what to do, with the reason in words; the coordinator's executor methods
(``lifecycle``, ``scaling``) carry verdicts out and are the only code with side effects.
Every rule has a table test (``tests/test_rules.py``) that runs in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tidal.coordinator.verdicts import WAIT, Act, Verdict, fail, succeed
from tidal.protocol import RecoveryPath, WorkerState
from tidal.restarts import DEFAULT_MAX_RESTARTS, RestartLimit, parse_max_restarts, within

DEFAULT_LIMIT = parse_max_restarts(DEFAULT_MAX_RESTARTS)


# -- a worker's process ended ------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ExitFacts:
    """``how``: the exit in words (``killed by SIGKILL``, ``exited with code 1``);
    ``kill_reason``: why the coordinator killed it, if it did; ``leaving``: it was asked to
    exit (state stopping); ``alive_others``: live workers besides it, not retired."""

    worker_id: int
    returncode: int
    how: str
    reason: str = ""  # the backend's word on it (a lost node), if any
    detail: str = ""  # a line of its log, for a failed script
    retired: bool = False
    leaving: bool = False
    was_member: bool = False
    kill_reason: str | None = None
    job_decided: bool = False
    status_known: bool = True  # False: gone, its exit status unreadable (``Exit.known``)
    joined: bool = True  # it registered (its script iterated ``Trainer.run``)
    script: str = "the script"  # its file name, for the job's error line
    failures: int = 0  # lost workers so far, this one not counted
    max_restarts: RestartLimit = DEFAULT_LIMIT
    recent: tuple[float, ...] = ()  # wall times of earlier losses (``restarts.keep_recent``)
    now: float = 0.0  # wall time of this end
    target: int = 1
    min_workers: int = 1
    alive_others: int = 0


@dataclass(frozen=True, kw_only=True)
class ExitVerdict:
    state: WorkerState  # EXITED or FAILED
    kind: str  # the event's kind: "worker" (expected) or "failure"
    message: str
    fail_job: str | None = None  # the job fails, for this reason
    lost: bool = False  # a lost worker: counts against --max-restarts
    reform: bool = False  # open a generation without it
    target: int | None = None  # the new target (the restart budget is spent)
    target_why: str = ""


def judge_exit(f: ExitFacts) -> ExitVerdict:
    """How a worker's end counts.

    - Asked to leave (retired, or stopping and no longer a member) and exited 0: an exit.
      Any other end while leaving is noted, but costs nothing: it was leaving anyway.
    - A script that raised (a positive code the coordinator did not cause) fails the job:
      every worker runs the same code, so a replacement would fail the same way.
    - A script that exited 0 without ever joining the job (it made no ``Trainer``, or never
      iterated ``trainer.run``: a ``__main__`` guard that calls nothing, an early return)
      fails the job at once for the same reason, naming the likely cause
      (``docs/decisions/exit-before-joining.md``); a replacement would exit the same way.
      Not when the backend gave the end a reason of its own (Ray's "cancelled before Ray
      placed it"): the script did not choose it.
    - Gone with its exit status unknown (an adopted worker, not our child) once it was asked
      to leave or the job was decided, and not killed by us: an exit.
    - Anything else (a signal, a lost machine, a kill for missed heartbeats) is a lost
      worker: a member's loss re-forms the group without it; past ``--max-restarts`` (a
      count over the job's life, a rate in a sliding window, or unlimited: ``restarts``)
      the target shrinks to the workers left, and if fewer than ``--min-workers`` are left
      the job fails (it may not train below that for longer than a replacement takes).
    """
    w = f.worker_id
    if not f.status_known and f.kill_reason is None and (f.leaving or f.retired or f.job_decided):
        # An adopted worker (``tidal attach``: not our child) that was done: nothing says it
        # failed, and its end changes nothing.
        return ExitVerdict(
            state=WorkerState.EXITED,
            kind="worker",
            message=f"worker {w} exited (its exit status is unknown: it was adopted)",
        )
    if f.returncode == 0 and (f.leaving or f.retired):
        return ExitVerdict(
            state=WorkerState.EXITED,
            kind="worker",
            message=f"worker {w} exited" + (f": {f.reason}" if f.reason else ""),
        )
    if f.retired or (f.leaving and not f.was_member):
        why = f.kill_reason or f.how
        return ExitVerdict(
            state=WorkerState.FAILED, kind="worker", message=f"worker {w} {why} while leaving"
        )
    why = f.kill_reason or f.how
    message = f"worker {w} failed ({why})" + (f": {f.detail}" if f.detail else "")
    if f.job_decided:
        return ExitVerdict(state=WorkerState.FAILED, kind="failure", message=message)
    if f.returncode == 0 and not f.joined and f.kill_reason is None and not f.reason:
        return ExitVerdict(
            state=WorkerState.FAILED,
            kind="failure",
            message=f"worker {w} exited 0 without joining the job",
            fail_job=(
                f"{f.script} exited 0 without running a tidal.Trainer (did it run its main?)"
            ),
        )
    if f.returncode > 0 and f.kill_reason is None:
        return ExitVerdict(
            state=WorkerState.FAILED,
            kind="failure",
            message=message,
            fail_job=f"worker {w} {why}" + (f": {f.detail}" if f.detail else ""),
        )
    if within(f.max_restarts, failures=f.failures, recent=f.recent, now=f.now):
        return ExitVerdict(
            state=WorkerState.FAILED,
            kind="failure",
            message=message,
            lost=True,
            reform=f.was_member,
        )
    if f.alive_others < f.min_workers:
        return ExitVerdict(
            state=WorkerState.FAILED,
            kind="failure",
            message=message,
            lost=True,
            fail_job=(
                f"{f.max_restarts.spent()} and {f.alive_others} "
                f"workers are left, fewer than --min-workers {f.min_workers}"
            ),
        )
    return ExitVerdict(
        state=WorkerState.FAILED,
        kind="failure",
        message=message,
        lost=True,
        reform=f.was_member,
        target=max(f.min_workers, min(f.target, f.alive_others)),
        target_why=f.max_restarts.spent_short(),
    )


# -- silent and lingering workers --------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class HealthFacts:
    """``silent_s``: since its last heartbeat (None: it never sent one); ``stopping_s``: since
    it was asked to exit (None: it was not)."""

    worker_id: int
    state: WorkerState
    silent_s: float | None = None
    stopping_s: float | None = None
    killed: bool = False  # the coordinator already killed it


class Kill(NamedTuple):
    """A worker to SIGKILL: ``kind`` is its event's kind ("worker": expected, "failure")."""

    worker_id: int
    kind: str
    reason: str


def to_kill(
    workers: list[HealthFacts], *, heartbeat_timeout_s: float, stop_grace_s: float
) -> list[Kill]:
    """A ``Kill`` for each worker to SIGKILL: a stopping one that did not
    exit within the grace period, a registered one silent past the heartbeat timeout. A
    stopping worker has reported its end and stops heartbeating as it exits: the grace
    period, not the heartbeat timeout, bounds it. Never the same worker twice."""
    kills = []
    for w in workers:
        if w.killed:
            continue
        if w.state == WorkerState.STOPPING:
            if w.stopping_s is not None and w.stopping_s > stop_grace_s:
                kills.append(
                    Kill(
                        worker_id=w.worker_id,
                        kind="worker",
                        reason=f"did not exit within {stop_grace_s:.0f} s of being asked",
                    )
                )
        elif w.state in (WorkerState.STANDBY, WorkerState.RUNNING):
            if w.silent_s is not None and w.silent_s > heartbeat_timeout_s:
                kills.append(
                    Kill(
                        worker_id=w.worker_id,
                        kind="failure",
                        reason=f"missed heartbeats for {w.silent_s:.1f} s",
                    )
                )
    return kills


# -- capacity -----------------------------------------------------------------------------
def capacity_victims(alive: list[int], members: list[int], capacity: int) -> list[int]:
    """Which of the ``alive`` workers (not yet told to leave) get a preemption notice when
    only ``capacity`` may run: spares first (nothing to hand over), then the highest ranks
    of ``members`` (rank order)."""
    excess = len(alive) - capacity
    if excess <= 0:
        return []
    spares = [w for w in alive if w not in members][:excess]
    ranked = sorted((w for w in alive if w in members), key=members.index, reverse=True)
    return spares + ranked[: excess - len(spares)]


# -- the start ----------------------------------------------------------------------------
def start_timed_out(
    *,
    pending: bool,
    waited_s: float,
    start_timeout_s: float,
    failed: tuple[int, int, str] | None = None,
) -> str | None:
    """Why the job fails for never forming a generation, or None. ``failed``: the failed
    collectives in a row (``Streak``: step, count, the last report), said too: they are
    why no generation formed, and "see the worker logs" alone would hide it."""
    if not (pending and waited_s > start_timeout_s):
        return None
    why = f"no generation formed within {start_timeout_s:g} s (--start-timeout)"
    if failed is not None:
        step, count, last = failed
        return f"{why}; the collective at step {step} failed {count} times in a row (last: {last})"
    return f"{why}; see the worker logs"


# -- the state's holders were lost ---------------------------------------------------------
def roll_back(*, lost_step: int, checkpoint_step: int | None) -> Verdict:
    """``FAIL`` (why) or ``ROLL_BACK`` (the event) when no live worker holds the training
    state of ``lost_step``: never train on from scratch; the newest verified checkpoint, if
    any, is the state to go on from."""
    if checkpoint_step is None:
        return fail(
            f"no live worker holds the training state of step {lost_step} (its holders were "
            "lost) and there is no checkpoint to roll back to; run with --checkpoint-every"
        )
    return Verdict(
        act=Act.ROLL_BACK,
        why=f"no live worker holds step {lost_step}: rolling back to the checkpoint of step "
        f"{checkpoint_step} ({max(0, lost_step - checkpoint_step)} steps redone)",
    )


def every_member_lost(
    *, keeps_checkpoints: bool, checkpoint_step: int | None, step: int
) -> Verdict:
    """``FAIL`` (why) or ``RESUME`` (the event) when the last member of the job is lost
    (all at once, or the last survivor). With a verified checkpoint the job goes on, as
    torchrun restarts a worker group: the next workers admitted find no state, and healing
    sends them to the checkpoint (``roll_back``); otherwise it fails saying so. The workers
    lost count against ``--max-restarts`` like any others (``judge_exit``)."""
    if not keeps_checkpoints:
        return fail("every worker was lost; nothing holds the training state")
    verdict = roll_back(lost_step=step, checkpoint_step=checkpoint_step)
    if verdict.act is Act.FAIL:
        return fail(f"every worker was lost; {verdict.why}")
    return Verdict(
        act=Act.RESUME,
        why=f"every worker was lost at step {step}: the next members resume from the "
        f"checkpoint of step {checkpoint_step}",
    )


# -- how a generation recovered its state ---------------------------------------------------
def merge_recovery(
    recorded: tuple[RecoveryPath | None, int | None], path: RecoveryPath | None, redone: int
) -> tuple[RecoveryPath | None, int | None]:
    """A generation's (recovery path, redone steps) once a member reports ``path`` and
    ``redone``: the most severe path (``RecoveryPath``'s order) and the most steps redone. A
    report with neither (a worker of an older version) changes nothing."""
    old_path, old_redone = recorded
    if path is None and redone <= 0:
        return recorded
    order = list(RecoveryPath)
    worst = max((p for p in (old_path, path) if p is not None), key=order.index, default=None)
    return worst, max(old_redone or 0, redone)


def neighbour_copy_event(
    gen_id: int,
    recorded: tuple[RecoveryPath | None, int | None],
    path: RecoveryPath | None,
    redone: int,
) -> str | None:
    """The event of a generation rebuilt from neighbour copies with steps redone, for its
    first report that says so (``recorded``: what its earlier reports said), else None. A
    rollback to a checkpoint has its own event (``roll_back``)."""
    old_path, old_redone = recorded
    if path is not RecoveryPath.NEIGHBOUR_COPY or redone <= 0:
        return None
    if old_path is RecoveryPath.CHECKPOINT or (
        old_path is RecoveryPath.NEIGHBOUR_COPY and (old_redone or 0) > 0
    ):
        return None
    return f"generation {gen_id}: rebuilt from neighbour copies, {redone} steps redone"


# -- completion ------------------------------------------------------------------------
def completion_refused(
    *, worker_id: int, step: int, current: set[int], job_length: int | None
) -> str:
    """Why a worker's completion report does not end the job ("" if it does): only a
    member of the current generation (``current``: the newest's members and the newest
    formed one's) that committed the job's last step completes it, never a flag alone."""
    if worker_id not in current:
        return "it is not a member of the current generation"
    if job_length is None:
        return "the job's length is unknown (no worker registered its max_steps)"
    if step < job_length:
        return f"the job has {job_length} steps"
    return ""


# -- preemption notices ------------------------------------------------------------------
def leaver_target(*, sent_by_us: bool, requested: int, min_workers: int) -> int | None:
    """The new requested count when a worker announces it leaves (SIGTERM): None when the
    coordinator sent the notice itself (the target already counts it); one less, never
    below ``--min-workers``, when the cloud did (capacity went away with it)."""
    if sent_by_us:
        return None
    return max(min_workers, requested - 1)


# -- the target ------------------------------------------------------------------------------
def effective_target(requested: int, capacity: int | None) -> int:
    """What the job runs: the requested count, within the capacity available now."""
    return requested if capacity is None else max(0, min(requested, capacity))


# -- --schedule ------------------------------------------------------------------------------
def schedule_due(
    schedule: tuple[tuple[int, int], ...], done: int, step: int
) -> list[tuple[int, int]]:
    """The entries of ``--schedule`` (after the first ``done``) the job has reached at
    ``step``, in order: each sets the target when its step is committed."""
    due = []
    while done < len(schedule) and step >= schedule[done][0]:
        due.append(schedule[done])
        done += 1
    return due


def schedule_ahead(
    schedule: tuple[tuple[int, int], ...], done: int, step: int, *, formed: bool, settled: int
) -> list[tuple[int, int]]:
    """The ``--schedule`` entries to apply now: those the job has reached at ``step``
    (``schedule_due``); when there are none and the latest generation has formed, the next
    entry if it is at ``step + 1``: a change at ``s`` is applied while the members run step
    ``s - 1``, so whoever leaves knows it before committing that step, and nobody waits at
    ``s`` for the loop's pass. Safe: a member reports ``s - 1`` only once the all-reduce of
    the step before has returned, so every member has set that step's control word already,
    and the earliest word that can carry the switch is step ``s - 1``'s: the switch comes
    after it, at ``s``, as does every hold there. Never two changes in one: an entry due now
    goes alone (``10:2,11:3``: the change at 11 waits for the generation of 10 to form), and
    nothing goes ahead while the last applied entry is not settled (``settled``: the job's
    settled step; its generation may not even be open yet, waiting for a worker) nor before
    the latest generation formed (a start, a resume)."""
    due = schedule_due(schedule, done, step)
    if due or not formed or (done and settled < schedule[done - 1][0]):
        return due
    return [e for e in schedule_due(schedule, done, step + 1) if e[0] == step + 1][:1]


def schedule_near(schedule: tuple[tuple[int, int], ...], step: int) -> bool:
    """Whether a heartbeat reporting ``step`` may make a ``--schedule`` entry due: the
    entry's own step, or the one before it (``schedule_ahead``)."""
    return any(at - 1 <= step <= at for at, _ in schedule)


def schedule_settled(
    *,
    held_at: int | None,
    settled: int,
    members: int,
    target: int,
    waited_s: float,
    timeout_s: float,
    newer_forming: bool,
) -> bool:
    """Whether members held at scheduled step ``held_at`` may go on: the generation has
    the target count, or it could not get there within the start timeout (the job trains
    on with what it has rather than wait forever), or ``newer_forming``: a generation newer
    than the one they hold in is open and not formed. That one cannot form while they hold
    (they are its members), and no joiner is admitted until it forms (``policy.reconcile``):
    waiting for the target could only end at the timeout. Seen: the lone survivor of a
    failure held at step 20 of ``--schedule 20:3``, its replacement's generation opened
    with 2, the third worker ready and waiting for that one to form: 120 s. Released, they
    form it and the third joins at a step boundary after it."""
    if held_at is None or held_at <= settled:
        return False
    return members == target or waited_s > timeout_s or newer_forming


# -- a failed collective ---------------------------------------------------------------------
def reform_due(
    *,
    requested_at: float,
    now: float,
    grace_s: float,
    reported_gen: int,
    latest_gen: int,
    unreported: int,
) -> bool | None:
    """A member reported a failed collective in ``reported_gen`` at ``requested_at``: True
    to re-form the latest generation now, False to wait (a dead peer's exit may be seen
    within the grace period, and then the generation re-forms without it), None to drop the
    request (a newer generation already answers it). ``unreported``: the members of the
    latest generation that have not reported a failure in it; when none is left, no exit is
    pending (a dead member reports nothing) and waiting out the grace would only add it to
    the pause (a raise in a one-member job's collective re-formed after 0.1 s of it)."""
    if reported_gen == latest_gen and unreported == 0:
        return True
    if now - requested_at < grace_s:
        return False
    return True if reported_gen == latest_gen else None


#: Failed collectives in a row, all reported at the same committed step of the job with every
#: member alive, after which the job fails instead of re-forming again. A forming that fails
#: under heavy load (a peer too slow to connect within the window) is reported as a failed
#: collective too, and each one in a row doubles the worker's connect window
#: (``group.connect_timeout``), so a few in a row are legitimate; ten in a row at the same
#: step means windows up to 0.3 s * 2^10 (capped at the collective timeout) came and went:
#: nothing will form. A bug every step's collective hits (gloo refusing a reduce op) fails
#: the same way each time and would otherwise re-form forever (~400 generations in 2 min).
REFORMS_WITHOUT_PROGRESS = 10


class Streak(NamedTuple):
    """The failed collectives in a row at one committed step (``repeated_failure``);
    a plain tuple, so the coordinator's ``control`` record keeps it as a JSON list."""

    step: int  # the job's committed step when they failed
    count: int  # failed collectives at that step, in a row, each answered by a re-form
    last: str  # the last one's report: "worker 1: RuntimeError: ..."


def repeated_failure(
    streak: Streak | None,
    *,
    step: int,
    worker_id: int,
    error: str,
    limit: int = REFORMS_WITHOUT_PROGRESS,
) -> tuple[Streak, str | None]:
    """A member's failed collective is due for a re-form (``reform_due`` said True) while
    the job's committed step is ``step``: the streak it makes, and why the job fails
    instead of re-forming (None: re-form). The ``limit``-th failure in a row at the same
    step fails the job, quoting the last report in one line.

    What ends a streak (the coordinator passes ``streak=None``, or the step differs):

    - committed progress: the job's step advanced (or moved at all: a roll-back to a
      checkpoint is a new state to train from). Only progress proves the failures were
      transient; a failure every other step still trains on.
    - a member lost (its process ended, a kill for missed heartbeats): a dying peer makes
      its survivors' collectives fail, sometimes before its exit is seen (a Ray actor's
      death takes ~1 s, past the 100 ms grace), so those failures are explained and a
      cascade of losses at one step must not add up to a false verdict. Losses are
      bounded (``--max-restarts``, then the workers left), so this reset cannot feed a
      loop of its own.

    What does not: a scale (``tidal scale``, a policy, the capacity), a standby or a
    replacement joining. They explain nothing (every member runs the same code, and the
    failure was with every member alive), and they can repeat without bound: a policy
    reacting to a job that makes no progress would keep the loop going. A restart of the
    coordinator does not either: the streak is in its ``control`` record."""
    line = (error.strip().splitlines() or [""])[0][:300]
    last = f"worker {worker_id}: {line}"
    count = streak.count + 1 if streak is not None and streak.step == step else 1
    now = Streak(step=step, count=count, last=last)
    if count < limit:
        return now, None
    return now, (
        f"the collective at step {step} failed {count} times in a row with every member "
        f"alive (last: {last})"
    )


# -- the final checkpoint ----------------------------------------------------------------------
def final_checkpoint(
    *, step: int, written: bool, error: str | None, writer: int | None, writer_live: bool
) -> Verdict:
    """A job with durable checkpoints completed ``step``: ``SUCCEED`` once its final
    checkpoint is recorded, ``FAIL`` (why) if it failed or its writer (rank 0 of the last
    generation) ended without it, ``WAIT`` meanwhile (the checkpoint's report rides
    a heartbeat and may come after the completion report). Never a success without the
    checkpoint the job promised: ``tidal resume`` then redoes the steps since the newest."""
    if written:
        return succeed()
    if error is not None:
        return fail(f"the checkpoint of its last step ({step}) could not be written: {error}")
    if writer is None or not writer_live:
        who = f"worker {writer}, its writer," if writer is not None else "its writer"
        return fail(
            f"the checkpoint of its last step ({step}) was not written: {who} was lost "
            "while writing it (`tidal resume` redoes the steps since the newest checkpoint)"
        )
    return WAIT


# -- the job's end -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class WindDown:
    """What the loop does on a pass once the job's outcome is decided (``wind_down``)."""

    begin: bool  # first pass: abandon the open generation, ask every non-member to exit
    kill: str | None  # SIGKILL every process still running, and why
    end: bool  # no process is left: record the end


def wind_down(*, failed: bool, waited_s: float | None, alive: int, grace_s: float) -> WindDown:
    """The job's outcome is decided; ``waited_s`` since the first such pass (None: this is
    it), ``alive`` processes still running. Members finish their step and exit on their own
    (a final checkpoint may be in flight), within ``grace_s``; a failed job's processes are
    killed at once (nothing they do can be kept). The end is recorded only once every
    process is gone: a job never reads as ended while one of its workers still runs."""
    begin = waited_s is None
    kill = None
    if alive and begin and failed:
        kill = "the job failed: nothing its workers do now is kept"
    elif alive and not begin and waited_s > grace_s:
        kill = f"still running {grace_s:.0f} s after the job's end was decided"
    return WindDown(begin=begin, kill=kill, end=alive == 0)
