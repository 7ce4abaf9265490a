"""Where a job's records live: ``HOME/tidal.db`` and ``HOME/jobs/NAME/``.

The CLI finds a running job's coordinator through ``HOME/jobs/NAME/coordinator.json``
(its URL, pid and the job's token; readable by the owner only).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

ENV_HOME = "TIDAL_HOME"
DEFAULT_HOME = ".tidal"


def resolve_home(home: str | None) -> Path:
    """``--home`` if given, else ``$TIDAL_HOME``, else ``./.tidal`` (an argument wins)."""
    return Path(home or os.environ.get(ENV_HOME) or DEFAULT_HOME).resolve()


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

    def write_coordinator(self, *, url: str, token: str, pid: int) -> None:
        tmp = self.coordinator_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": url, "token": token, "pid": pid}, f)
        os.replace(tmp, self.coordinator_file)

    def read_coordinator(self) -> dict | None:
        try:
            return json.loads(self.coordinator_file.read_text())
        except (OSError, ValueError):
            return None


def job_dir(home: Path, name: str) -> JobDir:
    return JobDir(home / "jobs" / name)


def db_path(home: Path) -> Path:
    return home / "tidal.db"
