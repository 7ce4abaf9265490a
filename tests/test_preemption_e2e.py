"""``--preemption-notice`` end to end: a real ``tidal run`` whose workers poll a local
metadata server (``notice_server``, answering as AWS's ``spot/instance-action`` documents),
which starts announcing a notice for one worker while the job runs. That worker leaves as
planned (no failure, no step lost), the job goes on alone and ends equal to one
uninterrupted worker in float64 (DESIGN.md section 4)."""

from __future__ import annotations

import os
import signal

import pytest
from e2e_helpers import Home, event_messages, relative_l2, summarize, wait_stopped, workers_by_id
from notice_server import NoticeServer

STEPS = 300
STALL = 100  # worker 0 is SIGSTOPped before this step: the notice lands mid-job, surely
EXACT = 1e-12


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_cloud_notice_is_a_planned_leave_and_the_job_ends_exactly(
    tidal_home: Home, reference_params, tmp_path
) -> None:
    server = NoticeServer()
    try:
        save = tmp_path / "final.safetensors"
        job = tidal_home.start(
            "spot",
            "--workers",
            "2",
            "--preemption-notice",
            f"{server.base}/w{{worker}}",
            "--preemption-poll",
            "0.1",
            "--heartbeat-timeout",
            "100",
            "--collective-timeout",
            "200",
            script_args=["--max-steps", str(STEPS), "--save", str(save), "--double"],
            faults=f"sigstop@worker=0,step={STALL}",
        )
        status = job.wait_for(
            lambda s: s["step"] >= STALL and len(s["workers"]) == 2,
            timeout=120,
            what=f"the job to reach step {STALL}",
        )
        stopped = workers_by_id(status)[0]["pid"]
        wait_stopped(stopped, timeout=30)
        # Both workers poll their own URL, and nothing was announced yet.
        assert {"/w0", "/w1"} <= set(server.paths()), server.paths()[:10]
        assert len(status["generations"]) == 1, summarize(status)

        server.notice("/w1")
        status = job.wait_for(
            lambda s: len(s["generations"]) == 2,
            timeout=30,
            what="a generation without the worker that got the notice",
        )
        os.kill(stopped, signal.SIGCONT)
        status = job.wait_state("succeeded", "failed", timeout=120)
        status = job.status()  # the real ``tidal status --json``

        assert status["state"] == "succeeded" and status["step"] == STEPS, summarize(status)
        first, second = status["generations"]  # one change, and only one
        assert first["world_size"] == 2 and second["members"] == [0], summarize(status)
        reason = second["reason"]
        assert "worker 1 left: preemption notice" in reason and "/w1: terminate at" in reason
        assert "failed" not in reason
        assert not second["redone_steps"], summarize(status)  # no step lost
        assert not event_messages(status, "failure"), summarize(status)
        assert [w["state"] for w in status["workers"]] == ["exited", "exited"], summarize(status)
        assert "preemption notice" in job.worker_log(1)
        assert "preemption notice" not in job.worker_log(0)
        rel = relative_l2(reference_params(STEPS, double=True), save)
        assert rel <= EXACT, f"parameters differ from one worker's by {rel:.2e}"
        tidal_home.assert_no_processes()
    finally:
        server.close()
