"""Worker logs: ``tidal logs JOB [--worker ID] [--follow]`` and the dashboard's log view.

Each worker's stdout and stderr go to ``HOME/jobs/NAME/logs/worker-ID.log`` (the local
backend writes them). Without ``--worker`` every worker's lines are printed, each prefixed
with ``worker ID |`` (as ``docker compose logs`` does); ``--follow`` keeps printing new lines,
from workers that join later too, until the job's coordinator has exited.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import TextIO

from tidal import pids
from tidal.coordinator.records.home import JobDir

FOLLOW_POLL_S = 0.2
_NAME = re.compile(r"worker-(\d+)\.log$")


def worker_logs(jd: JobDir) -> dict[int, Path]:
    """Worker id -> log file, in id order."""
    if not jd.logs.is_dir():
        return {}
    found = {}
    for path in jd.logs.iterdir():
        m = _NAME.match(path.name)
        if m:
            found[int(m.group(1))] = path
    return dict(sorted(found.items()))


def tail(path: Path, max_bytes: int = 64 * 1024) -> str:
    """The end of a log (at most ``max_bytes``, starting at a line)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        data = f.read()
    if size > max_bytes and b"\n" in data:
        data = data.split(b"\n", 1)[1]
    return data.decode(errors="replace")


def coordinator_running(jd: JobDir) -> bool:
    info = jd.read_coordinator()
    return bool(info) and pids.alive(info.get("pid"))


class _Reader:
    """New complete lines of one file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def lines(self, *, final: bool = False) -> list[str]:
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self.offset:  # truncated or replaced: start again
            self.offset, self.partial = 0, b""
        if size == self.offset and not (final and self.partial):
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset += len(data)
        data = self.partial + data
        *complete, self.partial = data.split(b"\n")
        if final and self.partial:
            complete.append(self.partial)
            self.partial = b""
        return [line.decode(errors="replace") for line in complete]


def print_logs(
    jd: JobDir, *, worker: int | None = None, follow: bool = False, out: TextIO | None = None
) -> int:
    """Print the job's worker logs (see the module doc); 0, or raises ``ValueError``."""
    out = out or sys.stdout
    logs = worker_logs(jd)
    if worker is not None and worker not in logs and not (follow and coordinator_running(jd)):
        known = ", ".join(map(str, logs)) or "none yet"
        raise ValueError(f"no log of worker {worker} in {jd.logs} (workers: {known})")
    readers: dict[int, _Reader] = {}

    def drain(final: bool) -> None:
        for wid, path in worker_logs(jd).items():
            if worker is not None and wid != worker:
                continue
            reader = readers.setdefault(wid, _Reader(path))
            prefix = "" if worker is not None else f"worker {wid} | "
            for line in reader.lines(final=final):
                out.write(prefix + line + "\n")
        out.flush()

    try:
        if not follow:
            drain(final=True)
            return 0
        while True:
            running = coordinator_running(jd)  # before the read: no line is missed at the end
            drain(final=not running)
            if not running:
                return 0
            time.sleep(FOLLOW_POLL_S)
    except BrokenPipeError:  # `tidal logs JOB | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
