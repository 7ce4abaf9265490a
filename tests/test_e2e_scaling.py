"""The policy and the capacity drive the job on their own (issue: autoscaling)."""

from __future__ import annotations

import os
import signal

import pytest
from e2e_helpers import DIGITS, Home, event_messages, summarize, workers_by_id


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_throughput_policy_changes_world_size_on_its_own(tidal_home: Home):
    job = tidal_home.start(
        "pol",
        "--workers",
        "1",
        "--min-workers",
        "1",
        "--max-workers",
        "3",
        "--policy",
        "throughput",
        "--decision-interval",
        "2",
        "--price",
        "2.5",
        script_args=["--max-steps", "1000000"],
    )
    status = job.wait_for(
        lambda s: any(g["world_size"] != 1 for g in s["generations"]),
        timeout=150,
        what="the throughput policy to change the world size",
    )
    decisions = event_messages(status, "policy")
    assert decisions, summarize(status)
    # Each decision gives the measured numbers behind it.
    assert "samples/s measured" in decisions[0] and "throughput" in decisions[0]
    status = job.poll()
    assert status["cost"] > 0 and status["cost_per_1k_samples"] > 0, summarize(status)
    assert job.stop().returncode == 0
    job.wait_state("stopped", "failed", "succeeded", timeout=60)
    tidal_home.assert_no_processes()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_job_follows_a_capacity_trace_down_and_back(tidal_home: Home, tmp_path):
    trace = tmp_path / "drop.csv"
    trace.write_text("time_s,capacity,price_per_worker_hour\n0,3,1.0\n8,1,1.0\n16,3,1.0\n")
    job = tidal_home.start(
        "cap",
        "--workers",
        "3",
        "--max-workers",
        "3",
        "--capacity",
        str(trace),
        script_args=["--max-steps", "10000000"],
    )

    def back_at_three(s: dict) -> bool:
        formed = [g for g in s["generations"] if g["start_step"] is not None]
        sizes = [g["world_size"] for g in formed]
        return 1 in sizes and sizes[-1] == 3 and s["step"] > formed[-1]["start_step"] + 30

    job.wait_for(back_at_three, timeout=120, what="down to 1 and back to 3, training on")
    assert job.stop().returncode == 0  # the job's length is not what this test is about
    job.wait_state("stopped", "failed", timeout=60)
    status = job.status()
    assert status["state"] == "stopped", summarize(status)
    sizes = [g["world_size"] for g in status["generations"] if g["start_step"] is not None]
    # Down to the capacity of 1 (from 3, or from the start when the workers were slower to
    # start than the trace's first 8 s), then back up to 3.
    assert 1 in sizes and sizes[-1] == 3, summarize(status)
    assert max(sizes[sizes.index(1) :]) == 3, summarize(status)
    notices = event_messages(status, "capacity")
    if sizes[0] > 1:  # it trained above the drop: the members over capacity were told so
        assert any("preemption notice" in m for m in notices), summarize(status)
    else:  # the drop came first: no worker beyond the capacity of 1 was started before it
        assert not any("preemption notice" in m for m in notices), summarize(status)
        assert sizes[0] == 1 and status["generations"][0]["members"] == [0], summarize(status)
    assert not event_messages(status, "failure"), summarize(status)
    tidal_home.assert_no_processes()


def test_malformed_trace_is_one_line(tidal_home: Home, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("time,cap\n0,x\n")
    proc = tidal_home.cli("run", "--capacity", str(bad), "examples/digits.py")
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1 and "bad.csv" in proc.stderr
    proc = tidal_home.cli("run", "--policy", "magic", "examples/digits.py")
    assert proc.returncode != 0 and "known policies" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_warm_spare_replaces_a_lost_member_and_is_itself_replaced(tidal_home: Home):
    """``--spares 1`` (issue 17): a third worker starts, registers and waits outside the
    group; when a member is SIGKILLed the spare is the replacement (it was ready before the
    loss, so no process start is waited for), and a new spare starts and warms up. (The
    replacement joins and heals as any joiner does: exactness is tested with those.)"""
    job = tidal_home.start(
        "spares",
        "--workers",
        "2",
        "--max-workers",
        "2",
        "--spares",
        "1",
        script_args=["--max-steps", "1000000"],
    )
    status = job.wait_for(
        lambda s: s["standby_workers"] == 1 and s["state"] == "running",
        timeout=120,
        what="a warm spare",
    )
    assert status["spares"] == 1 and status["world_size"] == 2, summarize(status)
    spare = next(w["id"] for w in status["workers"] if w["state"] == "standby")
    victim = next(w for w in status["workers"] if w["state"] == "running")
    os.kill(victim["pid"], signal.SIGKILL)

    def replaced(s):
        formed = [g for g in s["generations"] if g["start_step"] is not None]
        return spare in formed[-1]["members"] and s["standby_workers"] == 1

    status = job.wait_for(replaced, timeout=120, what="the spare to join and a new one to warm")
    messages = event_messages(status)
    ready = messages.index(next(m for m in messages if m.startswith(f"worker {spare} ready")))
    lost = messages.index(next(m for m in messages if f"worker {victim['id']} failed" in m))
    assert ready < lost, summarize(status)  # the replacement was warm before the loss
    newest = max(w["id"] for w in status["workers"])
    assert newest > spare and workers_by_id(status)[newest]["state"] == "standby"
    assert job.stop().returncode == 0
    status = job.wait_state("stopped", "failed", "succeeded", timeout=60)
    assert status["state"] == "stopped", summarize(status)
    tidal_home.assert_no_processes()


def test_spares_are_counted_against_what_the_machine_holds(tidal_home: Home):
    proc = tidal_home.cli("run", "--workers", "2", "--spares", "100000", str(DIGITS))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "(2 + 100000 spares) is more than this machine holds" in lines[0], lines
    proc = tidal_home.cli("run", "--spares", "-1", str(DIGITS))
    assert proc.returncode != 0 and "--spares must be at least 0" in proc.stderr
