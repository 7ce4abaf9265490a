"""The live job's records: written through to SQLite, read from memory.

The coordinator changes its job's records only through its ``Journal``: each write goes to
SQLite (the sink that outlives the process: ``tidal status`` of an ended job, a restarted
coordinator) and to a copy in memory (``snapshot.Records``) from which the status is built.
So ``GET /status`` never reads SQLite, and it reads the same as SQLite after the same
writes (``Records.status`` builds both; tested). Writes that fail leave the database
``broken`` (``Database``); the copy still changes, so the job's status keeps telling what
the coordinator decided while it stops the job.
"""

from __future__ import annotations

import json
import threading

from tidal.coordinator.records.db import Database, UnknownJob
from tidal.coordinator.records.snapshot import JobRow, Records, WorkerRow
from tidal.protocol import CheckpointView, EventView, GenerationView, JobStatus


class Journal:
    """One job's writes (``name``'s rows in ``db``). ``load`` first: it reads them once."""

    def __init__(self, db: Database, name: str) -> None:
        self.db, self.name = db, name
        self._lock = threading.Lock()  # writers (the loop, API threads) vs readers
        self._records: Records | None = None

    def load(self, *, unwritten: JobRow) -> None:
        """Read the job's records (after they were created, reopened, or to recover).
        ``unwritten``: the job's row if its creation could not be written (the database is
        ``broken``: the coordinator reports it and starts nothing)."""
        try:
            records = self.db.load_records(self.name)
        except UnknownJob:
            if not self.db.broken:
                raise
            records = Records(job=unwritten)
        with self._lock:
            self._records = records

    @property
    def records(self) -> Records:
        if self._records is None:
            raise RuntimeError("Journal.load() first")
        return self._records

    def status(self) -> JobStatus:
        with self._lock:
            records = self.records.copy()
        return records.status(self.name)  # outside the lock: writers do not wait for it

    def checkpoints(self) -> list[CheckpointView]:
        with self._lock:
            return [c for _, c in sorted(self.records.checkpoints.items())]

    # -- writes: SQLite, then the copy ----------------------------------------------------
    def update_job(self, **values: object) -> None:
        self.db.update_job(self.name, **values)
        if "metrics" in values:  # as it reads back (a copy: the caller changes its dict)
            values["metrics"] = json.loads(json.dumps(values["metrics"]))
        with self._lock:
            for k, v in values.items():
                setattr(self.records.job, k, v)

    def save_workers(self, rows: list[WorkerRow]) -> None:
        self.db.upsert_worker_rows(self.name, rows)
        with self._lock:
            self.records.workers.update((r[0], r) for r in rows)

    def save_generation(self, g: GenerationView) -> None:
        self.db.upsert_generation(self.name, g)
        with self._lock:
            self.records.generations[g.id] = g

    def add_event(self, e: EventView) -> None:
        self.db.add_event(self.name, e)
        with self._lock:
            self.records.events.append(e)

    def add_checkpoint(self, c: CheckpointView) -> None:
        self.db.add_checkpoint(self.name, c)
        with self._lock:
            self.records.checkpoints[c.step] = c

    def drop_checkpoint(self, step: int) -> None:
        self.db.drop_checkpoint(self.name, step)
        with self._lock:
            self.records.checkpoints.pop(step, None)

    def add_checkpoint_failure(self, error: str) -> None:
        self.db.add_checkpoint_failure(self.name, error)
        with self._lock:
            job = self.records.job
            job.checkpoint_failures += 1
            job.last_checkpoint_error = error

    def save_control(self, control: dict) -> None:
        """The restart record (``recovery.Control``): not part of the status."""
        self.db.save_control(self.name, control)
