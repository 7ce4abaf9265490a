"""When failed checkpoints end a job, how its end names the newest good one, and which
records of checkpoints their writer pruned.

Pure functions of what the coordinator knows: the steps whose checkpoint was written in this
run, those whose write failed (``Job.checkpointed``, ``Job.checkpoint_failed``), and the newest
checkpoint on disk (``checkpoint.layout.found_on_disk``). Decided in
``docs/decisions/full-disk.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from tidal.checkpoint.location import is_url

#: Checkpoints that may fail in a row before the job fails: enough to ride out a disk that
#: is briefly full or a slow mount, few enough that the work a crash would lose stays at
#: about three checkpoint intervals.
FAILED_IN_A_ROW_LIMIT = 3


def failed_in_a_row(failed: Mapping[int, str], written: Iterable[int]) -> list[int]:
    """The steps whose checkpoint failed after the newest one written, oldest first."""
    newest = max(written, default=-1)
    return sorted(s for s in failed if s > newest)


def streak_verdict(
    failed: Mapping[int, str],
    written: Iterable[int],
    *,
    newest_on_disk: int | None,
    limit: int = FAILED_IN_A_ROW_LIMIT,
) -> str | None:
    """Why the job fails now (one line), or None while fewer than ``limit`` checkpoints in a
    row could not be written."""
    steps = failed_in_a_row(failed, written)
    if len(steps) < limit:
        return None
    shown = ", ".join(str(s) for s in steps)
    return (
        f"{len(steps)} checkpoints in a row could not be written (steps {shown}; last: "
        f"{failed[steps[-1]]}); {newest_line(newest_on_disk)}"
    )


def newest_line(step: int | None) -> str:
    """``the newest checkpoint holds step 30`` (what ``tidal resume`` continues from)."""
    if step is None:
        return "no checkpoint of this job is on disk"
    return f"the newest checkpoint holds step {step}"


def final_checkpoint_note(
    *, step: int, failed: Mapping[int, str], written: Iterable[int], newest_on_disk: int | None
) -> str | None:
    """For a job that ended at ``step``: what its end line adds when the checkpoint of that
    step failed (and none of it was written), else None."""
    if step in set(written) or step not in failed:
        return None
    return (
        f"its final checkpoint (step {step}) could not be written ({failed[step]}); "
        f"{newest_line(newest_on_disk)}"
    )


def pruned_records(
    records: Sequence[tuple[int, str]], *, keep: int, exists: Callable[[str], bool]
) -> list[int]:
    """The steps of the recorded checkpoints (``(step, path)``) that their writer pruned
    since: a folder that ``exists`` no longer; a URL's (``s3://...``, which the loop does
    not look up) beyond the newest ``keep`` recorded, as the writer's prune keeps
    (``checkpoint.remote.doomed``: the newest ``keep`` complete ones)."""
    newest = set(sorted((s for s, _ in records), reverse=True)[:keep])
    return [
        step for step, path in records if (step not in newest if is_url(path) else not exists(path))
    ]
