"""Time series of a job for the dashboard's charts: sampled from the coordinator's loop,
kept in SQLite so that a finished job still shows its charts.

The coordinator itself keeps only the latest values (step, world size, target, metrics).
``Recorder.tick`` runs on the coordinator's loop thread (``runner.run_job``); every
``SAMPLE_EVERY_S`` it reads those values (``Coordinator.sample``) and, when something changed
(or ``IDLE_EVERY_S`` passed), appends a point to a small in-memory buffer that goes to the
``dashboard_history`` table of ``HOME/tidal.db`` every ``WRITE_EVERY_S``, over its own
connection. The same samples feed the TensorBoard sink (``--tensorboard``).

The values the script logs with ``tidal.log`` are not sampled: the coordinator keeps one
per (step, name) (``coordinator.step_metrics``); each tick takes the changed ones, which go
to the ``step_metrics`` table (``coordinator.db.STEP_SCHEMA``) with the points, and to the
TensorBoard sink, which writes a step once it is settled.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.coordinator.records.db import (
    SELECT_STEPS,
    STEP_SCHEMA,
    UPSERT_SAVED,
    UPSERT_STEP,
    step_series,
)
from tidal.coordinator.records.home import db_path

if TYPE_CHECKING:
    from tidal.coordinator.control.controller import Coordinator
    from tidal.coordinator.records.step_metrics import StepValue
    from tidal.tensorboard import TensorBoardSink


log = logging.getLogger(__name__)
SAMPLE_EVERY_S = 0.2
IDLE_EVERY_S = 2.0  # a point even when nothing changed, so the time axis keeps moving
WRITE_EVERY_S = 0.5
MAX_POINTS = 4000  # a first load thins longer histories to about this many points
RING = 10_000  # unwritten points kept if SQLite is busy for a long time
STEP_RING = 200_000  # unwritten per-step values kept likewise

SCHEMA = """
CREATE TABLE IF NOT EXISTS dashboard_history (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL, time REAL NOT NULL,
    step INTEGER NOT NULL, world_size INTEGER NOT NULL, target INTEGER NOT NULL,
    metrics TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS dashboard_history_job ON dashboard_history (job, seq);
"""


@dataclass(frozen=True)
class Point:
    time: float
    step: int
    world_size: int
    target: int
    metrics: dict[str, float]


class HistoryStore:
    """The ``dashboard_history`` table; one connection, serialised by a lock."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, check_same_thread=False, timeout=30)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(SCHEMA + STEP_SCHEMA)
        self._conn.commit()
        self._seq: dict[str, int] = {}  # the last ``step_metrics.seq`` of a job

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def append(
        self,
        job: str,
        points: list[Point],
        *,
        steps: list[StepValue] = (),
        saved: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        """Sampled ``points`` and per-step values (the newest generation's stays), and
        ``saved`` (worker -> its newest record those values include: ``StepLog.applied``),
        at once."""
        with self._lock:
            try:
                self._conn.executemany(
                    "INSERT INTO dashboard_history "
                    "(job, time, step, world_size, target, metrics) VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        (job, p.time, p.step, p.world_size, p.target, json.dumps(p.metrics))
                        for p in points
                    ],
                )
                if steps:
                    sql = "SELECT MAX(seq) FROM step_metrics WHERE job = ?"
                    seq = self._seq.get(job)
                    if seq is None:
                        seq = self._conn.execute(sql, (job,)).fetchone()[0] or 0
                    self._conn.executemany(
                        UPSERT_STEP,
                        [
                            (job, v.step, v.name, v.value, v.generation, seq + i + 1)
                            for i, v in enumerate(steps)
                        ],
                    )
                    self._seq[job] = seq + len(steps)
                if saved:
                    self._conn.executemany(
                        UPSERT_SAVED, [(job, w, g, st) for w, (g, st) in saved.items()]
                    )
                self._conn.commit()
            except BaseException:
                self._seq.pop(job, None)  # read it again next time
                try:
                    self._conn.rollback()
                except sqlite3.Error:
                    pass
                raise

    def read_steps(self, job: str, *, after: int = 0, max_points: int | None = MAX_POINTS) -> dict:
        """Per-step values of ``job`` written after ``seq`` ``after``:
        ``{seq, series: {name: {step, value}}}`` (see ``coordinator.db.step_series``); a first
        load (``after`` 0) keeps at most about ``max_points`` steps of each name."""
        with self._lock:
            rows = self._conn.execute(SELECT_STEPS, (job, after)).fetchall()
        return step_series(rows, after=after, max_points=None if after else max_points)

    def read(self, job: str, *, after: int = 0, max_points: int | None = MAX_POINTS) -> dict:
        """Points of ``job`` with ``seq > after``, columnar:
        ``{seq, t, step, world_size, target, metrics}`` (``metrics``: one dict per point).
        ``seq`` is the last one returned (pass it back as ``after``). With more than
        ``max_points`` rows, every k-th is kept, and both sides of every change of size or target."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT seq, time, step, world_size, target, metrics FROM dashboard_history "
                "WHERE job = ? AND seq > ? ORDER BY seq",
                (job, after),
            ).fetchall()
        if max_points and len(rows) > max_points:
            k = -(-len(rows) // max_points)
            keep = {0, len(rows) - 1, *range(0, len(rows), k)}
            for i in range(1, len(rows)):
                if rows[i][3:5] != rows[i - 1][3:5]:  # a change of size: both sides of it
                    keep.update((i - 1, i))
            rows = [rows[i] for i in sorted(keep)]
        return {
            "seq": rows[-1][0] if rows else after,
            "t": [r[1] for r in rows],
            "step": [r[2] for r in rows],
            "world_size": [r[3] for r in rows],
            "target": [r[4] for r in rows],
            "metrics": [json.loads(r[5]) for r in rows],
        }


class Recorder:
    """Samples a running coordinator; ``tick`` is cheap enough for its control loop.

    ``on_write_error``: told when the history's rows cannot be written to SQLite (the
    job's own records are in the same file, so its host ends the job); the points are
    dropped. Without it, such an error is a failed tick like any other (a warning)."""

    def __init__(
        self,
        coord: Coordinator,
        home: Path,
        *,
        tensorboard: TensorBoardSink | None = None,
        on_write_error: Callable[[sqlite3.Error], None] | None = None,
    ) -> None:
        self.coord = coord
        self.on_write_error = on_write_error
        self.job = coord.spec.name
        self.store = HistoryStore(db_path(home))
        self.sink = tensorboard
        self._buffer: deque[Point] = deque(maxlen=RING)
        self._steps: deque[StepValue] = deque(maxlen=STEP_RING)
        # worker -> its newest per-step record among the values taken (``StepLog.applied``),
        # and what of it was written: the rows hold every record below it
        self._applied: dict[int, tuple[int, int]] = {}
        self._saved: dict[int, tuple[int, int]] = {}
        self._last_key: tuple | None = None
        self._last_point = 0.0
        self._next_sample = 0.0
        self._last_write = time.monotonic()
        self._failures = 0  # ticks in a row that failed
        self._last_error: str | None = None

    def tick(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_sample:
            return
        self._next_sample = now + SAMPLE_EVERY_S
        try:
            self._sample(now, force)
            if force or now - self._last_write >= WRITE_EVERY_S:
                self._write(now)
        except Exception as exc:  # noqa: BLE001 - charts must never stop a job
            # Said for each new error, and again once it records again: never silent for
            # the rest of the job after a first warning.
            self._failures += 1
            text = f"{type(exc).__name__}: {exc}"[:500]
            if text != self._last_error:
                self._last_error = text
                log.warning(
                    "dashboard history: %s (the charts keep the newest %d points in memory "
                    "until it records again)",
                    text,
                    RING,
                )
        else:
            if self._failures:
                log.info(
                    "dashboard history records again, after %d failed attempts", self._failures
                )
                self._failures, self._last_error = 0, None

    def _sample(self, now: float, force: bool) -> None:
        step, world, target, metrics, values, applied = self.coord.sample()
        self._steps.extend(values)
        self._applied = applied
        if self.sink is not None:  # before the sample: it skips the per-step names
            self.sink.record_steps(values, committed=step, force=force)
        key = (step, world, target, tuple(sorted(metrics.items())))
        if key == self._last_key and now - self._last_point < IDLE_EVERY_S and not force:
            return
        self._last_key, self._last_point = key, now
        p = Point(time=time.time(), step=step, world_size=world, target=target, metrics=metrics)
        self._buffer.append(p)
        if self.sink is not None:
            self.sink.record(
                time=p.time, step=step, world_size=world, target=target, metrics=metrics
            )

    def _write(self, now: float) -> None:
        self._last_write = now
        saved = {w: k for w, k in self._applied.items() if self._saved.get(w) != k}
        if self._buffer or self._steps or saved:
            try:
                self.store.append(
                    self.job, list(self._buffer), steps=list(self._steps), saved=saved
                )
            except sqlite3.Error as exc:
                if self.on_write_error is None:
                    raise
                self.on_write_error(exc)
            self._buffer.clear()
            self._steps.clear()
            self._saved.update(saved)

    def close(self) -> None:
        """A last sample (the job's end), then write everything and close."""
        self.tick(force=True)
        for close in (self.sink.close if self.sink is not None else None, self.store.close):
            try:
                if close is not None:
                    close()
            except Exception as exc:  # noqa: BLE001 - the job's outcome matters more
                log.warning("dashboard history: %s", exc)
