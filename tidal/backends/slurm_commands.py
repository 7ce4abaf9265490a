"""Slurm's commands, run: each function asks one command and reads its answer with
``slurm_rules`` (the Slurm backend's only contact with Slurm besides ``srun``).

A command that fails is a ``SlurmError`` (a ``ValueError``: one line, the command's own last
line of error); none waits longer than ``COMMAND_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

from tidal.backends.addresses import route_source
from tidal.backends.slurm_rules import (
    JOB_FORMAT,
    NODE_FORMAT,
    STEP_FORMAT,
    Allocation,
    Node,
    Queued,
    allocation,
    controllers,
    parse_nodes,
    parse_queue,
    reachable_address,
)
from tidal.config import JobSpec, parse_listen

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 30.0
COMMANDS = ("srun", "squeue", "sinfo", "scancel", "scontrol")


class SlurmError(ValueError):
    """A Slurm command failed: its first line of error."""


def slurm(*argv: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    """Run one of Slurm's commands; its output. ``SlurmError`` with its error line."""
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"`{' '.join(argv[:3])}` failed: {exc}") from None
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise SlurmError(f"`{' '.join(argv[:3])}` failed: {said}")
    return proc.stdout


def check_commands() -> None:
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise ValueError(
            f"the slurm backend needs Slurm's commands on PATH; missing: {', '.join(missing)}"
        )


def current_allocation() -> Allocation | None:
    """The allocation this process runs in (``SLURM_JOB_ID``), its node list expanded by
    ``scontrol show hostnames``; None outside one."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError(f"SLURM_JOB_ID={job_id} is set but SLURM_JOB_NODELIST is not")
    nodes = slurm("scontrol", "show", "hostnames", nodelist).split()
    return allocation(job_id, nodes, os.environ.get("SLURM_TASKS_PER_NODE"))


def node_states(names: list[str]) -> dict[str, Node]:
    if not names:
        return {}
    return parse_nodes(slurm("sinfo", "-h", "-N", "-n", ",".join(names), "-o", NODE_FORMAT))


def coordinator_address(spec: JobSpec) -> str:
    """The address the coordinator binds and its workers reach it at: ``--listen``'s, else
    the one this machine's route to Slurm's controller leaves from, else its route to a node
    of the allocation (``slurm_rules.reachable_address``: never loopback)."""
    if spec.listen:
        return parse_listen(spec.listen)[0]
    check_commands()
    targets = controllers(slurm("scontrol", "show", "config"))
    alloc = current_allocation()
    if alloc is not None:
        targets += [n.address or n.name for n in node_states(list(alloc.nodes)).values()]
    sources = []
    for target in targets:
        try:
            sources.append(route_source(target, 9))
        except OSError:
            continue
    found = reachable_address(sources)
    if found is None:
        raise ValueError(
            f"cannot tell the address Slurm's nodes reach this machine at (the routes to "
            f"{', '.join(targets) or 'the controller'} are loopback): pass --listen ADDRESS:0"
        )
    return found


def tail(path: Path, size: int = 4096) -> str:
    """The end of a worker's log (its srun's last words are there)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def last_line(path: Path) -> str:
    lines = tail(path).strip().splitlines()
    return lines[-1][:300] if lines else ""


def job_nodes(job_id: str) -> set[str]:
    """The nodes allocation ``job_id`` holds now (a failed node leaves it: ``--no-kill``)."""
    listed = slurm("squeue", "-h", "-j", job_id, "-o", "%N").strip()
    return set(node_states([listed])) if listed else set()


def queue(job_id: str | None) -> dict[str, Queued]:
    """The steps of allocation ``job_id`` (None: this user's jobs), by name."""
    if job_id is not None:
        return parse_queue(slurm("squeue", "-h", "-s", "-j", job_id, "-o", STEP_FORMAT), steps=True)
    return parse_queue(slurm("squeue", "-h", "--me", "-o", JOB_FORMAT))


def scancel(target: str, sig: int | None = None) -> bool:
    """``scancel`` of a step or job (``sig``: ``--signal``, else cancel it); whether it said
    it did. Slurm 22.05's scancel may answer "Invalid job id specified" (exit 225) for a step
    it signalled all the same ("Signal 15 to step J.S"): callers do not rely on the answer."""
    argv = ["scancel", target]
    if sig is not None:
        argv.insert(1, f"--signal={signal.Signals(sig).name[3:]}")
    try:
        slurm(*argv)
        return True
    except SlurmError as exc:
        log.debug("%s", exc)
        return False
