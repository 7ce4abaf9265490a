"""``tidal``: run, inspect, scale and stop elastic jobs. Talks to coordinators over HTTP only
(``run`` hosts one in its own process); reads SQLite when no coordinator answers.

The commands that start a job are in ``launch``, the reading of a job's status in
``lookup``; this module has the parser and the commands that inspect, scale and stop."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from tidal.config import JobSpec, add_flags
from tidal.coordinator.records.home import check_home, db_path, job_dir, os_error_line, resolve_home
from tidal.launch import cmd_resume, cmd_run, launch
from tidal.lookup import CliError, database, get_status, newest_job, running_client

if TYPE_CHECKING:
    from tidal.client import CoordinatorClient
    from tidal.protocol import JobStatus

# The client, the wire messages and the records (httpx, pydantic: ~0.25 s) are imported
# where used, not here: building the parser (every command) needs none of them, and
# ``tidal run`` reaches the workers' zygote, whose imports are a cold start's critical path,
# that much sooner (its claim's database check still imports the wire messages first).


def cmd_status(args: argparse.Namespace) -> int:
    home = resolve_home(args.home)
    status = get_status(home, args.job or newest_job(home))
    history = {}
    if args.history:  # the per-step values of tidal.log, from the home's records
        db = database(home)
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
    """Run a mutating call on the job's running coordinator; its refusal is one CLI line, and
    so is a coordinator that dies during the call (``lookup.lost_call_line``)."""
    import httpx

    from tidal.client import CoordinatorError
    from tidal.lookup import lost_call_line

    client = running_client(resolve_home(args.home), args.job)
    try:
        return call(client)
    except CoordinatorError as exc:
        raise CliError(str(exc)) from None
    except httpx.TransportError as exc:
        sent = not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
        what = f"scale to {args.workers} workers" if args.command == "scale" else "stop"
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise CliError(lost_call_line(args.job, what, sent=sent, why=why)) from None
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
    """Every job of the home; with a damaged ``tidal.db`` (``db.DamagedJournal``), the jobs
    whose records still read are listed, the others marked ``damaged``, and the one line
    that says so ends the command (exit 1)."""
    from tidal.coordinator.records.db import DamagedJournal

    home = resolve_home(args.home)
    check_home(home)
    rows: list[JobStatus | str] = []  # a name alone: a job whose records cannot be read
    damage = None
    if db_path(home).exists():  # a home that does not exist (yet) has no jobs
        db = database(home, check=False)
        try:
            damage = db.damage()
            try:
                names = db.job_names()
            except DamagedJournal:  # the jobs' own folders name them
                jobs_dir = home / "jobs"
                names = sorted(p.name for p in jobs_dir.iterdir()) if jobs_dir.is_dir() else []
        finally:
            db.close()
        for n in names:
            try:
                rows.append(get_status(home, n, check=False))
            except DamagedJournal as exc:
                rows.append(n)
                damage = damage or str(exc)
    if args.json:
        print(json.dumps([_job_row(s) for s in rows], indent=2))
    else:
        from tidal.display import print_jobs

        print_jobs(rows)
    if damage is not None:
        raise CliError(damage)
    return 0


def _job_row(s: JobStatus | str) -> dict:
    if isinstance(s, str):
        return {"name": s, "state": "damaged"}
    return {
        "name": s.name,
        "state": s.state.value,
        "step": s.step,
        "world_size": s.world_size,
        "target_workers": s.target_workers,
        "created": s.created,
        "script": s.script,
    }


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
    """How ``run`` and ``resume`` host the job (``launch``); not part of the job's spec."""
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
    resume.add_argument(
        "--max-workers",
        type=int,
        help="default: the job's recorded --max-workers, raised to a larger --workers "
        "(given with a larger --workers: refused, as by run)",
    )
    resume.add_argument(
        "--checkpoint-dir",
        metavar="DIR|URL",
        help="where the job's checkpoints are (default: where it ran with them); a job "
        "that --home has no record of (its home is gone) is rebuilt from the spec kept there",
    )
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
    from tidal.worker_cli import add_parser as add_worker_parser

    add_attach_parser(sub, common, launch)
    add_simulate_parser(sub)
    add_worker_parser(sub, common)
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
