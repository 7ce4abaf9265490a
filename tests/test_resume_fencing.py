"""One set of workers per job (issue 50 finding 3): a ``tidal resume`` after ``tidal run`` and
its coordinator died ends the orphaned workers first, and a finished job's checkpoints are
never written again. Real processes, real SIGKILLs, real checkpoint files.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from e2e_helpers import Home, event_messages, pid_alive, running_workers, summarize, wait_gone

STEPS = 1500
ORPHAN_TIMEOUT_S = 20


def _tree_digest(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``folder``: (mtime in ns, sha256)."""
    return {
        str(p.relative_to(folder)): (
            p.stat().st_mtime_ns,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_ends_orphaned_workers_and_a_finished_job_stays_final(tidal_home: Home) -> None:
    job = tidal_home.start(
        "twice",
        "--workers",
        "2",
        "--checkpoint-every",
        "50",
        "--orphan-timeout",
        str(ORPHAN_TIMEOUT_S),
        script_args=["--max-steps", str(STEPS)],
    )
    before = job.wait_for(
        lambda s: s["state"] == "running" and s["checkpoints"] and s["step"] > 60,
        timeout=90,
        what="a running job with a checkpoint",
    )
    old = sorted(w["pid"] for w in running_workers(before))
    assert len(old) == 2, summarize(before)
    info = job.coordinator_info()
    for pid in (info["supervisor_pid"], info["pid"]):  # `tidal run` and its coordinator die
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert not wait_gone([info["supervisor_pid"], info["pid"]], timeout=10)
    assert all(pid_alive(p) for p in old), "the orphans train on until resumed or timed out"

    resumed = tidal_home.cli("resume", "twice", "--detach")
    assert resumed.returncode == 0, resumed.stderr
    # The old set is gone before the new one starts, and the resume says so.
    assert not [p for p in old if pid_alive(p)], "the resume left the old workers training"
    assert resumed.stderr.count("of the previous run still ran") == 2, resumed.stderr

    status = job.wait_state("succeeded", "failed", "stopped", "interrupted", timeout=180)
    assert status["state"] == "succeeded" and status["step"] == STEPS, summarize(status)
    by_pid = {w["pid"]: w for w in status["workers"]}
    assert all(by_pid[p]["state"] == "failed" for p in old), summarize(status)
    new = [w for w in status["workers"] if w["pid"] not in old]
    assert len(new) == 2 and all(w["state"] == "exited" for w in new), summarize(status)
    ended = [m for m in event_messages(status, "worker") if "ended before the resume" in m]
    assert len(ended) == 2, summarize(status)

    folder = job.dir / "checkpoints"
    # Sealed as the coordinator closes, once its workers are gone: a moment after the status
    # says the job succeeded.
    deadline = time.monotonic() + 30
    while True:
        fence = json.loads((folder / ".fence").read_text())
        if fence["sealed"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert fence["sealed"] and "succeeded at step 1500" in fence["sealed"], fence
    final = _tree_digest(folder)
    assert any(name.startswith(f"step-{STEPS:08d}/") for name in final), sorted(final)
    # Past the old workers' orphan timeout: nothing of theirs wrote since.
    time.sleep(max(0.0, ORPHAN_TIMEOUT_S + 2 - (time.monotonic() - killed_at)))
    assert _tree_digest(folder) == final, "the finished job's checkpoints were written again"
    tidal_home.assert_no_processes()
