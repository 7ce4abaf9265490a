"""A full disk under the checkpoints (issue 50): a real tmpfs, mounted at the job's checkpoint
folder (skipped where mounting is not permitted), so every write past its size really fails
with ENOSPC; real ``tidal run`` processes. The rules themselves as tables
(``coordinator.checkpoint_rules``)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
from e2e_helpers import DIGITS, Home, summarize

from tidal.coordinator.rules.checkpoint_rules import (
    failed_in_a_row,
    final_checkpoint_note,
    streak_verdict,
)

ENOSPC = "OSError: [Errno 28] No space left on device"


@pytest.mark.parametrize(
    "failed, written, expected",
    [
        ({}, {10}, []),
        ({20: "e"}, {10}, [20]),
        ({20: "e", 30: "e"}, {10, 40}, []),  # a write after them ends the streak
        ({20: "e", 40: "e", 50: "e"}, {10, 30}, [40, 50]),
        ({10: "e", 20: "e"}, set(), [10, 20]),  # nothing written yet
    ],
)
def test_failed_in_a_row(failed, written, expected):
    assert failed_in_a_row(failed, written) == expected


@pytest.mark.parametrize(
    "failed, written, newest, expected",
    [
        ({30: "e", 40: "e"}, {20}, 20, None),  # two in a row: trains on
        (
            {30: "e", 40: "e", 50: "x"},
            {20},
            20,
            "3 checkpoints in a row could not be written (steps 30, 40, 50; last: x); "
            "the newest checkpoint holds step 20",
        ),
        (
            {10: "e", 20: "e", 30: "e"},
            set(),
            None,
            "3 checkpoints in a row could not be written (steps 10, 20, 30; last: e); "
            "no checkpoint of this job is on disk",
        ),
        ({10: "e", 30: "e", 50: "e"}, {20, 40}, 40, None),  # never more than one in a row
    ],
)
def test_streak_verdict(failed, written, newest, expected):
    assert streak_verdict(failed, written, newest_on_disk=newest) == expected


@pytest.mark.parametrize(
    "step, failed, written, expected",
    [
        (50, {}, {50}, None),
        (50, {30: "e"}, {50}, None),  # an earlier failure: the final one was written
        (50, {50: "e"}, {20}, "its final checkpoint (step 50) could not be written (e); "
         "the newest checkpoint holds step 20"),
        (50, {40: "e"}, {20}, None),  # nothing failed at the last step
    ],
)  # fmt: skip
def test_final_checkpoint_note(step, failed, written, expected):
    got = final_checkpoint_note(step=step, failed=failed, written=written, newest_on_disk=20)
    assert got == expected


@pytest.fixture
def full_checkpoints(tidal_home: Home):
    """``mount(name)``: a 600 KiB tmpfs at job ``name``'s checkpoint folder (two digits
    checkpoints of ~226 KB fit, the third does not); unmounted at the end."""
    mounted: list[Path] = []

    def mount(name: str) -> Path:
        where = tidal_home.path / "jobs" / name / "checkpoints"
        where.mkdir(parents=True)
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".fence"
    }


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_three_failed_checkpoints_in_a_row_fail_the_job_naming_the_newest(
    tidal_home: Home, full_checkpoints
):
    where = full_checkpoints("full")
    proc = tidal_home.cli(
        "run", "--name", "full", "--checkpoint-every", "10", str(DIGITS),
        "--max-steps", "3000", timeout=100,
    )  # fmt: skip
    # Not --quiet: the progress line is printed too, and must not end on "running".
    assert proc.returncode == 1, proc.stderr
    assert last_line(proc.stderr) == (
        "tidal: error: job full failed: 3 checkpoints in a row could not be written "
        f"(steps 30, 40, 50; last: {ENOSPC}); the newest checkpoint holds step 20"
    ), proc.stderr
    assert last_line(proc.stdout).endswith("| failed"), proc.stdout[-500:]
    status = tidal_home.job("full").status()
    assert status["state"] == "failed" and status["step"] < 3000, summarize(status)
    # The members learn of the end within a heartbeat: a few more may fail meanwhile.
    assert status["checkpoint_failures"] >= 3, summarize(status)
    assert [c["step"] for c in status["checkpoints"]] == [10, 20], summarize(status)
    before = digests(where)
    assert sorted({k.split("/")[0] for k in before}) == ["step-00000010", "step-00000020"]
    tidal_home.assert_no_processes()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_final_checkpoint_that_cannot_be_written_fails_the_job_naming_the_newest(
    tidal_home: Home, full_checkpoints
):
    full_checkpoints("last")
    proc, job = tidal_home.run(
        "last", "--checkpoint-every", "10", script_args=["--max-steps", "35"], timeout=100
    )
    assert proc.returncode == 1, proc.stderr
    assert last_line(proc.stderr) == (
        "tidal: error: job last failed: the checkpoint of its last step (35) could not be "
        f"written: {ENOSPC}; the newest checkpoint holds step 20"
    ), proc.stderr
    status = job.status()
    assert status["state"] == "failed" and status["step"] == 35, summarize(status)
    tidal_home.assert_no_processes()
