"""One set of workers per job: ``tidal resume`` ends the previous run's workers first.

A job whose coordinator and ``tidal run`` died is ``interrupted``, and its workers train on
without them until ``--orphan-timeout`` (so that ``tidal attach`` can take them over). A
``tidal resume`` instead starts a new set from a checkpoint: the old set must be gone first,
or two sets train the job and both write its checkpoints (issue 50 finding 3).

- ``to_end`` (pure) picks, from the job's worker records and what runs now, the processes of
  the previous run: every recorded worker whose process runs and is that worker
  (``backends.local.runs_as_worker``: never a recycled pid), whatever state the records left
  it in (a dead coordinator records nothing more).
- ``end_previous_run`` carries it out: SIGKILL (their state is in the checkpoint the resume
  starts from; their work since is lost either way, and a SIGTERM asks them to leave through
  a coordinator that is gone), then waits until they are gone; one that cannot be ended
  refuses the resume in one line.
- ``settled_rows`` (pure) is what the resumed job records of them: no worker of a run that
  ended stays ``running`` in its records.

Workers on other machines (joined hosts, Ray) cannot be reached by pid from here: the
checkpoint fence (``checkpoint.fence``) refuses their writes, and they exit at their orphan
timeout.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tidal import pids
from tidal.coordinator.records.snapshot import WorkerRow

if TYPE_CHECKING:
    from tidal.protocol import JobStatus

ENDED = ("exited", "failed")  # states a worker never leaves (``WorkerState``)
GONE_WAIT_S = 10.0


@dataclass(frozen=True)
class OldWorker:
    """A worker the job's records name: ``runs``, its process runs and is that worker."""

    worker_id: int
    pid: int | None
    state: str
    runs: bool


def to_end(workers: Iterable[OldWorker]) -> list[tuple[OldWorker, str]]:
    """The previous run's workers that still run, each with the line that says so."""
    return [
        (
            w,
            f"worker {w.worker_id} (pid {w.pid}) of the previous run still ran ({w.state} in "
            "the records)",
        )
        for w in workers
        if w.pid and w.runs
    ]


def settled_rows(rows: Iterable[WorkerRow]) -> list[WorkerRow]:
    """``rows`` (``WorkerRecord.row``) of a previous run that the records left live, as
    ended: ``failed``, no rank, exit code -9 (SIGKILL's) where none was recorded."""
    return [
        WorkerRow(*r)._replace(state="failed", rank=None, exit_code=-9 if r[6] is None else r[6])
        for r in rows
        if r[3] not in ENDED
    ]


def end_previous_run(
    status: JobStatus,
    *,
    log_dir: Path,
    backend: str,
    runs_as_worker: Callable[[Path, int, int, str | None], bool] | None = None,
    wait_s: float = GONE_WAIT_S,
) -> list[str]:
    """End the workers of ``status``'s previous run that still run on this machine; returns
    a line for each. ``ValueError`` (one line) if one cannot be ended."""
    if backend != "local":
        return []  # not reachable by pid from here (module doc)
    if runs_as_worker is None:
        from tidal.backends.local import runs_as_worker
    facts = [
        OldWorker(
            worker_id=w.id,
            pid=w.pid,
            state=w.state.value,
            runs=bool(w.pid) and runs_as_worker(log_dir, w.id, w.pid, status.url),
        )
        for w in status.workers
    ]
    doomed = to_end(facts)
    for w, _ in doomed:
        try:
            os.kill(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:
            raise ValueError(
                f"worker {w.worker_id} (pid {w.pid}) of job {status.name!r}'s previous run "
                "still runs and cannot be ended by this user: end it before resuming"
            ) from None
    deadline = time.monotonic() + wait_s
    while left := [w for w, _ in doomed if pids.alive(w.pid)]:
        if time.monotonic() > deadline:
            named = ", ".join(f"worker {w.worker_id} (pid {w.pid})" for w in left)
            raise ValueError(f"{named} of job {status.name!r}'s previous run did not end")
        time.sleep(0.02)
    return [f"{line}: ended before the resume" for _, line in doomed]
