"""The tracker's records in the home's ``tidal.db``: the ``trackers`` table (one row per job,
``plan.Record``) and reads of the job's ``step_metrics`` rows, over a connection of the
forwarder's own (its thread; SQLite's WAL lets it read while the recorder writes)."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

from tidal.coordinator.records.db import STEP_SCHEMA
from tidal.tracking.plan import Record, Row

SCHEMA = """
CREATE TABLE IF NOT EXISTS trackers (
    job TEXT PRIMARY KEY, kind TEXT NOT NULL, target TEXT, key TEXT NOT NULL, run_id TEXT,
    sent_through INTEGER NOT NULL, sending_through INTEGER NOT NULL
);
"""
SELECT_ROWS = (
    "SELECT step, name, value, seq FROM step_metrics WHERE job = ? AND step > ? AND step <= ? "
    "ORDER BY step, name LIMIT ?"
)
NO_STEP = 2**62  # larger than any step: "no upper bound" in SELECT_ROWS


class TrackerTable:
    def __init__(self, path: Path) -> None:
        self._conn = sqlite3.connect(path, timeout=30, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(SCHEMA + STEP_SCHEMA)
        self._conn.commit()

    def close(self) -> None:
        self._conn.close()

    def load(self, job: str) -> Record | None:
        row = self._conn.execute(
            "SELECT kind, target, key, run_id, sent_through, sending_through FROM trackers "
            "WHERE job = ?",
            (job,),
        ).fetchone()
        if row is None:
            return None
        kind, target, key, run_id, sent, sending = row
        return Record(
            kind=kind,
            target=target,
            key=key,
            run_id=run_id,
            sent_through=sent,
            sending_through=sending,
        )

    def save(self, job: str, r: Record) -> None:
        """Write ``r`` durably (committed before this returns)."""
        with self._conn:
            self._conn.execute(
                "INSERT OR REPLACE INTO trackers VALUES (?, ?, ?, ?, ?, ?, ?)",
                (job, r.kind, r.target, r.key, r.run_id, r.sent_through, r.sending_through),
            )

    def rows(
        self, job: str, *, after: int, through: int | None = None, limit: int
    ) -> tuple[list[Row], bool]:
        """The job's rows of the steps in (``after``, ``through``], in step order, at most
        ``limit`` of them, and whether the limit cut them (then the last step read may be
        missing rows: the caller leaves it for the next read). NULL reads back as NaN."""
        got = self._conn.execute(
            SELECT_ROWS, (job, after, NO_STEP if through is None else through, limit)
        ).fetchall()
        rows = [
            Row(step=s, name=n, value=math.nan if v is None else v, seq=q) for s, n, v, q in got
        ]
        return rows, len(rows) >= limit
