"""``tidal run`` and ``tidal resume``: claim the job's name, then host its coordinator in
this process or in a detached one (``tidal attach`` hosts through ``launch`` too).

The records, the wire messages and the host (httpx, pydantic, torch) are imported where
used, not here: ``tidal run`` starts the workers' zygote first, whose imports are a cold
start's critical path.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.config import JobSpec, from_flags, parse_schedule, storage_error
from tidal.coordinator.process.supervisor import Attach
from tidal.coordinator.records.home import JobBusy, check_home, db_path, job_dir, resolve_home
from tidal.lookup import CliError, database
from tidal.policy.inputs import parse_duration

if TYPE_CHECKING:
    from tidal.coordinator.records.records import Resume


def claim(home: Path, name: str) -> int:
    """For ``tidal run --name NAME``: take the job's lock, then check under it that no job of
    that name exists, so that of two runs of one name (even at once) exactly one goes on.
    Returns the lock's descriptor, for the coordinator to hold for its life."""
    from tidal.coordinator.records.db import Database

    check_home(home)
    jd = job_dir(home, name)
    try:
        fd = jd.lock()
    except JobBusy as exc:
        raise CliError(
            f"a job named {name!r} is running in {home} ({exc}): pick another --name"
        ) from None
    try:
        if not db_path(home).exists():  # no job yet: nothing to check, and nothing recorded
            check_writable_folder(home)  # until the job really starts (its backend too)
            return fd
        db = Database(db_path(home))
        try:
            db.check_writable()
            if db.has_job(name):
                raise CliError(
                    f"a job named {name!r} already exists in {home}: pick another --name"
                )
        finally:
            db.close()
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_writable_folder(home: Path) -> None:
    """One line if ``home`` cannot hold the job's database (probed with a file removed at
    once: ``os.access`` says yes to root on a read-only mount)."""
    from tidal.coordinator.records.home import HomeError, os_error_line

    probe = home / f".tidal-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise HomeError(os_error_line("write", exc)) from None


def cmd_run(args: argparse.Namespace) -> int:
    script = Path(args.script)
    if not script.is_file():
        raise CliError(f"script not found: {args.script}")
    home = resolve_home(args.home)
    schedule = parse_schedule(args.schedule) if args.schedule else ()
    peak = max([args.workers, *(c for _, c in schedule)])
    # Every flag field comes from its flag (config.from_flags); these few are converted here.
    spec = from_flags(
        JobSpec,
        vars(args),
        backend="hosts" if args.listen and args.backend == "local" else args.backend,
        name=args.name or f"{script.stem}-{secrets.token_hex(2)}",
        script=str(script.resolve()),
        script_args=list(args.script_args),
        max_workers=args.max_workers if args.max_workers is not None else peak,
        schedule=schedule,
        capacity_trace=capacity_trace_path(args.capacity),
        deadline_s=parse_duration(args.deadline) if args.deadline else None,
        checkpoint_storage=checkpoint_storage(args.checkpoint_dir),
        track=_track(args.track),
    )
    from tidal.backends import check_capacity
    from tidal.policy import get_policy

    check_capacity(spec)  # an unknown backend, or more workers than it holds: one line
    if spec.backend == "ray":
        from tidal.backends.ray import import_ray

        import_ray()  # one line if the extra is missing, before anything is recorded
    get_policy(spec.policy)
    check_storage(spec.checkpoint_storage)
    return launch(spec, home, args, resume=None)


def checkpoint_storage(text: str | None) -> str | None:
    """``--checkpoint-dir`` as the spec keeps it: a folder made absolute (workers and a later
    ``tidal resume`` may start elsewhere), a URL as given; one line for text that names
    neither (``config.storage_error``, which ``JobSpec`` applies too)."""
    if text is None:
        return None
    from tidal.checkpoint import location

    if (why := storage_error(text)) is not None:
        raise CliError(why)
    where = location.of(text)
    return where if location.is_url(where) else str(Path(where).resolve())


def check_storage(storage: str | None) -> None:
    """One line if ``storage`` is a URL whose fsspec filesystem is not installed here."""
    from tidal.checkpoint.location import is_url

    if storage is not None and is_url(storage):
        from tidal.checkpoint.remote import check_url

        check_url(storage)


def _track(text: str | None) -> str | None:
    """``--track`` as the job records it (``tracking.trackers.resolve_track``)."""
    if text is None:
        return None
    from tidal.tracking.trackers import resolve_track

    return resolve_track(text)


def capacity_trace_path(path: str | None) -> str | None:
    """A validated capacity trace's absolute path (one clear line if it is malformed)."""
    if path is None:
        return None
    from tidal.sim.trace import load_trace

    load_trace(path)
    return str(Path(path).resolve())


