"""Rules of restart-based membership (``tidal run --torchrun``): when a world (a generation
of fresh processes running an unmodified torchrun script) stops and the next one starts,
how a member's end counts, when the job has succeeded. Pure, table-tested
(``tests/test_world_rules.py``); ``worlds`` carries them out.

A torchrun script forms its process group once per process, so no member can change worlds
in place: as under torchrun, any change of membership (``tidal scale``, ``--schedule``, a
policy, the capacity, a member lost or failed) stops every member of the world (SIGTERM,
then SIGKILL after the grace period) and starts the next world from fresh workers, whose
scripts resume from their own snapshot. The fresh workers are started (forked, registered,
warm) while the old world stops; the next world opens once every old member has exited.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from tidal.coordinator.rules.exit_rules import ExitFacts, ExitVerdict
from tidal.protocol import WorkerState
from tidal.restarts import within

#: What a job whose script never formed its process group is told (one line with its cause).
HINT = (
    "under --torchrun each worker's script must call torch.distributed.init_process_group "
    "(a script that trains alone needs no --torchrun)"
)


# -- the next world ---------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class World:
    """The facts. ``members``: the latest world's members in rank order (empty before the
    first); ``live``: those whose process still runs; ``stopped``: the coordinator asked it
    to stop (a change, the job's end); ``broken``: a member failed or was lost (not asked
    to stop); ``finished``: a member's script exited 0 on its own once the group formed
    (the world is ending: no planned change). ``standby``: registered fresh workers outside
    any world, oldest first; ``starting``: launched, not registered; ``spares``: warm ones
    to keep beyond the target (``--spares``, a scheduled scale-up)."""

    members: tuple[int, ...] = ()
    live: tuple[int, ...] = ()
    stopped: bool = False
    broken: bool = False
    finished: bool = False
    standby: tuple[int, ...] = ()
    starting: int = 0
    target: int
    spares: int = 0


@dataclass(frozen=True, kw_only=True)
class WorldPlan:
    """``stop``: the members to stop (SIGTERM), the world restarts; ``open``: the next
    world's members in rank order, None to wait; ``start``: fresh workers to start;
    ``retire``: warm workers beyond what is wanted."""

    stop: tuple[int, ...] = ()
    open: tuple[int, ...] | None = None
    start: int = 0
    retire: tuple[int, ...] = ()


def plan_world(w: World) -> WorldPlan:
    """The world restarts when a member failed, or when the target differs from its size
    (unless a member finished: the world ends with the job). A new world is wanted before
    the first, and once the latest stops: ``target`` fresh workers (and the spares) start at
    once, so their start-up overlaps the old world's stop; it opens with the oldest
    ``target`` of them once every old member has exited (a script may write its snapshot
    on SIGTERM: the next world must not read it half written)."""
    restart = (
        bool(w.members)
        and not w.stopped
        and (w.broken or (not w.finished and len(w.members) != w.target))
    )
    stop = w.live if restart else ()
    wanted = not w.members or w.stopped or restart
    outside = (w.target if wanted else 0) + w.spares
    standby = w.standby
    opened = None
    if wanted and not w.live and w.target >= 1 and len(standby) >= w.target:
        opened, standby, outside = standby[: w.target], standby[w.target :], w.spares
    return WorldPlan(
        stop=stop,
        open=opened,
        start=max(0, outside - len(standby) - w.starting),
        retire=standby[outside:],
    )


# -- a member's end ---------------------------------------------------------------------------
def judge_member_exit(f: ExitFacts, *, formed: bool, peer_failed: bool) -> ExitVerdict:
    """How the end of a member of the latest world counts (other workers' ends:
    ``exit_rules.judge_exit``). ``formed``: its world's process group formed (a member's
    launcher saw ``init_process_group`` return); ``peer_failed``: another member of the
    world already failed (not asked to stop).

    - Asked to stop (a restart, the job's end): exit 0 or by the SIGTERM sent is an exit;
      anything else (the SIGKILL after the grace period) is noted; neither costs anything.
    - The job's outcome is decided: noted.
    - Exit 0 once the group formed: its script finished (the job succeeds once every
      member's has: ``world_finished``). Exit 0 before: the job fails at once (``HINT``);
      a new world would do the same.
    - A positive code before the group formed, no peer having failed first: the script
      fails at its start (an error every new world would repeat): the job fails at once.
    - After a peer's failure: part of that failure (a peer's collective raises when one
      dies), no second loss.
    - Anything else (a code after the group formed, a signal, a kill for missed heartbeats)
      is a lost worker, as torchrun's worker failure: the world restarts while within
      ``--max-restarts``; past it the job fails.
    """
    w = f.worker_id
    how = f.kill_reason or f.how
    detail = f": {f.detail}" if f.detail else ""
    if f.retired or f.leaving:
        if f.returncode in (0, -signal.SIGTERM) and f.kill_reason is None:
            said = " (SIGTERM)" if f.returncode else ""
            return ExitVerdict(
                state=WorkerState.EXITED, kind="worker", message=f"worker {w} stopped{said}"
            )
        return ExitVerdict(
            state=WorkerState.FAILED, kind="worker", message=f"worker {w} {how} while stopping"
        )
    if f.job_decided:
        if f.returncode == 0:
            return ExitVerdict(
                state=WorkerState.EXITED, kind="worker", message=f"worker {w} exited"
            )
        return ExitVerdict(
            state=WorkerState.FAILED, kind="failure", message=f"worker {w} failed ({how})"
        )
    if f.returncode == 0 and f.kill_reason is None:
        if formed:
            return ExitVerdict(
                state=WorkerState.EXITED,
                kind="worker",
                message=f"worker {w} finished: {f.script} exited 0",
            )
        return ExitVerdict(
            state=WorkerState.FAILED,
            kind="failure",
            message=f"worker {w} exited 0 before its process group formed",
            fail_job=f"{f.script} exited 0 before its process group formed: {HINT}",
        )
    if peer_failed:
        return ExitVerdict(
            state=WorkerState.FAILED,
            kind="worker",
            message=f"worker {w} {how} after a peer's failure{detail}",
        )
    message = f"worker {w} failed ({how}){detail}"
    if f.returncode > 0 and f.kill_reason is None and not formed:
        return ExitVerdict(
            state=WorkerState.FAILED,
            kind="failure",
            message=message,
            fail_job=f"worker {w} {how} before its process group formed{detail}",
        )
    if within(f.max_restarts, failures=f.failures, recent=f.recent, now=f.now):
        return ExitVerdict(
            state=WorkerState.FAILED, kind="failure", message=message, lost=True, reform=True
        )
    return ExitVerdict(
        state=WorkerState.FAILED,
        kind="failure",
        message=message,
        lost=True,
        fail_job=f"{f.max_restarts.spent()} (--max-restarts): worker {w} {how}{detail}",
    )


# -- the job's end ---------------------------------------------------------------------------
def world_finished(*, formed: bool, stopped: bool, codes: tuple[int | None, ...]) -> bool:
    """The job succeeded: its latest world formed, nobody asked it to stop, and every
    member's script exited 0 (``codes``: each member's exit code, None while it runs), as
    torchrun's group succeeds when every worker has."""
    return formed and not stopped and bool(codes) and all(c == 0 for c in codes)


def world_timed_out(*, formed: bool, waited_s: float, timeout_s: float, gen_id: int) -> str | None:
    """Why the job fails for a world whose process group never formed within the start
    timeout (its members run, none reached ``init_process_group``'s end), or None."""
    if formed or waited_s <= timeout_s:
        return None
    return (
        f"the process group of generation {gen_id} did not form within {timeout_s:g} s "
        f"(--start-timeout): {HINT}; see the worker logs"
    )
