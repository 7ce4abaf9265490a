"""The loop's rules about the job's end: a start that never formed, a completion report,
the final checkpoint a success waits for, and the wind-down once the outcome is decided
(``phase.decide``). Pure, table-tested (``tests/test_rules.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.coordinator.rules.verdicts import WAIT, Verdict, fail, succeed


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
