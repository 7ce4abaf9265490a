"""``tidal``: run, inspect, scale and stop elastic jobs. Talks to coordinators over HTTP only
(``run`` hosts one in its own process); reads SQLite when no coordinator answers."""

from __future__ import annotations

import argparse
import gc
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tidal import pids
from tidal.config import JobSpec, add_flags, from_flags, parse_schedule
from tidal.coordinator.home import (
    JobBusy,
    check_home,
    db_path,
    job_dir,
    os_error_line,
    resolve_home,
)
from tidal.coordinator.supervisor import Attach
from tidal.policy.inputs import parse_duration

if TYPE_CHECKING:
    from tidal.client import CoordinatorClient
    from tidal.coordinator.records import Resume
    from tidal.protocol import JobStatus

# The client, the wire messages and the records (httpx, pydantic: ~0.25 s) are imported
# where used, not here: building the parser (every command) needs none of them, and
# ``tidal run`` reaches the workers' zygote, whose imports are a cold start's critical path,
# that much sooner (its claim's database check still imports the wire messages first).


class CliError(Exception):
    """One line for stderr; the command exits 1."""


# -- finding jobs ----------------------------------------------------------------------
def _database(home: Path):
    """The home's records, for reading (a read-only home still reads)."""
    from tidal.coordinator.db import Database

    check_home(home)
    if not db_path(home).exists():
        raise CliError(f"no jobs in {home} (set --home or $TIDAL_HOME)")
    return Database(db_path(home), readonly=True)


def _client(home: Path, name: str) -> CoordinatorClient | None:
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


def get_status(home: Path, name: str) -> JobStatus:
    from tidal.coordinator.db import UnknownJob
    from tidal.protocol import JobState

    check_home(home)
    client = _client(home, name)
    if client is not None:
        try:
            return client.status()
        finally:
            client.close()
    if not db_path(home).exists():
        raise CliError(f"unknown job {name!r}: no jobs in {home} (set --home or $TIDAL_HOME)")
    db = _database(home)
    try:
        status = db.load_status(name)
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
            _mark_lost_workers(status)
    _add_checkpoints_on_disk(home, status)
    return status


def _mark_lost_workers(status: JobStatus) -> None:
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


def _add_checkpoints_on_disk(home: Path, status: JobStatus) -> None:
    """The checkpoints on disk, whether or not their report reached the records (a report
    lost with its coordinator); records whose folder is gone are left out."""
    from tidal.checkpoint.layout import found_on_disk
    from tidal.protocol import CheckpointView

    listed = {c.step: c for c in status.checkpoints if Path(c.path).is_dir()}
    for step, path, size in found_on_disk(job_dir(home, status.name).path / "checkpoints"):
        listed.setdefault(step, CheckpointView(step=step, path=str(path), bytes=size))
    status.checkpoints = [listed[s] for s in sorted(listed)]


def _newest_job(home: Path) -> str:
    db = _database(home)
    try:
        names = db.job_names()
    finally:
        db.close()
    if not names:
        raise CliError(f"no jobs in {home}")
    return names[-1]


def _running_client(home: Path, name: str) -> CoordinatorClient:
    client = _client(home, name)
    if client is None:
        status = get_status(home, name)  # raises for an unknown job
        if status.coordinator_unresponsive:
            raise CliError(
                f"job {name!r} is {status.state.value}, but its coordinator does not answer"
            )
        raise CliError(f"job {name!r} is not running (state: {status.state.value})")
    return client


def _claim(home: Path, name: str) -> int:
    """For ``tidal run --name NAME``: take the job's lock, then check under it that no job of
    that name exists, so that of two runs of one name (even at once) exactly one goes on.
    Returns the lock's descriptor, for the coordinator to hold for its life."""
    from tidal.coordinator.db import Database

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
            _check_writable_folder(home)  # until the job really starts (its backend too)
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