def launch(
    spec: JobSpec,
    home: Path,
    args: argparse.Namespace,
    resume: Resume | None,
    lock: int | None = None,
    attach: Attach | None = None,
) -> int:
    """Host the job here, or in a detached process. ``lock``: the job's lock (``claim``;
    ``cmd_resume`` and ``tidal attach`` take it themselves), handed to the coordinator's
    process. ``attach``: take over the live workers of a job whose coordinator died.
    Refuses, in one line and before anything is claimed or started, GPU settings this
    machine cannot run (``--comm nccl`` without a GPU, more workers than GPUs)."""
    try:
        from tidal.backends.gpus import check_spec

        check_spec(spec)  # the backend checks again, for a coordinator started otherwise
        tensorboard = None
        if args.tensorboard:
            from tidal.tensorboard import check_available

            check_available()
            tensorboard = str(Path(args.tensorboard).resolve())
        if spec.track is not None:
            from tidal.tracking.trackers import check_available as tracker_installed

            tracker_installed(spec.track)
        if lock is None:
            lock = claim(home, spec.name)
        # We hold the lock: a coordinator.json left there is a dead coordinator's (whose URL
        # and token an attach takes over).
        if attach is None:
            job_dir(home, spec.name).coordinator_file.unlink(missing_ok=True)
    except BaseException:
        if lock is not None:
            os.close(lock)
        raise
    if args.detach:
        try:
            return detach(spec, home, resume, tensorboard=tensorboard, lock=lock, attach=attach)
        finally:
            os.close(lock)  # the coordinator's process holds it now
    from tidal.backends.local import start_zygote

    # Started before the coordinator's modules are imported (torch, ~3 s): the zygote's own
    # imports run meanwhile, on the other core.
    zygote = start_zygote(spec, job_dir(home, spec.name).logs)
    try:
        from tidal.host.runner import run_job
    except BaseException:
        if zygote is not None:
            zygote.close()
        os.close(lock)
        raise
    return run_job(
        spec,
        home,
        quiet=args.quiet,
        resume=resume,
        tensorboard=tensorboard,
        lock_fd=lock,
        attach=attach,
        zygote=zygote,
    )


def cmd_resume(args: argparse.Namespace) -> int:
    from tidal.checkpoint.layout import newest_good, step_of
    from tidal.checkpoint.location import base_name
    from tidal.coordinator.records.home import checkpoint_folder

    home = resolve_home(args.home)
    job_dir(home, args.job)  # first: one line for a name that is no job's
    check_home(home)
    storage = checkpoint_storage(args.checkpoint_dir)
    check_storage(storage)
    restore_record(home, args.job, storage=storage)
    elsewhere = "" if storage else "; a job whose home is gone: give its --checkpoint-dir"
    if not db_path(home).exists():
        raise CliError(
            f"unknown job {args.job!r}: no jobs in {home} (set --home or $TIDAL_HOME{elsewhere})"
        )
    db = database(home)
    try:
        if not db.has_job(args.job):
            raise CliError(
                f"unknown job {args.job!r} in {home} (`tidal jobs` lists them{elsewhere})"
            )
        try:  # held from here until the new coordinator ends: no other can start meanwhile
            lock = job_dir(home, args.job).lock()
        except JobBusy as exc:
            raise CliError(
                f"job {args.job!r} is running ({exc}); `tidal stop` it before resuming"
            ) from None
        try:
            status = db.load_status(args.job)  # no coordinator: what it last recorded
            state = status.state
            spec_dict = db.job_spec(args.job)
        except BaseException:
            os.close(lock)
            raise
    finally:
        db.close()
    from tidal.coordinator.records.records import Resume
    from tidal.protocol import JobState

    try:
        if state == JobState.SUCCEEDED:
            raise CliError(f"job {args.job!r} already succeeded; nothing to resume")
        # The counts first: a refusal must come before the previous run's workers are ended.
        spec_dict.update(
            resume_counts(spec_dict, workers=args.workers, max_workers=args.max_workers)
        )
        if storage is not None:  # where they are now (a bucket copied elsewhere, too)
            spec_dict["checkpoint_storage"] = storage
        spec = JobSpec.from_dict(spec_dict)  # run's validation: one line, nothing changed
        folder = checkpoint_folder(home, args.job, spec.checkpoint_storage)
        path, warnings = newest_good(folder)
        for line in warnings:
            print(f"tidal: warning: {line}", file=sys.stderr)
        if path is None:
            raise CliError(f"job {args.job!r} has no good checkpoint to resume from in {folder}")
        step = step_of(path)  # verified just now: its manifest says the step its name does
        # One set of workers per job: the previous run's, if any still train, go first.
        from tidal.coordinator.process.fencing import end_previous_run

        ended = end_previous_run(
            status, log_dir=job_dir(home, args.job).logs, backend=spec_dict["backend"]
        )
        for line in ended:
            print(f"tidal: {line}", file=sys.stderr)
    except BaseException:
        os.close(lock)
        raise
    resume = Resume(path=str(path), step=step, warnings=warnings, ended=ended)
    print(
        f"{spec.name}: resuming from {base_name(path)} (step {step}) with {spec.workers} workers",
        file=sys.stderr,
    )
    return launch(spec, home, args, resume, lock)


