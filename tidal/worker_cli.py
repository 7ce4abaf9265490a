"""``tidal worker --join URL --token-file FILE [--slots N] [--home DIR]``: add this machine to
a job served with ``tidal run --listen HOST:PORT`` (the hosts backend).

``tidal run --listen`` prints the line to type (its URL, and the file holding the hosts'
token: copy that file to this machine). This machine then offers ``--slots`` workers until
the job ends; the coordinator starts and stops workers here through the agent
(``tidal.hosts.agent``), which forwards Ctrl-C or SIGTERM to them as a planned leave.
What it does goes to stderr, one line each (``logging``). Bad input (no such file, an empty
token, a URL that is no job's) is one line and exit 1.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from tidal.coordinator.records.home import check_home, resolve_home


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register ``worker`` on the ``tidal`` subparsers."""
    worker = sub.add_parser(
        "worker",
        parents=[common],
        help="add this machine's workers to a job served with `tidal run --listen`",
        description="Join the job at URL and run its workers here, at most --slots at once, "
        "until the job ends. `tidal run --listen HOST:PORT` prints the command; Ctrl-C "
        "takes this machine out of the job (its workers leave at a step boundary).",
    )
    worker.add_argument(
        "--join", required=True, metavar="URL", help="the job's URL, as `tidal run` printed it"
    )
    worker.add_argument(
        "--token-file",
        required=True,
        metavar="FILE",
        help="the job's hosts' token: the file `tidal run` named, copied to this machine",
    )
    worker.add_argument(
        "--slots",
        type=int,
        default=None,
        help="the most workers this machine runs at once (default: one per GPU, or 1)",
    )
    worker.set_defaults(fn=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    from tidal.backends.gpus import visible_gpus
    from tidal.hosts.agent import AgentSettings, HostAgent
    from tidal.hosts_protocol import MAX_SLOTS

    try:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ValueError(
            f"cannot read --token-file {args.token_file}: {exc.strerror or exc}"
        ) from None
    if not token:
        raise ValueError(f"--token-file {args.token_file} is empty")
    gpus = visible_gpus()
    slots = args.slots if args.slots is not None else max(1, gpus)
    if not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"--slots must be between 1 and {MAX_SLOTS}, got {slots}")
    home = resolve_home(args.home)
    check_home(home)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("tidal worker: %(message)s"))
    log = logging.getLogger("tidal.hosts")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    agent = HostAgent(
        AgentSettings(
            url=args.join,
            token=token,
            slots=slots,
            home=home,
            name=socket.gethostname(),
            gpus=gpus,
        )
    )
    return agent.run()