def _check_writable_folder(home: Path) -> None:
    """One line if ``home`` cannot hold the job's database (probed with a file removed at
    once: ``os.access`` says yes to root on a read-only mount)."""
    from tidal.coordinator.home import HomeError, os_error_line

    probe = home / f".tidal-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise HomeError(os_error_line("write", exc)) from None


# -- commands -----------------------------------------------------------------------------
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
        name=args.name or f"{script.stem}-{secrets.token_hex(2)}",
        script=str(script.resolve()),
        script_args=list(args.script_args),
        max_workers=args.max_workers if args.max_workers is not None else peak,
        schedule=schedule,
        capacity_trace=_capacity(args.capacity),
        deadline_s=parse_duration(args.deadline) if args.deadline else None,
    )
    from tidal.backends import check_capacity
    from tidal.policy import get_policy

    check_capacity(spec)  # an unknown backend, or more workers than it holds: one line
    if spec.backend == "ray":
        from tidal.backends.ray import import_ray

        import_ray()  # one line if the extra is missing, before anything is recorded
    get_policy(spec.policy)
    return _launch(spec, home, args, resume=None)


def _capacity(path: str | None) -> str | None:
    """A validated capacity trace's absolute path (one clear line if it is malformed)."""
    if path is None:
        return None
    from tidal.sim.trace import load_trace

    load_trace(path)
    return str(Path(path).resolve())


def _launch(
    spec: JobSpec,
    home: Path,
    args: argparse.Namespace,
    resume: Resume | None,
    lock: int | None = None,
    attach: Attach | None = None,
) -> int:
    """Host the job here, or in a detached process. ``lock``: the job's lock (``_claim``;
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
        if lock is None:
            lock = _claim(home, spec.name)
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
            return _detach(spec, home, resume, tensorboard=tensorboard, lock=lock, attach=attach)
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
    from tidal.checkpoint.layout import newest_good, verify

    home = resolve_home(args.home)
    check_home(home)
    if not db_path(home).exists():
        raise CliError(f"unknown job {args.job!r}: no jobs in {home} (set --home or $TIDAL_HOME)")
    db = _database(home)
    try:
        if not db.has_job(args.job):
            raise CliError(f"unknown job {args.job!r} in {home} (`tidal jobs` lists them)")
        try:  # held from here until the new coordinator ends: no other can start meanwhile
            lock = job_dir(home, args.job).lock()
        except JobBusy as exc:
            raise CliError(
                f"job {args.job!r} is running ({exc}); `tidal stop` it before resuming"
            ) from None
        try:
            state = db.load_status(args.job).state  # no coordinator: what it last recorded
            spec_dict = db.job_spec(args.job)
        except BaseException:
            os.close(lock)
            raise
    finally:
        db.close()
    from tidal.coordinator.records import Resume
    from tidal.protocol import JobState

    try:
        if state == JobState.SUCCEEDED:
            raise CliError(f"job {args.job!r} already succeeded; nothing to resume")
        path, warnings = newest_good(job_dir(home, args.job).path / "checkpoints")
        for line in warnings:
            print(f"tidal: warning: {line}", file=sys.stderr)
        if path is None:
            raise CliError(f"job {args.job!r} has no good checkpoint to resume from")
        step = verify(path, hashes=False)["step"]  # verified just now, with the hashes
    except BaseException:
        os.close(lock)
        raise
    workers = args.workers if args.workers is not None else spec_dict["workers"]
    spec_dict.update(
        workers=workers,
        max_workers=max(workers, args.max_workers or spec_dict["max_workers"]),
        min_workers=min(spec_dict["min_workers"], workers),
    )
    try:
        spec = JobSpec.from_dict(spec_dict)
    except BaseException:
        os.close(lock)
        raise
    resume = Resume(path=str(path), step=step, warnings=warnings)
    print(
        f"{spec.name}: resuming from {path.name} (step {step}) with {workers} workers",
        file=sys.stderr,
    )
    return _launch(spec, home, args, resume, lock)


def _detach(
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
                "tidal.host.runner",
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
            print(spec.name)
            return 0
        if proc.poll() is not None:
            lines = (jd.path / "coordinator.log").read_text(errors="replace").strip().splitlines()
            last = lines[-1].removeprefix("tidal: error: ") if lines else ""
            raise CliError(last or f"the coordinator exited with {proc.returncode}")
        time.sleep(0.05)
    raise CliError(f"the coordinator of {spec.name} did not start within 60 s")


def cmd_status(args: argparse.Namespace) -> int:
    home = resolve_home(args.home)
    status = get_status(home, args.job or _newest_job(home))
    history = {}
    if args.history:  # the per-step values of tidal.log, from the home's records
        db = _database(home)
        try:
            history = db.step_history(status.name)
        finally:
            db.close()
    if args.json and args.history:
        data = status.model_dump(mode="json")
        data["history"] = {name: s.model_dump(mode="json") for name, s in history.items()}
        print(json.dumps(data, indent=2))
    elif args.json:
        print(status.model_dump_json(indent=2))
    else:
        from tidal.display import print_status

        print_status(status)
        for name, s in history.items():
            last = f"{s.value[-1]:.6g} at step {s.step[-1]}"
            print(f"{name}: {len(s.step)} steps logged, last {last}")
    return 0


def _mutate(args: argparse.Namespace, call: Callable[[CoordinatorClient], JobStatus]) -> JobStatus:
    """Run a mutating call on the job's running coordinator; its refusal is one CLI line."""
    from tidal.client import CoordinatorError

    client = _running_client(resolve_home(args.home), args.job)
    try:
        return call(client)
    except CoordinatorError as exc:
        raise CliError(str(exc)) from None
    finally:
        client.close()


