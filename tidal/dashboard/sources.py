"""Where the dashboard reads jobs from.

``HomeSource``: every job of a home, from SQLite (``tidal dashboard``; also the other jobs of
a coordinator's home). A job recorded as pending or running whose coordinator process is
gone is reported ``interrupted``, as ``tidal status`` does.
``LiveSource``: a coordinator's own job from the coordinator itself (fresh, plus each worker's
step rate), every other job of its home as ``HomeSource`` does.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from tidal import pids
from tidal.coordinator.records.db import Database, UnknownJob
from tidal.coordinator.records.home import db_path, job_dir
from tidal.dashboard.history import HistoryStore
from tidal.protocol import JobState, JobStatus

if TYPE_CHECKING:
    from tidal.coordinator.control.controller import Coordinator

__all__ = ["HomeSource", "LiveSource", "UnknownJob"]

RATE_WINDOW_S = 5.0
IN_SYNC_STEPS = 25  # a member's reported step trails the job's by a heartbeat at most


def job_summary(s: JobStatus, *, live: bool) -> dict:
    """A row of the job list."""
    m = s.metrics
    return {
        "name": s.name,
        "state": s.state.value,
        "step": s.step,
        "world_size": s.world_size,
        "target_workers": s.target_workers,
        "min_workers": s.min_workers,
        "max_workers": s.max_workers,
        "samples_per_s": m.get("samples_per_s") if s.world_size else None,
        "loss": m.get("loss"),
        "cost": m.get("cost"),
        "created": s.created,
        "script": s.script,
        "generations": len(s.generations),
        "live": live,
    }


class HomeSource:
    """Jobs of ``home``, read from its SQLite file (which must exist)."""

    def __init__(self, home: Path, *, db: Database | None = None) -> None:
        self.home = home
        self._own_db = db is None
        self.db = db if db is not None else Database(db_path(home))
        self.history = HistoryStore(db_path(home))

    def close(self) -> None:
        self.history.close()
        if self._own_db:
            self.db.close()

    def coordinator_alive(self, name: str) -> bool:
        info = job_dir(self.home, name).read_coordinator()
        return bool(info) and pids.alive(info.get("pid"))

    def job_names(self) -> list[str]:
        return self.db.job_names()

    def is_live(self, name: str) -> bool:
        return self.coordinator_alive(name)

    def status(self, name: str) -> JobStatus:
        """Raises ``UnknownJob``."""
        s = self.db.load_status(name)
        if s.state in (JobState.PENDING, JobState.RUNNING) and not self.coordinator_alive(name):
            s.state = JobState.INTERRUPTED  # its coordinator died without finishing it
            s.world_size = 0
            s.dashboard_url = s.metrics_url = None
        return s

    def statuses(self) -> list[JobStatus]:
        out = []
        for name in self.job_names():
            try:
                out.append(self.status(name))
            except UnknownJob:  # deleted meanwhile
                continue
        return out

    def jobs(self) -> list[dict]:
        return [job_summary(s, live=self.is_live(s.name)) for s in self.statuses()]

    def worker_rates(self, name: str) -> dict[int, dict]:
        return {}

    def job_data(self, name: str, *, after: int = 0, steps_after: int = 0) -> dict:
        """What the job page polls: the status, the sampled history points after ``after``,
        the per-step values of ``tidal.log`` written after ``steps_after``."""
        status = self.status(name)
        return {
            "now": time.time(),
            "live": self.is_live(name) and not status.state.terminal,
            "status": status.model_dump(mode="json"),
            "worker_rates": {str(k): v for k, v in self.worker_rates(name).items()},
            "history": self.history.read(name, after=after),
            "steps": self.history.read_steps(name, after=steps_after),
        }


class LiveSource(HomeSource):
    """A coordinator's dashboard: its own job live, the rest of its home from SQLite."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.job = coord.spec.name
        super().__init__(coord.jobdir.path.parent.parent, db=coord.executor.db)
        self._lock = threading.Lock()
        self._samples: dict[int, deque[tuple[float, int]]] = {}

    def is_live(self, name: str) -> bool:
        return True if name == self.job else super().is_live(name)

    def status(self, name: str) -> JobStatus:
        if name == self.job:
            return self.coord.status()
        return super().status(name)

    def worker_rates(self, name: str) -> dict[int, dict]:
        """Each live worker's step and steps/s over the last few seconds of polls."""
        if name != self.job:
            return {}
        now = time.monotonic()
        job_step, workers = self.coord.worker_steps()
        out = {}
        with self._lock:
            live = {wid for wid, _, _ in workers}
            for wid in list(self._samples):
                if wid not in live:
                    del self._samples[wid]
            for wid, step, running in workers:
                q = self._samples.setdefault(wid, deque())
                if not running or job_step - step > IN_SYNC_STEPS:
                    # outside a generation, or still to be healed: its step is about to jump
                    q.clear()
                    out[wid] = {"step": step, "steps_per_s": None}
                    continue
                q.append((now, step))
                while len(q) > 2 and now - q[0][0] > RATE_WINDOW_S:
                    q.popleft()
                (t0, s0), (t1, s1) = q[0], q[-1]
                rate = (s1 - s0) / (t1 - t0) if t1 - t0 >= 0.5 else None
                out[wid] = {"step": step, "steps_per_s": rate}
        return out
