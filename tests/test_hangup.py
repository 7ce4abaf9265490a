"""A closed terminal or output pipe never ends a job (issue 50 finding 2): real ``tidal run``
processes, a real pipe closed by its reader, a real pseudo-terminal hung up, real signals.

The decision (``docs/decisions/hangup.md``): the job trains on, reachable through ``tidal
status`` / ``tidal stop`` as before, and its events say so; what ``tidal run`` would have
written goes to ``HOME/jobs/NAME/coordinator.log``.
"""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import time

import pytest
from e2e_helpers import DIGITS, ROOT, Home, event_messages, pid_alive, summarize, wait_gone

STEPS = 100_000  # longer than any test waits: each ends its job itself


def _run(home: Home, name: str, *opts: str, stdout: int, stderr: int) -> subprocess.Popen:
    """``tidal run`` in the foreground, in its own session (its own process group, as a
    terminal's foreground job is), writing to ``stdout``/``stderr``."""
    return subprocess.Popen(
        [sys.executable, "-m", "tidal.cli", "run", "--home", str(home.path), "--name", name]
        + ["--workers", "2", *opts, str(DIGITS), "--max-steps", str(STEPS)],
        cwd=ROOT,
        env=home.env(),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )


def _trains_on(home: Home, name: str, proc: subprocess.Popen, why: str) -> dict:
    """The job keeps training after ``why``, its supervisor (``tidal run``) alive and its
    coordinator answering; returns the status ``tidal status --json`` (a subprocess) reads."""
    job = home.job(name)
    first = job.wait_running(min_step=0, timeout=60)
    job.wait_for(
        lambda s: s["state"] == "running" and s["step"] > first["step"] + 20,
        timeout=60,
        what=f"training to go on after {why}",
    )
    assert proc.poll() is None, f"`tidal run` exited ({proc.returncode}) after {why}"
    info = job.coordinator_info()
    assert info and pid_alive(info["pid"]) and info["supervisor_pid"] == proc.pid, info
    status = job.status()
    assert status["state"] == "running" and status["coordinator_pid"] == info["pid"]
    return status


def _stop_cleanly(home: Home, name: str, proc: subprocess.Popen) -> dict:
    """``tidal stop``: the job ends ``stopped`` with a final checkpoint, ``tidal run`` exits 1."""
    job = home.job(name)
    stop = job.stop()
    assert stop.returncode == 0, stop.stderr
    assert proc.wait(timeout=90) == 1
    status = job.status()
    assert status["state"] == "stopped", summarize(status)
    assert status["checkpoints"] and status["checkpoints"][-1]["step"] == status["step"], status
    assert all(w["state"] in ("exited", "failed") for w in status["workers"]), summarize(status)
    return status


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_closed_output_pipe_leaves_the_job_training(tidal_home: Home) -> None:
    """``tidal run ... | head -3``: the reader goes, the job stays."""
    read, write = os.pipe()
    err = tidal_home.path.parent / "run-stderr.txt"
    tidal_home.path.mkdir(parents=True)
    with open(err, "wb") as errf:
        proc = _run(
            tidal_home,
            "piped",
            "--checkpoint-every",
            "100000",
            stdout=write,
            stderr=errf.fileno(),
        )
    os.close(write)
    with os.fdopen(read, "rb") as reader:
        lines = [reader.readline() for _ in range(3)]  # `head -3`
    assert all(lines), lines
    # The reader is gone: the next progress line gets EPIPE.
    status = _trains_on(tidal_home, "piped", proc, "its output pipe closed")
    lost = [m for m in event_messages(status, "coordinator") if "was closed (EPIPE)" in m]
    assert len(lost) == 1 and "the job trains on" in lost[0], summarize(status)
    ended = _stop_cleanly(tidal_home, "piped", proc)
    assert ended["url"] is None, "a job that ended has no address to call"
    log = (tidal_home.job("piped").dir / "coordinator.log").read_text()
    assert "job piped stopped at step" in log, log  # the end, where the terminal was
    assert err.read_text() == "", err.read_text()  # no traceback on the stderr it kept
    tidal_home.assert_no_processes()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_terminal_hang_up_leaves_the_job_training_and_reachable(tidal_home: Home) -> None:
    """A closed SSH session: the terminal hangs up (every write fails with EIO) and its
    foreground process group gets SIGHUP."""
    master, slave = pty.openpty()
    proc = _run(tidal_home, "hungup", "--checkpoint-every", "100000", stdout=slave, stderr=slave)
    os.close(slave)
    job = tidal_home.job("hungup")
    job.wait_running(min_step=0, timeout=60)
    os.close(master)  # the terminal is gone: writes to it fail from now on
    os.killpg(proc.pid, signal.SIGHUP)  # what the kernel sends the foreground group
    status = _trains_on(tidal_home, "hungup", proc, "a SIGHUP")
    lost = [m for m in event_messages(status, "coordinator") if "hung up (SIGHUP)" in m]
    assert len(lost) == 1 and "`tidal stop hungup` stops it" in lost[0], summarize(status)
    # Reachable as any running job: `tidal attach` has nothing to take over.
    attach = tidal_home.cli("attach", "hungup")
    assert attach.returncode == 1 and "has a live coordinator" in attach.stderr, attach.stderr
    _stop_cleanly(tidal_home, "hungup", proc)
    log = (job.dir / "coordinator.log").read_text()
    assert "job hungup stopped at step" in log, log
    tidal_home.assert_no_processes()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_coordinator_whose_supervisor_died_says_it_runs_unsupervised(tidal_home: Home) -> None:
    job = tidal_home.start("alone", "--workers", "1", script_args=["--max-steps", str(STEPS)])
    job.wait_running(min_step=5, timeout=60)
    info = job.coordinator_info()
    os.kill(info["supervisor_pid"], signal.SIGKILL)  # `tidal run` alone
    assert not wait_gone([info["supervisor_pid"]], timeout=10)
    status = job.wait_for(
        lambda s: any("runs on unsupervised" in m for m in event_messages(s, "coordinator")),
        timeout=30,
        what="an event saying the coordinator is unsupervised",
    )
    assert status["state"] == "running" and status["coordinator_pid"] == info["pid"]
    line = next(m for m in event_messages(status, "coordinator") if "unsupervised" in m)
    assert f"pid {info['supervisor_pid']}" in line and "tidal attach alone" in line, line
    time.sleep(0.5)
    assert job.stop().returncode == 0
    job.wait_state("stopped", timeout=60)
    tidal_home.assert_no_processes()
