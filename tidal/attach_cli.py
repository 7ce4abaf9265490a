"""``tidal attach JOB``: a new coordinator for a job whose coordinator and supervisor died.

Its workers train on without them (until ``--orphan-timeout``), calling the URL they were
launched with. ``attach`` takes the job's lock, serves that URL again with the job's token
(both from ``HOME/jobs/NAME/coordinator.json``), and starts a supervised coordinator that
rebuilds the job from SQLite and adopts the workers as they register again
(``coordinator.recovery``), exactly as after a restart by the supervisor.

Refused in one line: an unknown job, one whose coordinator still holds it, one that ended,
one with no record of its coordinator's address, one whose workers call another machine
(the attach must serve the address they call), and one with no live worker (``tidal
resume`` restarts it from a checkpoint).

On Ray the workers' pids are on other nodes: the attach cannot see them, so it counts the
workers the records left running, and the new coordinator adopts their detached actors by
name (``RayBackend.adopt``); a worker whose actor is gone is lost, as after a restart by the
supervisor, and a job that adopts none goes on from its newest checkpoint
(``reform_rules.every_member_lost``).
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from tidal import pids
from tidal.config import JobSpec
from tidal.coordinator.process.supervisor import Attach
from tidal.coordinator.records.home import JobBusy, check_home, db_path, job_dir, resolve_home

if TYPE_CHECKING:
    from tidal.protocol import JobStatus


def add_parser(
    sub: argparse._SubParsersAction, common: argparse.ArgumentParser, launch: Callable[..., int]
) -> None:
    """Register ``attach`` on the ``tidal`` subparsers; ``launch``: ``launch.launch``, which
    hosts the job here or detached."""
    attach = sub.add_parser(
        "attach",
        parents=[common],
        help="take over the live workers of a job whose coordinator died",
        description="Start a coordinator for JOB that adopts its live workers (they train on "
        "after their coordinator and `tidal run` died, until --orphan-timeout).",
    )
    attach.add_argument("job")
    attach.add_argument("--detach", action="store_true")
    attach.add_argument("--quiet", action="store_true")
    attach.set_defaults(fn=functools.partial(cmd_attach, launch=launch), tensorboard=None)


def cmd_attach(args: argparse.Namespace, *, launch: Callable[..., int]) -> int:
    """Errors are ``ValueError`` (the CLI prints the one line)."""
    from tidal.coordinator.records.db import Database

    home = resolve_home(args.home)
    jd = job_dir(home, args.job)  # first: one line for a name that is no job's
    check_home(home)
    if not db_path(home).exists():
        raise ValueError(f"unknown job {args.job!r}: no jobs in {home} (set --home or $TIDAL_HOME)")
    db = Database(db_path(home), readonly=True)
    try:
        if not db.has_job(args.job):
            raise ValueError(f"unknown job {args.job!r} in {home} (`tidal jobs` lists them)")
        try:
            lock = jd.lock()
        except JobBusy as exc:
            raise ValueError(
                f"job {args.job!r} has a live coordinator ({exc}); nothing to attach to"
            ) from None
        try:
            status = db.load_status(args.job)
            spec = JobSpec.from_dict(db.job_spec(args.job))
        except BaseException:
            os.close(lock)
            raise
    finally:
        db.close()
    try:
        attach = check_attach(
            args.job, spec, status, jd.read_coordinator(), host=_address(spec), alive=pids.alive
        )
    except BaseException:
        os.close(lock)
        raise
    return launch(spec, home, args, None, lock, attach=attach)


def _address(spec: JobSpec) -> str:
    """The address a coordinator of ``spec`` listens on from this machine (``runner``)."""
    from tidal.backends import serving_address

    return serving_address(spec)[0]


def check_attach(
    name: str,
    spec: JobSpec,
    status: JobStatus,
    info: dict | None,
    *,
    host: str,
    alive: Callable[[int], bool],
) -> Attach:
    """The ``Attach`` for the job, or ``ValueError`` (one line) saying why there is none;
    ``info``: its coordinator file, ``host``: the address this machine would serve,
    ``alive``: whether a pid runs on this machine (asked of local workers only: module doc)."""
    from tidal.protocol import JobState, WorkerState  # pydantic: not for the CLI's parser

    if JobState(status.state).terminal:
        raise ValueError(f"job {name!r} {JobState(status.state).value}; nothing to attach to")
    if not info or not info.get("url") or not info.get("token"):
        raise ValueError(
            f"no record of job {name!r}'s coordinator address; its workers cannot be reached "
            f"(`tidal resume {name}` restarts it from a checkpoint)"
        )
    url = urlsplit(info["url"])
    if url.hostname != host:
        raise ValueError(
            f"job {name!r}'s workers call {url.hostname}, and this machine serves {host}: "
            "run `tidal attach` on the machine that ran `tidal run`"
        )
    local = spec.backend == "local"
    live = [
        w.id
        for w in status.workers
        if w.pid
        and w.state not in (WorkerState.EXITED, WorkerState.FAILED)
        and (not local or alive(w.pid))
    ]
    if not live:
        raise ValueError(
            f"no worker of job {name!r} is alive; `tidal resume {name}` restarts it from a "
            "checkpoint"
        )
    return Attach(token=info["token"], api_port=url.port)
