"""A DataLoader worker process SIGKILLed mid-run under ``tidal run --workers 2`` (issue 50,
finding 5: it failed the whole job). The member replaces it and trains on: the job
succeeds in its first generation (no failure, no re-form), every committed step consumed
the samples of a one-worker run (none lost, none twice) and the float64 parameters of both
members equal that run's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from e2e_helpers import ROOT, Home, relative_l2, summarize
from test_inputs_e2e import committed_ids

SCRIPT = ROOT / "tests" / "scripts" / "inputs.py"
STEPS = 30
EXACT = 1e-12


def script_args(out: Path, *more: str) -> list[str]:
    return ["--kind", "map", "--max-steps", str(STEPS), "--out", str(out), *more]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_loader_process_fails_no_step_and_no_sample(
    tidal_home: Home, tmp_path: Path
) -> None:
    ref, out = tmp_path / "ref", tmp_path / "elastic"
    alone = subprocess.run(  # the one-worker reference: the script alone
        [sys.executable, str(SCRIPT), *script_args(ref)],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    want = committed_ids(ref)
    victim = want[5][7]  # the loader process that first fetches it (step 5) kills itself

    proc, job = tidal_home.run(
        "loader-kill",
        "--workers",
        "2",
        script=SCRIPT,
        script_args=script_args(out, "--loader-dies-on", str(victim)),
        timeout=200,
    )
    assert proc.returncode == 0, f"{proc.stderr}\n{job.logs_tail()}"
    assert (out / "loader-died").exists(), "no loader process was killed"
    status = job.status()
    assert status["state"] == "succeeded", summarize(status)
    formed = [g for g in status["generations"] if g["start_step"] is not None]
    assert len(formed) == 1 and formed[0]["world_size"] == 2, summarize(status)
    assert not any("fail" in g["reason"] for g in status["generations"]), summarize(status)
    logs = job.worker_log(0) + job.worker_log(1)
    assert "its loader restarts at micro-batch" in logs, job.logs_tail()

    got = committed_ids(out)
    assert sorted(got) == list(range(STEPS)) == sorted(want)
    for step in range(STEPS):
        assert Counter(got[step]) == Counter(want[step]), f"step {step}: ids differ"
        assert len(set(got[step])) == len(got[step]) == 24, f"step {step}: an id twice"
    (ref_params,) = ref.glob("worker-*.safetensors")
    members = sorted(out.glob("worker-*.safetensors"))
    assert len(members) == 2, members
    for m in members:
        rel = relative_l2(m, ref_params)
        assert rel <= EXACT, f"{m.name} differs from the 1-worker run by {rel:.3e}"
