"""A job's status read from its records (SQLite), for tests whose own process has no route
to the coordinator (it serves inside a network namespace): the plain-hosts and Slurm
end-to-end tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
from e2e_helpers import Home, summarize

from tidal.coordinator.records.home import db_path


class JobRecords:
    """The records of the job ``name`` in a test's home."""

    def __init__(self, name: str) -> None:
        self.name = name

    def read(self, home: Home) -> dict:
        """The job's status as its records say."""
        from tidal.coordinator.records.db import Database

        db = Database(db_path(home.path), readonly=True, check=False)
        try:
            return json.loads(db.load_status(self.name).model_dump_json())
        finally:
            db.close()

    def wait(
        self, home: Home, pred: Callable[[dict], object], timeout: float, what: str, logs
    ) -> dict:
        """The first status for which ``pred`` holds; fails the test (with ``logs()``)
        after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            try:
                status = self.read(home)
            except Exception:  # noqa: BLE001 - no record yet
                status = None
            if status is not None and pred(status):
                return status
            time.sleep(0.2)
        pytest.fail(f"timed out waiting for {what}\n{summarize(status)}\n{logs()}", pytrace=False)


def formed(size: int) -> Callable[[dict], bool]:
    """A status whose newest generation has ``size`` members and has started."""

    def check(s: dict) -> bool:
        gens = s["generations"]
        return s["world_size"] == size and bool(gens) and gens[-1]["start_step"] is not None

    return check


def members(status: dict) -> list[dict]:
    """The worker records of the newest generation's members, in rank order."""
    by_id = {w["id"]: w for w in status["workers"]}
    return [by_id[m] for m in status["generations"][-1]["members"]]
