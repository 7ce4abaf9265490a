"""The loop's rules about workers' ends: how a process's exit counts, which silent or
lingering workers to kill. Pure functions from facts to verdicts, table-tested
(``tests/test_rules.py``); ``lifecycle`` carries the verdicts out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tidal.protocol import WorkerState
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