def cmd_scale(args: argparse.Namespace) -> int:
    status = _mutate(args, lambda c: c.scale(args.workers))
    print(f"{status.name}: target {status.target_workers} workers (now {status.world_size})")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    _mutate(args, lambda c: c.stop())
    print(f"{args.job}: stopping")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    home = resolve_home(args.home)
    check_home(home)
    if not db_path(home).exists():  # a home that does not exist (yet) has no jobs
        rows: list[JobStatus] = []
    else:
        db = _database(home)
        try:
            names = db.job_names()
        finally:
            db.close()
        rows = [get_status(home, n) for n in names]
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": s.name,
                        "state": s.state.value,
                        "step": s.step,
                        "world_size": s.world_size,
                        "target_workers": s.target_workers,
                        "created": s.created,
                        "script": s.script,
                    }
                    for s in rows
                ],
                indent=2,
            )
        )
    else:
        from tidal.display import print_jobs

        print_jobs(rows)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    import webbrowser

    home = resolve_home(args.home)
    if args.job:
        status = get_status(home, args.job)  # one line for an unknown job
        if status.dashboard_url and not args.serve:  # its coordinator answered: it serves it
            print(status.dashboard_url, flush=True)
            if args.open:
                webbrowser.open(status.dashboard_url)
            return 0
    elif not db_path(home).exists():
        raise CliError(f"no jobs in {home} (set --home or $TIDAL_HOME)")
    from tidal.dashboard import DashboardServer

    server = DashboardServer(home, port=args.port)
    url = server.job_url(args.job) if args.job else server.url + "/"
    print(url, flush=True)
    print(f"serving the jobs of {home} read-only; Ctrl-C to stop", file=sys.stderr, flush=True)
    if args.open:
        webbrowser.open(url)
    try:
        server.serve()
    except KeyboardInterrupt:  # Ctrl-C is how it is meant to end
        pass
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from tidal.dashboard.logs import print_logs

    home = resolve_home(args.home)
    jd = job_dir(home, args.job)
    if not jd.path.is_dir():
        get_status(home, args.job)  # one line for an unknown job
        raise CliError(f"job {args.job!r} has no logs in {jd.logs}")
    return print_logs(jd, worker=args.worker, follow=args.follow)


