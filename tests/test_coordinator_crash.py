"""The coordinator survives its own crash (issue 15): real supervisors, coordinators, worker
processes and signals.

- SIGKILL of the coordinator mid-run: its supervisor restarts it within 2 s, the workers
  train on through the outage in their generation, the same processes finish the job, and
  the final parameters equal the 1-worker run (float64).
- SIGKILL of the coordinator and its supervisor (``tidal run`` itself): the job reads as
  interrupted, its workers train on, and ``tidal attach`` takes them over to the end.
- Without any coordinator, a worker exits after ``--orphan-timeout``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from e2e_helpers import (
    Home,
    event_messages,
    pid_alive,
    relative_l2,
    running_workers,
    summarize,
    wait_gone,
)

EXACT = 1e-12  # float64, a different micro-batch split (DESIGN.md section 4)
STEPS = 1500
RESTART_S = 2.0  # the acceptance bound: the coordinator answers again within it


def _start(home: Home, name: str, out: Path, *opts: str, steps: int = STEPS):
    args = ["--max-steps", str(steps), "--double", "--save", str(out)]
    return home.start(name, "--workers", "2", *opts, script_args=args)


def _reregistered_steps(status: dict) -> dict[int, int]:
    """Worker id -> the committed step it reported when it registered again."""
    found = {}
    for m in event_messages(status, "worker"):
        hit = re.match(r"worker (\d+) re-registered \(generation \d+, step (\d+)\)", m)
        if hit:
            found[int(hit[1])] = int(hit[2])
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_of_the_coordinator_loses_nothing(
    tidal_home: Home, tmp_path: Path, reference_params
) -> None:
    out = tmp_path / "final.safetensors"
    job = _start(tidal_home, "crash", out)
    before = job.wait_running(min_step=100, timeout=90)
    pids = {w["id"]: w["pid"] for w in running_workers(before)}
    assert len(pids) == 2, summarize(before)
    old = job.coordinator_info()
    assert old["supervisor_pid"] and old["pid"] != old["supervisor_pid"], old

    os.kill(old["pid"], signal.SIGKILL)
    killed_at, step_at_kill = time.monotonic(), before["step"]
    after = job.wait_for(
        lambda s: s.get("coordinator_pid") not in (None, old["pid"]),
        timeout=30,
        what="a restarted coordinator answering",
        interval=0.02,
    )
    took = time.monotonic() - killed_at
    assert took <= RESTART_S, f"the coordinator answered again after {took:.2f} s"
    assert pid_alive(old["supervisor_pid"])
    assert job.coordinator_info()["pid"] == after["coordinator_pid"]

    status = job.wait_state("succeeded", "failed", "stopped", "interrupted", timeout=180)
    assert status["state"] == "succeeded" and status["step"] == STEPS, summarize(status)
    # The same processes finished the job, in the generation they formed before the crash.
    assert {w["id"]: w["pid"] for w in status["workers"]} == pids, summarize(status)
    assert all(w["state"] == "exited" for w in status["workers"]), summarize(status)
    assert len(status["generations"]) == 1, summarize(status)
    # Each trained on through the outage: it had committed more steps when it registered
    # again than the job had recorded before the kill.
    steps = _reregistered_steps(status)
    assert sorted(steps) == sorted(pids), summarize(status)
    assert all(s > step_at_kill for s in steps.values()), (steps, step_at_kill)
    assert any("coordinator restarted" in m for m in event_messages(status, "coordinator"))
    rel = relative_l2(out, reference_params(STEPS, 0, double=True))
    assert rel <= EXACT, f"parameters differ from the 1-worker run: relative L2 {rel:.3e}"
    tidal_home.assert_no_processes()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_attach_takes_over_workers_whose_coordinator_and_supervisor_died(
    tidal_home: Home, tmp_path: Path, reference_params
) -> None:
    out = tmp_path / "final.safetensors"
    job = _start(tidal_home, "orphans", out)
    before = job.wait_running(min_step=50, timeout=90)
    pids = sorted(w["pid"] for w in running_workers(before))
    info = job.coordinator_info()
    for pid in (info["supervisor_pid"], info["pid"]):  # the machine's `tidal run` died
        os.kill(pid, signal.SIGKILL)
    assert not wait_gone([info["supervisor_pid"], info["pid"]], timeout=10)

    status = job.status()  # no coordinator: read from SQLite
    assert status["state"] == "interrupted" and status["coordinator_pid"] is None, summarize(status)
    assert all(pid_alive(p) for p in pids), "the workers must train on without a coordinator"

    proc = tidal_home.cli("attach", "orphans", "--detach")
    assert proc.returncode == 0 and proc.stdout.strip() == "orphans", proc.stderr
    # It has a coordinator now (or, on a slow machine, the workers had finished while
    # orphaned and the job ended at once): refused in one line either way.
    again = tidal_home.cli("attach", "orphans")
    assert again.returncode == 1 and again.stderr.count("\n") == 1, again.stderr
    assert "has a live coordinator" in again.stderr or "succeeded" in again.stderr, again.stderr

    status = job.wait_state("succeeded", "failed", "stopped", timeout=180)
    assert status["state"] == "succeeded" and status["step"] == STEPS, summarize(status)
    assert sorted(w["pid"] for w in status["workers"]) == pids, summarize(status)
    # Adopted (not our children: their exit statuses cannot be read), they finished the job
    # cleanly: exited, not "failed (lost)" (issue 50).
    assert all(w["state"] == "exited" for w in status["workers"]), summarize(status)
    assert len(status["generations"]) == 1, summarize(status)
    assert sorted(_reregistered_steps(status).values())[0] > before["step"], summarize(status)
    rel = relative_l2(out, reference_params(STEPS, 0, double=True))
    assert rel <= EXACT, f"parameters differ from the 1-worker run: relative L2 {rel:.3e}"

    ended = tidal_home.cli("attach", "orphans")
    assert ended.returncode == 1 and "succeeded; nothing to attach to" in ended.stderr
    tidal_home.assert_no_processes()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_without_any_coordinator_exit_after_the_orphan_timeout(tidal_home: Home) -> None:
    job = tidal_home.start(
        "lonely",
        "--workers",
        "2",
        "--heartbeat-timeout",
        "1",
        "--collective-timeout",
        "5",
        "--orphan-timeout",
        "3",
        script_args=["--max-steps", "1000000"],
    )
    status = job.wait_running(min_step=5, timeout=60)
    pids = [w["pid"] for w in running_workers(status)]
    info = job.coordinator_info()
    for pid in (info["supervisor_pid"], info["pid"]):
        os.kill(pid, signal.SIGKILL)
    assert not wait_gone([info["supervisor_pid"], info["pid"]], timeout=10)
    time.sleep(1.5)
    assert all(pid_alive(p) for p in pids), "a worker gave up before its orphan timeout"
    left = wait_gone(pids, timeout=20)
    assert not left, f"workers {left} outlived --orphan-timeout without a coordinator"
    for w in (0, 1):
        assert "no coordinator answered for 3 s" in job.worker_log(w), job.logs_tail()
    status = job.status()
    assert status["state"] == "interrupted", summarize(status)
    tidal_home.assert_no_processes()
