"""A damaged ``tidal.db`` (issue 50): a real job's journal with 4 KiB pages in its middle
zeroed, or truncated; real ``tidal`` CLI processes. Every command that opens it says one line
naming the file and the way out, at once; nothing is run on it and nothing already saved
(checkpoints, the damaged file) changes; moved aside, the job resumes from its checkpoint."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path

import pytest
from e2e_helpers import Home, summarize

from tidal.coordinator.records.db import Database, is_damage


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (".fence", "lock")
    }


def zero_pages_not_of(db: Path, keep: tuple[str, ...]) -> None:
    """Zero every page in the second half of ``db`` that holds no row of the ``keep``
    tables (the job's own row stays readable: the damage is what `tidal status` misses)."""
    conn = sqlite3.connect(db)
    pages = conn.execute("SELECT name, pageno FROM dbstat ORDER BY pageno").fetchall()
    conn.close()
    half = len(pages) // 2
    hit = [n for name, n in pages[half:] if name not in keep]
    assert hit, pages
    with open(db, "r+b") as f:
        for n in hit:
            f.seek((n - 1) * 4096)
            f.write(b"\0" * 4096)


def one_line(proc, *needles: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, f"exit {proc.returncode}:\n{proc.stderr}"
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_damage_codes_are_told_from_other_errors(tmp_path: Path):
    bad = tmp_path / "x.db"
    bad.write_bytes(b"not a database at all" * 300)
    with pytest.raises(sqlite3.DatabaseError) as exc:
        sqlite3.connect(bad).execute("SELECT 1 FROM sqlite_master").fetchall()
    assert is_damage(exc.value)
    with pytest.raises(sqlite3.OperationalError) as exc:
        sqlite3.connect(tmp_path / "y.db").execute("SELECT * FROM nothing").fetchall()
    assert not is_damage(exc.value)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_damaged_journal_is_said_in_one_line_and_nothing_runs_on_it(tidal_home: Home):
    proc, job = tidal_home.run(
        "r", "--checkpoint-every", "10", script_args=["--max-steps", "30"], timeout=100
    )
    assert proc.returncode == 0, proc.stderr
    db_file = tidal_home.path / "tidal.db"
    db = Database(db_file)
    db.update_job("r", state="stopped")  # as `tidal stop` leaves it: resumable
    db.close()
    zero_pages_not_of(db_file, keep=("sqlite_schema", "jobs", "sqlite_autoindex_jobs_1"))
    saved = digests(job.dir / "checkpoints")
    assert saved
    damaged = db_file.read_bytes()

    for args in (("resume", "r", "--quiet"), ("status", "r", "--json"), ("dashboard",)):
        t = time.monotonic()
        proc = tidal_home.cli(*args, timeout=60)
        took = time.monotonic() - t
        line = one_line(proc, f"{db_file} is damaged", f"mv {db_file} {db_file}.damaged")
        assert "Traceback" not in proc.stderr and took < 20, (args, took, line)
    jobs = tidal_home.cli("jobs", "--json", timeout=60)
    one_line(jobs, f"{db_file} is damaged")
    assert [j["name"] for j in __import__("json").loads(jobs.stdout)] == ["r"], jobs.stdout
    # Nothing was run on it, nothing saved changed.
    assert db_file.read_bytes() == damaged
    assert digests(job.dir / "checkpoints") == saved
    assert not (job.dir / "logs" / "worker-1.log").exists()

    # Truncated: at once, one line (SQLite's 30 s busy wait is not how it ends).
    db_file.write_bytes(damaged[: len(damaged) // 2 + 100])
    t = time.monotonic()
    one_line(tidal_home.cli("jobs", timeout=60), f"{db_file} is damaged")
    assert time.monotonic() - t < 20

    # Moved aside, as the line says: the job resumes from its newest checkpoint.
    db_file.rename(db_file.with_name("tidal.db.damaged"))
    proc = tidal_home.cli("resume", "r", "--quiet", timeout=100)
    assert proc.returncode == 0, f"{proc.stderr}\n{job.logs_tail()}"
    assert "rebuilt from" in proc.stderr and "resuming from step-00000030" in proc.stderr
    status = job.status()
    assert status["state"] == "succeeded" and status["step"] == 30, summarize(status)
    tidal_home.assert_no_processes()
