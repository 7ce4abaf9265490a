"""SQLite records of every job under a home: the job, its workers, generations, events.

The coordinator writes through on every membership change and flushes the fast-moving
values (step, metrics, heartbeats) a few times a second; ``tidal status`` reads the same
rows when no coordinator answers, so a dead coordinator's job stays inspectable.

Storage failures (disk full, read-only file, I/O error) never escape as tracebacks: opening
raises ``HomeError`` (one line); a write that fails marks the database ``broken`` (the
reason, one line) and later writes are dropped, so the coordinator can go on stopping the
job in memory while ``runner.run_job`` notices and ends it (``tidal: error: cannot write
HOME/tidal.db: database or disk is full``).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import quote

from tidal.coordinator.records.home import HomeError, os_error_line
from tidal.coordinator.records.snapshot import JobRow, Records, WorkerRow
from tidal.protocol import (
    CheckpointView,
    EventView,
    GenerationView,
    JobState,
    JobStatus,
    StepSeries,
)

# The per-step values of ``tidal.log`` (``coordinator.step_metrics``): one row per (job, step,
# name), the newest generation's (``UPSERT_STEP`` refuses an older one). ``value`` is NULL
# for NaN (SQLite stores NaN as NULL). ``seq`` grows with every write of a job's rows, so a
# page polls what changed (``?steps_after=SEQ``). Written by the coordinator's recorder
# (``tidal.dashboard.history``), read by the dashboard and ``tidal status --history``.
STEP_SCHEMA = """
CREATE TABLE IF NOT EXISTS step_metrics (
    job TEXT NOT NULL, step INTEGER NOT NULL, name TEXT NOT NULL, value REAL,
    generation INTEGER NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (job, step, name)
);
CREATE INDEX IF NOT EXISTS step_metrics_seq ON step_metrics (job, seq);
CREATE TABLE IF NOT EXISTS step_metrics_saved (
    job TEXT NOT NULL, worker INTEGER NOT NULL, generation INTEGER NOT NULL,
    step INTEGER NOT NULL, PRIMARY KEY (job, worker)
);
"""
# ``step_metrics_saved``: each worker's newest per-step record whose values those rows hold
# (``StepLog.applied``, written in the same transaction as the rows, never moved back): a
# restarted coordinator tells a worker that registers again (``saved_step_metrics``).
UPSERT_SAVED = (
    "INSERT INTO step_metrics_saved (job, worker, generation, step) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (job, worker) DO UPDATE SET generation = excluded.generation, "
    "step = excluded.step WHERE (excluded.generation, excluded.step) > "
    "(step_metrics_saved.generation, step_metrics_saved.step)"
)
UPSERT_STEP = (
    "INSERT INTO step_metrics (job, step, name, value, generation, seq) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (job, step, name) DO UPDATE SET "
    "value = excluded.value, generation = excluded.generation, seq = excluded.seq "
    "WHERE excluded.generation >= step_metrics.generation"
)
SELECT_STEPS = (
    "SELECT seq, step, name, value FROM step_metrics WHERE job = ? AND seq > ? ORDER BY name, step"
)


def step_series(rows: list[tuple], *, after: int = 0, max_points: int | None = None) -> dict:
    """``SELECT_STEPS`` rows as ``{seq, series: {name: {step: [...], value: [...]}}}`` (``seq``:
    the newest row's, or ``after``; NULL reads back as NaN). With more than ``max_points``
    steps, a name keeps every k-th and its last."""
    series: dict[str, dict[str, list]] = {}
    seq = after
    for row_seq, step, name, value in rows:
        seq = max(seq, row_seq)
        s = series.setdefault(name, {"step": [], "value": []})
        s["step"].append(step)
        s["value"].append(float("nan") if value is None else value)
    if max_points:
        for s in series.values():
            n = len(s["step"])
            if n > max_points:
                keep = sorted({*range(0, n, -(-n // max_points)), n - 1})
                s["step"] = [s["step"][i] for i in keep]
                s["value"] = [s["value"][i] for i in keep]
    return {"seq": seq, "series": series}


SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY, state TEXT NOT NULL, spec TEXT NOT NULL, created REAL NOT NULL,
    step INTEGER NOT NULL DEFAULT 0, world_size INTEGER NOT NULL DEFAULT 0,
    target_workers INTEGER NOT NULL, url TEXT, metrics TEXT NOT NULL DEFAULT '{}',
    checkpoint_failures INTEGER NOT NULL DEFAULT 0, last_checkpoint_error TEXT
);
CREATE TABLE IF NOT EXISTS workers (
    job TEXT NOT NULL, id INTEGER NOT NULL, pid INTEGER, host TEXT, state TEXT NOT NULL,
    rank INTEGER, last_heartbeat REAL, exit_code INTEGER, node TEXT, PRIMARY KEY (job, id)
);
CREATE TABLE IF NOT EXISTS generations (
    job TEXT NOT NULL, id INTEGER NOT NULL, members TEXT NOT NULL, reason TEXT NOT NULL,
    opened_at REAL NOT NULL, start_step INTEGER, pause_s REAL, pause_phases TEXT,
    recovery TEXT, redone_steps INTEGER, PRIMARY KEY (job, id)
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL, time REAL NOT NULL,
    kind TEXT NOT NULL, message TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    job TEXT NOT NULL, step INTEGER NOT NULL, path TEXT NOT NULL, bytes INTEGER,
    seconds_to_write REAL, PRIMARY KEY (job, step)
);
"""


# Columns added after the first release: (table, column, declaration).
MIGRATIONS = (
    ("workers", "node", "TEXT"),  # a home written before workers had a node
    ("generations", "pause_phases", "TEXT"),  # written before pauses had phases
    ("generations", "recovery", "TEXT"),  # written before recoveries were told apart
    ("generations", "redone_steps", "INTEGER"),
    ("jobs", "checkpoint_failures", "INTEGER NOT NULL DEFAULT 0"),
    ("jobs", "last_checkpoint_error", "TEXT"),
    # What a restarted coordinator needs beyond the rows above (``recovery.Control``).
    ("jobs", "control", "TEXT"),
)


UPSERT_WORKER = (
    "INSERT OR REPLACE INTO workers "
    "(job, id, pid, host, state, rank, last_heartbeat, exit_code, node) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


class UnknownJob(LookupError):
    pass


class DamagedJournal(HomeError):
    """The home's ``tidal.db`` is damaged: SQLite finds it corrupt or not a database. The
    message is one line naming the file and what to do (``damaged_line``)."""


# SQLITE_CORRUPT and SQLITE_NOTADB (the primary codes: the low byte of an extended one)
DAMAGE_CODES = frozenset({11, 26})
READ_BUSY_S = 5  # a reader waits this long for a writer's lock, not SQLite's 30 s default here
WRITE_BUSY_S = 30


def is_damage(exc: sqlite3.Error) -> bool:
    """SQLite says the file itself is damaged (not full, locked or read-only)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in DAMAGE_CODES


def damaged_line(path: Path, reason: str) -> str:
    """The one line for a damaged journal (``docs/decisions/damaged-journal.md``)."""
    reason = " ".join(reason.replace("*** in database main ***", "").split())
    return (
        f"{path} is damaged ({reason}); Tidal left it as it is, and the checkpoints under "
        f"{path.parent / 'jobs'} are intact: move it aside (`mv {path} {path}.damaged`), then "
        "`tidal resume NAME` resumes a job from its newest checkpoint "
        "(docs/decisions/damaged-journal.md)"
    )


def _storage_error(exc: sqlite3.Error) -> bool:
    """The storage failed (full, read-only, I/O, corrupt), as opposed to a bug in a query."""
    return isinstance(exc, sqlite3.OperationalError) or type(exc) is sqlite3.DatabaseError


class Database:
    """One connection, serialised by a lock (the coordinator writes from two threads).

    ``readonly``: the caller only reads (``tidal status``, ``tidal jobs``). If the file or
    its folder cannot be written, it is opened read-only, or, when the folder cannot even
    hold SQLite's shared-memory file, read as it is on disk (``immutable``: nobody can be
    writing to a folder that nobody can write).

    A damaged file (``is_damage``) raises ``DamagedJournal`` wherever SQLite notices it: at
    the open, where ``PRAGMA quick_check`` runs (it reads every page: ~1 ms per 100 KiB
    here), or at a read; it is never written to, repaired or replaced."""

    def __init__(self, path: Path, *, readonly: bool = False, check: bool = True) -> None:
        """``check`` False: no ``quick_check`` at the open (``tidal jobs`` reads what it
        can of a damaged file, then asks ``damage``)."""
        self.path = path
        self.broken: str | None = None  # why writes stopped (one line), once one failed
        self._lock = threading.Lock()
        try:
            if not readonly:
                path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = (
                self._open_for_reading(path, check) if readonly else self._open(path, check=check)
            )
            self._columns = {
                table: {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")}
                for table in ("jobs", "workers", "generations")
            }
        except OSError as exc:
            raise HomeError(os_error_line("write", exc)) from None
        except sqlite3.Error as exc:
            if is_damage(exc):
                raise DamagedJournal(damaged_line(path, str(exc))) from None
            raise HomeError(f"cannot open {path}: {exc}") from None

    def damage(self) -> str | None:
        """The one line if ``quick_check`` finds the file damaged, else None."""
        with self._lock:
            try:
                self._check_intact(self._conn, self.path)
            except DamagedJournal as exc:
                return str(exc)
            except sqlite3.Error as exc:
                return damaged_line(self.path, str(exc)) if is_damage(exc) else None
        return None

    @staticmethod
    def _check_intact(conn: sqlite3.Connection, path: Path) -> None:
        """``DamagedJournal`` unless ``PRAGMA quick_check`` finds the file sound."""
        rows = conn.execute("PRAGMA quick_check(1)").fetchall()
        if rows != [("ok",)]:
            raise DamagedJournal(damaged_line(path, str(rows[0][0]) if rows else "no answer"))

    @classmethod
    def _open(
        cls, path: Path, busy_s: float = WRITE_BUSY_S, *, check: bool = True
    ) -> sqlite3.Connection:
        empty = path.exists() and path.stat().st_size == 0
        conn = sqlite3.connect(path, check_same_thread=False, timeout=busy_s)
        try:
            if empty and any(path.parent.glob("jobs/*/checkpoints")):
                # A journal truncated to nothing beside jobs that wrote checkpoints: not a
                # new home (SQLite would take it as one, and every job would be unknown).
                raise DamagedJournal(damaged_line(path, "the file is empty"))
            if check:
                cls._check_intact(conn, path)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(SCHEMA + STEP_SCHEMA)
            for table, column, decl in MIGRATIONS:
                if column not in {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}:
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            conn.commit()
        except BaseException:
            conn.close()
            raise
        return conn

    @classmethod
    def _open_for_reading(cls, path: Path, check: bool = True) -> sqlite3.Connection:
        try:
            return cls._open(path, READ_BUSY_S, check=check)
        except sqlite3.Error as exc:
            if is_damage(exc):
                raise
            error = exc
        for mode in ("mode=ro", "immutable=1"):
            conn = sqlite3.connect(
                f"file:{quote(str(path))}?{mode}",
                uri=True,
                check_same_thread=False,
                timeout=READ_BUSY_S,
            )
            try:
                if check:
                    cls._check_intact(conn, path)
                conn.execute("SELECT 1 FROM jobs LIMIT 1").fetchall()
                return conn
            except sqlite3.Error as exc:
                conn.close()
                if is_damage(exc):
                    raise
                error = exc
            except DamagedJournal:
                conn.close()
                raise
        raise error

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _write(self, sql: str, args: tuple, *, many: bool = False) -> None:
        """Commit one statement (``many``: the statement once for each tuple of ``args``, in
        one transaction); once a write has failed, drop it (see the module doc)."""
        with self._lock:
            if self.broken is not None:
                return
            try:
                if many:
                    self._conn.executemany(sql, args)
                else:
                    self._conn.execute(sql, args)
                self._conn.commit()
            except sqlite3.Error as exc:
                if not _storage_error(exc):
                    raise
                self.broken = f"cannot write {self.path}: {exc}"
                self._rollback()

    def _rollback(self) -> None:
        try:
            self._conn.rollback()
        except sqlite3.Error:
            pass

    def check_writable(self) -> None:
        """One line (``HomeError``) if a write is refused (a read-only file or folder); writes
        nothing."""
        with self._lock:
            try:
                self._conn.execute(
                    "INSERT INTO events (job, time, kind, message) VALUES ('', 0, '', '')"
                )
            except sqlite3.Error as exc:
                raise HomeError(f"cannot write {self.path}: {exc}") from None
            finally:
                self._rollback()

    def record_end(self, name: str, state: JobState, message: str) -> bool:
        """Try, even after writes failed, to record a job's end state and why; True if it is
        recorded (the storage may have recovered: space freed)."""
        with self._lock:
            try:
                self._conn.execute(
                    "UPDATE jobs SET state = ?, world_size = 0 WHERE name = ?", (state.value, name)
                )
                self._conn.execute(
                    "INSERT INTO events (job, time, kind, message) VALUES (?, ?, ?, ?)",
                    (name, time.time(), "job", message),
                )
                self._conn.commit()
                return True
            except sqlite3.Error:
                self._rollback()
                return False

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._conn.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                if not _storage_error(exc):
                    raise
                if is_damage(exc):
                    raise DamagedJournal(damaged_line(self.path, str(exc))) from None
                raise HomeError(f"cannot read {self.path}: {exc}") from None

    def has_job(self, name: str) -> bool:
        return bool(self._read("SELECT 1 FROM jobs WHERE name = ?", (name,)))

    # -- writes ------------------------------------------------------------------------
    def create_job(self, *, name: str, spec: dict, target: int) -> None:
        if self.has_job(name):
            raise ValueError(
                f"a job named {name!r} already exists in this home: pick another --name"
            )
        self._write(
            "INSERT INTO jobs (name, state, spec, created, target_workers) VALUES (?, ?, ?, ?, ?)",
            (name, JobState.PENDING.value, json.dumps(spec), time.time(), target),
        )

    def update_job(self, name: str, **values: object) -> None:
        if "metrics" in values:
            values["metrics"] = json.dumps(values["metrics"])
        cols = ", ".join(f"{k} = ?" for k in values)
        self._write(f"UPDATE jobs SET {cols} WHERE name = ?", (*values.values(), name))

    def upsert_worker_rows(self, job: str, rows: Iterable[tuple]) -> None:
        """Worker rows (``WorkerRecord.row``: id first, in ``UPSERT_WORKER``'s order after
        the job) in one transaction: one commit, not one a row (the commit is most of the
        cost: 1,024 rows took ~85 ms one by one here)."""
        self._write(UPSERT_WORKER, [(job, *r) for r in rows], many=True)

    def upsert_generation(self, job: str, g: GenerationView) -> None:
        self._write(
            "INSERT OR REPLACE INTO generations "
            "(job, id, members, reason, opened_at, start_step, pause_s, pause_phases, "
            "recovery, redone_steps) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job,
                g.id,
                json.dumps(g.members),
                g.reason,
                g.opened_at,
                g.start_step,
                g.pause_s,
                json.dumps(g.pause_phases) if g.pause_phases else None,
                g.recovery.value if g.recovery is not None else None,
                g.redone_steps,
            ),
        )

    def add_event(self, job: str, e: EventView) -> None:
        self._write(
            "INSERT INTO events (job, time, kind, message) VALUES (?, ?, ?, ?)",
            (job, e.time, e.kind, e.message),
        )

    def reopen_job(self, *, name: str, spec: dict, target: int) -> None:
        """A resumed job: the same records, a new run."""
        self.update_job(
            name,
            state=JobState.PENDING.value,
            spec=json.dumps(spec),
            target_workers=target,
            world_size=0,
        )

    def add_checkpoint(self, job: str, c: CheckpointView) -> None:
        self._write(
            "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?)",
            (job, c.step, c.path, c.bytes, c.seconds_to_write),
        )

    def add_checkpoint_failure(self, job: str, error: str) -> None:
        self._write(
            "UPDATE jobs SET checkpoint_failures = checkpoint_failures + 1, "
            "last_checkpoint_error = ? WHERE name = ?",
            (error, job),
        )

    def drop_checkpoint(self, job: str, step: int) -> None:
        self._write("DELETE FROM checkpoints WHERE job = ? AND step = ?", (job, step))

    def save_control(self, job: str, control: dict) -> None:
        self._write("UPDATE jobs SET control = ? WHERE name = ?", (json.dumps(control), job))

    # -- reads -------------------------------------------------------------------------
    def load_control(self, name: str) -> dict:
        """The job's ``control`` record ({} if none was written)."""
        if "control" not in self._columns["jobs"]:
            return {}
        rows = self._read("SELECT control FROM jobs WHERE name = ?", (name,))
        return json.loads(rows[0][0]) if rows and rows[0][0] else {}

    def job_names(self) -> list[str]:
        return [r[0] for r in self._read("SELECT name FROM jobs ORDER BY created")]

    def max_ids(self, name: str) -> tuple[int, int]:
        """The largest generation id and worker id recorded for ``name`` (0 and -1 if none)."""
        gen = self._read("SELECT MAX(id) FROM generations WHERE job = ?", (name,))[0][0]
        wid = self._read("SELECT MAX(id) FROM workers WHERE job = ?", (name,))[0][0]
        return (gen or 0, -1 if wid is None else wid)

    def checkpoints(self, name: str) -> list[CheckpointView]:
        return [
            CheckpointView(step=r[0], path=r[1], bytes=r[2], seconds_to_write=r[3])
            for r in self._read(
                "SELECT step, path, bytes, seconds_to_write FROM checkpoints WHERE job = ? "
                "ORDER BY step",
                (name,),
            )
        ]

    def job_spec(self, name: str) -> dict:
        rows = self._read("SELECT spec FROM jobs WHERE name = ?", (name,))
        if not rows:
            raise UnknownJob(name)
        return json.loads(rows[0][0])

    def load_events(self, name: str, *, after: int = 0) -> list[EventView]:
        """The job's events, skipping the first ``after``."""
        return [
            EventView(time=r[0], kind=r[1], message=r[2])
            for r in self._read(
                "SELECT time, kind, message FROM events WHERE job = ? ORDER BY seq LIMIT -1 OFFSET ?",
                (name, after),
            )
        ]

    def step_history(self, name: str) -> dict[str, StepSeries]:
        """Every per-step series of ``name`` (``tidal status --history``): one value per step."""
        table = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'step_metrics'"
        if not self._read(table):  # a read-only home written before per-step metrics
            return {}
        got = step_series(self._read(SELECT_STEPS, (name, 0)))
        return {k: StepSeries(**v) for k, v in got["series"].items()}

    def saved_step_metrics(self, name: str, worker: int) -> tuple[int, int] | None:
        """``worker``'s newest per-step record the rows of job ``name`` hold, as
        (generation, step), or None (``step_metrics_saved``)."""
        table = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'step_metrics_saved'"
        if not self._read(table):
            return None
        rows = self._read(
            "SELECT generation, step FROM step_metrics_saved WHERE job = ? AND worker = ?",
            (name, worker),
        )
        return (rows[0][0], rows[0][1]) if rows else None

    def load_records(self, name: str) -> Records:
        """Raises ``UnknownJob``."""
        failures = (
            "checkpoint_failures, last_checkpoint_error"
            if "last_checkpoint_error" in self._columns["jobs"]
            else "0, NULL"  # a read-only home written before checkpoint failures were kept
        )
        rows = self._read(
            "SELECT state, spec, created, step, world_size, target_workers, url, metrics, "
            f"{failures} FROM jobs WHERE name = ?",
            (name,),
        )
        if not rows:
            raise UnknownJob(name)
        state, spec, created, step, world, target, url, metrics, ck_failures, ck_error = rows[0]
        job = JobRow(
            state=state,
            spec=json.loads(spec),
            created=created,
            step=step,
            world_size=world,
            target_workers=target,
            url=url,
            metrics=json.loads(metrics),
            checkpoint_failures=ck_failures,
            last_checkpoint_error=ck_error,
        )
        workers = self._read(
            "SELECT id, pid, host, state, rank, last_heartbeat, exit_code, node FROM workers "
            "WHERE job = ? ORDER BY id",
            (name,),
        )
        recovery = (
            "recovery, redone_steps"
            if "redone_steps" in self._columns["generations"]
            else "NULL, NULL"  # a read-only home written before recoveries were recorded
        )
        generations = [
            GenerationView(
                id=r[0],
                members=json.loads(r[1]),
                world_size=len(json.loads(r[1])),
                reason=r[2],
                opened_at=r[3],
                start_step=r[4],
                pause_s=r[5],
                pause_phases=json.loads(r[6]) if r[6] else None,
                recovery=r[7],
                redone_steps=r[8],
            )
            for r in self._read(
                "SELECT id, members, reason, opened_at, start_step, pause_s, pause_phases, "
                f"{recovery} FROM generations WHERE job = ? ORDER BY id",
                (name,),
            )
        ]
        return Records(
            job=job,
            workers={r[0]: WorkerRow(*r) for r in workers},
            generations={g.id: g for g in generations},
            events=self.load_events(name),
            checkpoints={c.step: c for c in self.checkpoints(name)},
        )

    def load_status(self, name: str) -> JobStatus:
        """``tidal status --json`` of ``name`` as recorded. Raises ``UnknownJob``."""
        return self.load_records(name).status(name)
