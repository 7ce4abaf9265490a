"""A job whose checkpoints are in an object store survives the loss of its machine and its
home: ``tidal resume NAME --checkpoint-dir s3://...`` on a fresh home rebuilds the job from
the spec kept beside its checkpoints and finishes it at another world size, equal to one
uninterrupted worker (float64). The S3 server is moto's, on 127.0.0.1 (``moto_server``)."""

from __future__ import annotations

import shutil

import pytest
from e2e_helpers import Home, relative_l2, summarize
from test_e2e_checkpoint import EXACT, kill_everything

STEPS = 80


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_home_deleted_the_job_resumes_on_three_workers_from_s3(
    tidal_home: Home, s3, reference_params, tmp_path
):
    save = tmp_path / "resumed.safetensors"
    storage = s3.url("tidal")
    job = tidal_home.start(
        "s3job",
        "--workers",
        "2",
        "--checkpoint-every",
        "20",
        "--checkpoint-dir",
        storage,
        "--heartbeat-timeout",
        "100",
        "--collective-timeout",
        "200",
        script_args=["--max-steps", str(STEPS), "--save", str(save), "--double"],
        faults="sigstop@worker=1,step=50",  # a deterministic place to lose the machine
    )
    status = job.wait_for(
        lambda s: s["step"] >= 50 and any(c["step"] == 40 for c in s["checkpoints"]),
        timeout=90,
        what="the job to reach step 50 with a checkpoint of step 40",
    )
    assert [c["path"] for c in status["checkpoints"]] == [
        f"{storage}/s3job/step-00000020",
        f"{storage}/s3job/step-00000040",
    ], summarize(status)
    kill_everything(job)
    shutil.rmtree(tidal_home.path)  # the machine and its home are gone; the bucket is not

    proc = tidal_home.cli(
        "resume", "s3job", "--checkpoint-dir", storage, "--workers", "3", "--quiet", timeout=120
    )
    assert proc.returncode == 0, f"{proc.stderr}\n{job.logs_tail()}"
    assert f"record rebuilt from {storage}/s3job/spec.json" in proc.stderr, proc.stderr
    assert "resuming from step-00000040 (step 40) with 3 workers" in proc.stderr, proc.stderr
    status = job.status()
    assert status["state"] == "succeeded" and status["step"] == STEPS, summarize(status)
    resumed = [g for g in status["generations"] if g["start_step"] is not None][-1]
    assert resumed["world_size"] == 3 and resumed["start_step"] == 40, summarize(status)
    rel = relative_l2(reference_params(STEPS, double=True), save)
    assert rel <= EXACT, f"resumed parameters differ by {rel:.2e}"

    # The bucket: the newest 3 (--keep-checkpoints), each complete; the spec and the fence.
    keys = s3.moto.keys(s3.bucket, "tidal/s3job/")
    folders = sorted({k.split("/")[2] for k in keys if k.split("/")[2].startswith("step-")})
    assert folders == ["step-00000040", "step-00000060", "step-00000080"], sorted(keys)
    assert all(f"tidal/s3job/{f}/MANIFEST.json" in keys for f in folders)
    assert {"tidal/s3job/spec.json", "tidal/s3job/.fence"} <= set(keys)
    assert [c["step"] for c in status["checkpoints"]] == [40, 60, 80], summarize(status)
    tidal_home.assert_no_processes()
