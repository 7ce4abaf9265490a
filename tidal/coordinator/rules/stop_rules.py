"""A job ended early by a member's script: the coordinator's rules, pure and table-tested.

A member's script ends the job with ``trainer.stop()`` or a ``break`` out of
``trainer.run`` (``tidal.worker.trainer.stopping``). Before that member leaves its group it tells
the coordinator, in a blocking call, at which committed step it stops (``StopReport``);
its peers' next collective then fails (it left) or their next answer says ``stop``, and
they end at that same step. The first report fixes the job's stop step and its final
checkpoint's writer (that member: it certainly holds the step); later reports are told the
same step. No generation is opened after it, nothing is replaced, no restart is counted.

The job's outcome waits for every member of the stop's generation to exit, as torchrun's
does for every local worker: the script chose to end, so the job succeeds when they all
exit 0 (with the final checkpoint recorded when checkpoints are on); a member whose script
then exits non-zero (a ``raise`` also closes the loop's generator, exactly as a ``break``
does: the two look the same until the process ends) fails it. See
``docs/decisions/early-stop.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tidal.coordinator.job import ScriptStop
from tidal.coordinator.rules.verdicts import WAIT, Verdict, fail, succeed


class StopVerdict(NamedTuple):
    """What a stop report does: ``record`` a new stop (None: nothing new), the ``step`` told
    to the reporter (None: the report stops nothing), whether it is the ``writer``, and
    the event to record (None: none)."""

    record: ScriptStop | None
    step: int | None
    writer: bool
    event: str | None


def accept_stop(
    *,
    worker_id: int,
    step: int,
    generation: int,
    writes: bool,
    members: tuple[int, ...],
    current: set[int],
    recorded: ScriptStop | None,
    decided: bool,
) -> StopVerdict:
    """A member reports that its script stopped the job at committed ``step`` in
    ``generation`` (whose ``members`` the coordinator knows); ``current``: the members of
    the latest and the latest formed generations; ``recorded``: a stop already fixed;
    ``decided``: the job's outcome is decided or a ``tidal stop`` is pending (the usual end
    applies: nothing to record). The first report from a current member fixes the stop;
    a repeated report (a retried call) gets the same answer."""
    if recorded is not None:
        writer = recorded.worker_id == worker_id and recorded.checkpoint
        return StopVerdict(None, recorded.step, writer, None)
    if decided:
        return StopVerdict(None, None, False, None)
    if worker_id not in current:
        return StopVerdict(
            None,
            None,
            False,
            f"worker {worker_id} reported its script stopped at step {step}; ignored: it is "
            "not a member of the current generation",
        )
    stop = ScriptStop(
        worker_id=worker_id,
        step=step,
        generation=generation,
        members=members,
        checkpoint=writes,
    )
    return StopVerdict(
        stop,
        step,
        writes,
        f"worker {worker_id}'s script stopped the job at step {step} (trainer.stop() or a "
        "break out of trainer.run): every member ends there",
    )


@dataclass(frozen=True, kw_only=True)
class MemberExit:
    """How a member of the stop's generation ended: ``running``: not yet; ``code`` its exit
    code (None while running, or when the backend could not learn it: lost, as to a
    signal); ``killed``: the coordinator killed it (it missed heartbeats, or outstayed its
    grace); ``detail``: a line of its log, for a failed script."""

    running: bool = False
    code: int | None = None
    killed: bool = False
    detail: str = ""


def stop_outcome(
    *,
    stop: ScriptStop,
    exits: dict[int, MemberExit],
    checkpoints: bool,
    written: bool,
    error: str | None,
) -> Verdict:
    """``WAIT``, ``SUCCEED`` (why) or ``FAIL`` (why) for a job a script
    stopped (module doc). ``exits``: every member of ``stop.members``; ``checkpoints``: the
    job keeps durable checkpoints; ``written``/``error``: the stop step's checkpoint was
    recorded / failed. A member ended by a signal it was not sent by the coordinator was
    lost, not failed by its script: the job's state is in the writer's checkpoint (or the
    job keeps none), so it does not change the outcome."""
    who = f"worker {stop.worker_id}'s script stopped the job at step {stop.step}"
    for wid in sorted(exits):
        e = exits[wid]
        if e.code is not None and e.code > 0 and not e.killed:
            line = f": {e.detail}" if e.detail else ""
            return fail(f"{who}; worker {wid} then exited with code {e.code}{line}")
    if error is not None and checkpoints and stop.checkpoint:
        return fail(f"{who}; its final checkpoint could not be written: {error}")
    if any(e.running for e in exits.values()):
        return WAIT
    if not checkpoints:
        return succeed(who)
    if not stop.checkpoint:
        return succeed(f"{who} (sharding='fsdp': no final checkpoint)")
    if written:
        return succeed(f"{who}, final checkpoint written")
    return fail(
        f"{who}; its final checkpoint was not written: worker {stop.worker_id}, its writer, "
        "exited without it (`tidal resume` redoes the steps since the newest checkpoint)"
    )
