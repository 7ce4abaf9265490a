"""Where ``tidal run``'s lines go once its terminal or its output pipe is gone.

``tidal run`` writes to the terminal it was started from (progress on stdout, the job's end
on stderr). That terminal can go away while the job runs: the pipe it writes into closes
(``tidal run ... | head -3``: EPIPE), or the terminal hangs up (a closed SSH session, a
closed window: SIGHUP to the foreground process group, then EIO on every write). Neither is
a request to stop the job (``docs/decisions/hangup.md``): the job trains on, reachable as
before through ``tidal status``, ``tidal attach`` and ``tidal stop``, and says so once in its
events; from then on the process writes what it would have written to the terminal into the
job's ``coordinator.log`` (the file ``--detach`` writes to), and the live progress lines stop
(as with ``--detach``, ``--quiet``).

``output_lost`` decides (pure); ``Terminal`` carries it out, once per process: the
supervisor (``tidal run`` itself) and its forked coordinator each hold their own descriptors
1 and 2, and each switches its own. A coordinator forked after its supervisor switched
inherits the log.
"""

from __future__ import annotations

import errno
import os
import sys
from dataclasses import dataclass
from pathlib import Path

#: Errors of a write that say the terminal or the reader is gone (not the disk).
GONE_ERRNOS = frozenset({errno.EPIPE, errno.EIO, errno.ENXIO, errno.EBADF, errno.ECONNRESET})


@dataclass(frozen=True)
class OutputVerdict:
    """``switch``: send this process's stdout and stderr to the log now; ``event``: the line
    the job records (None: nothing new to say)."""

    switch: bool
    event: str | None


def gone(exc: BaseException) -> bool:
    """True if ``exc``, raised by a write to stdout or stderr, means the reader is gone."""
    return isinstance(exc, OSError) and exc.errno in GONE_ERRNOS


def output_lost(cause: str, *, already: str | None, job: str, log: Path) -> OutputVerdict:
    """What to do when ``cause`` ("SIGHUP", "EPIPE", ...) says the terminal is gone.
    ``already``: the cause this process switched for before, if any (then nothing more)."""
    if already is not None:
        return OutputVerdict(switch=False, event=None)
    what = (
        "the terminal of `tidal run` hung up (SIGHUP)"
        if cause == "SIGHUP"
        else f"the output of `tidal run` was closed ({cause})"
    )
    return OutputVerdict(
        switch=True,
        event=(
            f"{what}: the job trains on; its lines go to {log}; "
            f"`tidal status {job}` follows it, `tidal stop {job}` stops it"
        ),
    )


class Terminal:
    """This process's stdout and stderr, switched to ``log`` once they are gone."""

    def __init__(self, log: Path, job: str) -> None:
        self.log = log
        self.job = job
        self.lost: str | None = None  # the cause this process switched for

    def lose(self, cause: str) -> str | None:
        """The terminal is gone (``cause``): switch to the log if not done yet; returns the
        line for the job's events, or None if there is nothing new to record."""
        verdict = output_lost(cause, already=self.lost, job=self.job, log=self.log)
        if verdict.switch:
            self.lost = cause
            self._switch()
        return verdict.event

    def _switch(self) -> None:
        try:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError:
            fd = os.open(os.devnull, os.O_WRONLY)  # nowhere to write: at least never fail
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()  # what waits in the buffer now goes to the log, not the pipe
            except (OSError, ValueError):
                pass
        for target in (1, 2):
            os.dup2(fd, target)
        os.close(fd)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()  # a buffer a failed flush kept goes to the log
            except (OSError, ValueError):
                pass

    def say(self, line: str) -> None:
        """``line`` on stderr; into the log if stderr is gone (never raises for that)."""
        try:
            print(line, file=sys.stderr, flush=True)
            return
        except OSError as exc:
            if not gone(exc):
                raise
            self.lose(errno.errorcode.get(exc.errno or 0, "EPIPE"))
        try:
            print(line, file=sys.stderr, flush=True)
        except OSError:
            pass