def resume_counts(
    saved: Mapping[str, Any], *, workers: int | None, max_workers: int | None
) -> dict[str, int]:
    """The worker counts a resume runs with: the job's recorded ``workers``, ``max_workers``
    and ``min_workers`` (``saved``, its spec's dict) with ``tidal resume``'s ``--workers`` and
    ``--max-workers`` over them. Contract: what is given is kept as given, never raised or
    lowered to fit, so ``JobSpec`` refuses what ``tidal run`` would (``--workers 2
    --max-workers 1``: ``need --min-workers <= --workers <= --max-workers``); without
    ``--max-workers`` the recorded one is raised to a larger ``--workers`` (``run``'s
    default: the largest count asked for); ``--min-workers`` is lowered to a smaller
    ``--workers`` (resume has no ``--min-workers`` flag to say it with)."""
    n = workers if workers is not None else int(saved["workers"])
    top = max_workers if max_workers is not None else max(n, int(saved["max_workers"]))
    return {"workers": n, "max_workers": top, "min_workers": min(int(saved["min_workers"]), n)}


def restore_record(home: Path, name: str, *, storage: str | None = None) -> None:
    """A job with no record in ``tidal.db`` but with a copy of its spec: its record again,
    from that copy, so it resumes from its newest checkpoint. The copy is the home's
    (``JobDir.spec_file``, beside its checkpoints: the damaged file moved aside,
    ``docs/decisions/damaged-journal.md``) or, with ``storage`` (``--checkpoint-dir``), the
    one in the job's checkpoint folder there (``fence.SPEC``: the home is gone,
    ``docs/decisions/object-store-checkpoints.md``)."""
    from tidal.checkpoint import fence
    from tidal.coordinator.records.db import Database
    from tidal.coordinator.records.home import checkpoint_folder
    from tidal.protocol import EventView

    jd = job_dir(home, name)
    spec, source = jd.read_spec(), str(jd.spec_file)
    if spec is None or not (jd.path / "checkpoints").is_dir():
        spec = None
    if spec is None and storage is not None:
        folder = checkpoint_folder(home, name, storage)
        spec, source = fence.read_spec(folder), f"{folder}/{fence.SPEC}"
    if spec is None or spec.get("name") != name:
        return
    if db_path(home).exists():
        db = database(home)
        try:
            if db.has_job(name):
                return
        finally:
            db.close()
    db = Database(db_path(home))
    try:
        db.create_job(name=name, spec=spec, target=spec["workers"])
        why = f"job {name}'s record rebuilt from {source} (no record in {db_path(home)})"
        db.add_event(name, EventView(time=time.time(), kind="job", message=why))
    finally:
        db.close()
    print(f"tidal: {why}", file=sys.stderr)


def detach(
    spec: JobSpec,
    home: Path,
    resume: Resume | None,
    *,
    tensorboard: str | None,
    lock: int,
    attach: Attach | None = None,
) -> int:
    jd = job_dir(home, spec.name)
    jd.path.mkdir(parents=True, exist_ok=True)
    with open(jd.path / "coordinator.log", "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tidal.host.detached",
                str(home),
                json.dumps(spec.to_dict()),
                *([json.dumps(vars(resume))] if resume else []),
                *(["--tensorboard", tensorboard] if tensorboard else []),
                *(["--attach", json.dumps(vars(attach))] if attach else []),
                *["--lock-fd", str(lock)],
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(lock,),
        )
    deadline = time.monotonic() + 60
    old = jd.read_coordinator()  # an attach's: the dead coordinator's, until replaced
    while time.monotonic() < deadline:
        info = jd.read_coordinator()
        if info and info != old:
            if spec.backend == "hosts":  # the line that adds a host (its file is written)
                print(
                    f"tidal: to add a host, run there: tidal worker --join {info['url']} "
                    f"--token-file {jd.join_token_file}",
                    file=sys.stderr,
                )
            print(spec.name)
            return 0
        if proc.poll() is not None:
            lines = (jd.path / "coordinator.log").read_text(errors="replace").strip().splitlines()
            last = lines[-1].removeprefix("tidal: error: ") if lines else ""
            raise CliError(last or f"the coordinator exited with {proc.returncode}")
        time.sleep(0.05)
    raise CliError(f"the coordinator of {spec.name} did not start within 60 s")
