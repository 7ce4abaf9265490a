"""Finding a home's jobs and reading their status: from the job's coordinator over HTTP
when one answers, else from the home's SQLite records (a job whose coordinator died reads
as ``interrupted``, its lost workers as ``failed``, its checkpoints as found on disk).

Used by the CLI's commands and by tests and benches that read a status as a user does.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

from tidal import pids
from tidal.coordinator.records.home import check_home, db_path, job_dir

if TYPE_CHECKING:
    from tidal.client import CoordinatorClient
    from tidal.protocol import JobStatus


class CliError(Exception):
    """One line for stderr; the command exits 1."""


def database(home: Path, *, check: bool = True):
    """The home's records, for reading (a read-only home still reads); ``check`` False: no
    ``quick_check`` of the file at the open (``Database``)."""
    from tidal.coordinator.records.db import Database

    check_home(home)
    if not db_path(home).exists():
        raise CliError(f"no jobs in {home} (set --home or $TIDAL_HOME)")
    return Database(db_path(home), readonly=True, check=check)


def job_client(home: Path, name: str) -> CoordinatorClient | None:
    """A client of the job's coordinator if one answers, else None."""
    from tidal.client import CoordinatorClient

    info = job_dir(home, name).read_coordinator()
    if not info:
        return None
    client = CoordinatorClient(info["url"], info["token"], timeout_s=5)
    try:
        client.status()
    except Exception:  # noqa: BLE001 - not answering is the answer
        client.close()
        return None
    return client


def get_status(home: Path, name: str, *, check: bool = True) -> JobStatus:
    from tidal.coordinator.records.db import UnknownJob
    from tidal.protocol import JobState

    check_home(home)
    client = job_client(home, name)
    if client is not None:
        try:
            return client.status()
        finally:
            client.close()
    if not db_path(home).exists():
        raise CliError(f"unknown job {name!r}: no jobs in {home} (set --home or $TIDAL_HOME)")
    db = database(home, check=check)
    try:
        status = db.load_status(name)
        storage = db.job_spec(name).get("checkpoint_storage")
    except UnknownJob:
        raise CliError(f"unknown job {name!r} in {home} (`tidal jobs` lists them)") from None
    finally:
        db.close()
    if status.state in (JobState.PENDING, JobState.RUNNING):
        if job_dir(home, name).locked():
            # Its coordinator is alive (it holds the job's lock) but did not answer: stopped
            # (SIGSTOP), swapped out, or too busy. The job is not interrupted.
            status.coordinator_unresponsive = True
        else:
            status.state = JobState.INTERRUPTED  # its coordinator died without finishing it
            status.world_size = 0
            status.dashboard_url = status.metrics_url = None  # nothing serves them
            mark_lost_workers(status)
    add_checkpoints_on_disk(home, status, storage)
    return status


def mark_lost_workers(status: JobStatus) -> None:
    """Workers of this machine an interrupted job's records show live, whose process is
    gone: ``failed`` (their coordinator died before it could record their end). A worker
    recorded on another machine (a Ray node) keeps its recorded state: its process cannot
    be checked from here, and it may be training on (``tidal attach`` adopts it)."""
    from tidal.protocol import WorkerState

    here = socket.gethostname()
    for w in status.workers:
        if w.state in (WorkerState.EXITED, WorkerState.FAILED):
            continue
        if w.host is not None and w.host != here:
            continue
        if w.pid is None or not pids.alive(w.pid):
            w.state, w.rank = WorkerState.FAILED, None


def add_checkpoints_on_disk(home: Path, status: JobStatus, storage: str | None = None) -> None:
    """The checkpoints in the job's folder (``storage``: its ``--checkpoint-dir``), whether or
    not their report reached the records (a report lost with its coordinator); records whose
    folder is gone are left out. A store that does not answer leaves the records as they
    are."""
    from tidal.checkpoint.layout import found_on_disk
    from tidal.checkpoint.location import is_url
    from tidal.coordinator.records.home import checkpoint_folder
    from tidal.protocol import CheckpointView

    try:
        found = found_on_disk(checkpoint_folder(home, status.name, storage))
    except OSError:
        return
    there = {str(path) for _, path, _ in found}
    listed = {
        c.step: c
        for c in status.checkpoints
        if (c.path in there if is_url(c.path) else Path(c.path).is_dir())
    }
    for step, path, size in found:
        listed.setdefault(step, CheckpointView(step=step, path=str(path), bytes=size))
    status.checkpoints = [listed[s] for s in sorted(listed)]


def newest_job(home: Path) -> str:
    db = database(home)
    try:
        names = db.job_names()
    finally:
        db.close()
    if not names:
        raise CliError(f"no jobs in {home}")
    return names[-1]


def lost_call_line(name: str, what: str, *, sent: bool, why: str) -> str:
    """The one line for a mutating call (``what``: "scale to 4 workers") whose coordinator
    went away: ``sent`` False if the request never reached it (it was not applied), True if
    it may have been applied before the coordinator died (its answer never came)."""
    if not sent:
        return (
            f"job {name!r}: its coordinator stopped answering before the request reached it "
            f"({why}); the {what} was not applied (`tidal status {name}` shows the job)"
        )
    return (
        f"job {name!r}: its coordinator went away during the request ({why}); the {what} may "
        f"or may not have been applied (`tidal status {name}` shows its target)"
    )


def running_client(home: Path, name: str) -> CoordinatorClient:
    client = job_client(home, name)
    if client is None:
        status = get_status(home, name)  # raises for an unknown job
        if status.coordinator_unresponsive:
            raise CliError(
                f"job {name!r} is {status.state.value}, but its coordinator does not answer"
            )
        raise CliError(f"job {name!r} is not running (state: {status.state.value})")
    return client
