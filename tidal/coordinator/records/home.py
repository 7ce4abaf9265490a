"""Where a job's records live: ``HOME/tidal.db`` and ``HOME/jobs/NAME/``.

The CLI finds a running job's coordinator through ``HOME/jobs/NAME/coordinator.json``
(its URL, pid and the job's token; readable by the owner only).

``HOME/jobs/NAME/lock`` says whether a coordinator holds the job: the process that hosts it
keeps an exclusive ``flock`` on it for its whole life (the kernel releases it when that
process dies, however it dies). ``tidal run --name`` and ``tidal resume`` take it before they
look at the job's record, so two coordinators can never host one job, and a coordinator that
is alive but does not answer (stopped, swapped out) is told apart from a dead one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tidal.checkpoint import location
from tidal.checkpoint.location import Location
from tidal.config import job_name_error

ENV_HOME = "TIDAL_HOME"
DEFAULT_HOME = ".tidal"


def resolve_home(home: str | None) -> Path:
    """``--home`` if given, else ``$TIDAL_HOME``, else ``./.tidal`` (an argument wins)."""
    return Path(home or os.environ.get(ENV_HOME) or DEFAULT_HOME).resolve()


class HomeError(ValueError):
    """The home (or its database) cannot be used; the message is one line that says why."""


def os_error_line(action: str, exc: OSError) -> str:
    """``cannot write /h/jobs/x: Permission denied`` (no errno, no traceback)."""
    where = f" {exc.filename}" if exc.filename is not None else ""
    return f"cannot {action}{where}: {exc.strerror or exc}"


def check_home(home: Path) -> None:
    """One line if ``home`` exists but is not a folder."""
    if home.exists() and not home.is_dir():
        raise HomeError(f"--home {home} is not a folder")


class JobBusy(ValueError):
    """Another process (a coordinator) holds the job's lock."""


LOCK_RETRY_S = 0.2  # a status check holds a shared lock for microseconds; wait those out


@dataclass(frozen=True)
class JobDir:
    path: Path

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def worker_log(self, worker_id: int) -> Path:
        return self.logs / f"worker-{worker_id}.log"

    @property
    def coordinator_file(self) -> Path:
        return self.path / "coordinator.json"

    def write_coordinator(
        self, *, url: str, token: str, pid: int, supervisor_pid: int | None = None
    ) -> None:
        """``pid``: the coordinator's (it changes when its supervisor restarts it);
        ``supervisor_pid``: the process that holds the job's lock and restarts it."""
        tmp = self.coordinator_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            record = {"url": url, "token": token, "pid": pid, "supervisor_pid": supervisor_pid}
            json.dump(record, f)
        os.replace(tmp, self.coordinator_file)

    @property
    def join_token_file(self) -> Path:
        """The hosts' credential of a job served with ``--listen`` (``tidal worker --join URL
        --token-file FILE`` reads it; readable by the owner only)."""
        return self.path / "join-token"

    def write_join_token(self, token: str) -> None:
        tmp = self.join_token_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, self.join_token_file)

    def read_coordinator(self) -> dict | None:
        try:
            return json.loads(self.coordinator_file.read_text())
        except (OSError, ValueError):
            return None

    @property
    def spec_file(self) -> Path:
        """A copy of the job's spec beside its checkpoints: with it ``tidal resume`` rebuilds
        the job's record when ``tidal.db`` was damaged and moved aside."""
        return self.path / "spec.json"

    def write_spec(self, spec: dict) -> None:
        """Atomic; a copy, so a folder that cannot take it is no error (the records say why)."""
        tmp = self.spec_file.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(spec))
            os.replace(tmp, self.spec_file)
        except OSError:
            pass

    def read_spec(self) -> dict | None:
        try:
            return json.loads(self.spec_file.read_text())
        except (OSError, ValueError):
            return None

    @property
    def lock_file(self) -> Path:
        return self.path / "lock"

    def lock(self) -> int:
        """Take the job's lock: the open descriptor that holds it (close it to release; it is
        not inherited by child processes unless passed on). Raises ``JobBusy`` if another
        process holds it, ``HomeError`` if the folder cannot be written."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise HomeError(os_error_line("write", exc)) from None
        deadline = time.monotonic() + LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise HomeError(os_error_line("lock", exc)) from None
            if time.monotonic() > deadline:
                os.close(fd)
                info = self.read_coordinator() or {}
                pid = f" (pid {info['pid']})" if info.get("pid") else ""
                raise JobBusy(f"its coordinator{pid} holds {self.lock_file}")
            time.sleep(0.01)

    def locked(self) -> bool:
        """True while a process (the job's coordinator) holds the job's lock."""
        try:
            fd = os.open(self.lock_file, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
        finally:
            os.close(fd)  # releases the shared lock, if taken
        return False


class BadJobName(ValueError):
    """A job name that is not one plain folder name (``config.job_name_error``)."""


def job_dir(home: Path, name: str) -> JobDir:
    """The folder of job ``name`` under ``home``; raises ``BadJobName`` (one line) for a name
    that is not a job's, so no command reaches a path outside ``HOME/jobs`` through it."""
    if (why := job_name_error(name)) is not None:
        raise BadJobName(why)
    return JobDir(home / "jobs" / name)


def checkpoint_folder(home: Path, name: str, storage: str | None) -> Location:
    """Where job ``name``'s checkpoints are: ``STORAGE/NAME`` for a job run with
    ``--checkpoint-dir STORAGE`` (a shared folder or an fsspec URL), else the job's folder
    under ``home`` (``HOME/jobs/NAME/checkpoints``)."""
    if storage is None:
        return job_dir(home, name).path / "checkpoints"
    return location.join(location.of(storage), name)


def db_path(home: Path) -> Path:
    return home / "tidal.db"