TENSORBOARD_HELP = "write the metrics and world size as TensorBoard event files in DIR/NAME"


# -- the parser ---------------------------------------------------------------------------
def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """How ``run`` and ``resume`` host the job (``_launch``); not part of the job's spec."""
    parser.add_argument("--detach", action="store_true", help="print the job name and return")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--tensorboard", metavar="DIR", help=TENSORBOARD_HELP)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--home", help="state folder (default ./.tidal, or $TIDAL_HOME)")
    parser = argparse.ArgumentParser(prog="tidal", description="Elastic training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", parents=[common], help="run a training script as an elastic job")
    add_flags(run, JobSpec)  # one option per JobSpec field that is a flag (config.py)
    _add_launch_flags(run)
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(fn=cmd_run)

    resume = sub.add_parser(
        "resume", parents=[common], help="continue a stopped or interrupted job from its checkpoint"
    )
    resume.add_argument("job")
    resume.add_argument("--workers", type=int, help="default: the job's recorded --workers")
    resume.add_argument("--max-workers", type=int, help="default: the job's recorded --max-workers")
    _add_launch_flags(resume)
    resume.set_defaults(fn=cmd_resume)

    status = sub.add_parser("status", parents=[common], help="a job's state (default: the newest)")
    status.add_argument("job", nargs="?")
    status.add_argument("--json", action="store_true")
    status.add_argument(
        "--history",
        action="store_true",
        help="add the per-step series of tidal.log (with --json: a `history` field)",
    )
    status.set_defaults(fn=cmd_status)

    scale = sub.add_parser("scale", parents=[common], help="set a running job's worker count")
    scale.add_argument("job")
    scale.add_argument("workers", type=int)
    scale.set_defaults(fn=cmd_scale)

    stop = sub.add_parser("stop", parents=[common], help="stop a running job")
    stop.add_argument("job")
    stop.set_defaults(fn=cmd_stop)

    jobs = sub.add_parser("jobs", parents=[common], help="list the jobs under --home")
    jobs.add_argument("--json", action="store_true")
    jobs.set_defaults(fn=cmd_jobs)

    dashboard = sub.add_parser(
        "dashboard",
        parents=[common],
        help="web dashboard: a running job's page, or serve every job of --home",
        description="With a running JOB: print (or --open) its page on its coordinator. "
        "Otherwise serve every job of --home, running or finished, read-only from SQLite, "
        "on 127.0.0.1 until Ctrl-C (the first line printed is the URL).",
    )
    dashboard.add_argument("job", nargs="?", help="a job to show (default: the list of jobs)")
    dashboard.add_argument("--port", type=int, default=0, help="port to serve on (default: free)")
    dashboard.add_argument("--open", action="store_true", help="open the page in a browser")
    dashboard.add_argument(
        "--serve", action="store_true", help="serve from SQLite even if the job's coordinator runs"
    )
    dashboard.set_defaults(fn=cmd_dashboard)

    logs = sub.add_parser("logs", parents=[common], help="print a job's worker logs")
    logs.add_argument("job")
    logs.add_argument("--worker", type=int, metavar="ID", help="only this worker's log")
    logs.add_argument(
        "--follow", "-f", action="store_true", help="keep printing new lines until the job ends"
    )
    logs.set_defaults(fn=cmd_logs)

    from tidal.attach_cli import add_parser as add_attach_parser
    from tidal.sim_cli import add_parser as add_simulate_parser

    add_attach_parser(sub, common, _launch)
    add_simulate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (CliError, ValueError) as exc:  # HomeError and JobBusy too
        print(f"tidal: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a home or file the command cannot use: one line, no traceback
        print(f"tidal: error: {os_error_line('use', exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        # The interpreter's last collection, at exit, walks every object still alive: with
        # torch imported (`tidal run` is the job's supervisor) 0.5 to 0.7 s after the job
        # has ended. Nothing of the CLI's needs collecting then.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
