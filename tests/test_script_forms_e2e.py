"""Loops written the ways users write them, under the real ``tidal run`` (issue 49): a
token-weighted loss and a head unused on odd steps stay exact through 2 -> 3 -> 1 -> 2
workers with a SIGKILL inside the all-reduce, every finishing member compared with one
process in float64; a forward that bypasses ``trainer.model`` fails the job at its first
step in one line instead of training each member on its own gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import ROOT, Home, relative_l2, summarize

SCRIPT = ROOT / "tests" / "scripts" / "forms.py"
STEPS = 90
EXACT = 1e-12


def _alone(form: str, out: Path) -> Path:
    """The script in one process (no ``tidal run``); returns the file it saved."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--form", form, "--max-steps", str(STEPS), "--out", str(out)],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (saved,) = out.glob("*.safetensors")
    return saved


def _resized_run(
    home: Home, name: str, form: str, out: Path, phase: str = "allreduce", at: int = 35
) -> list[Path]:
    """2 -> 3 -> (worker 1 SIGKILLed at step ``at`` in ``phase``: inside the all-reduce,
    by default; replaced) -> 1 -> 2; returns every finishing member's parameters."""
    proc, job = home.run(
        name,
        "--workers",
        "2",
        "--max-workers",
        "3",
        "--schedule",
        "20:3,50:1,70:2",
        script=SCRIPT,
        script_args=["--form", form, "--max-steps", str(STEPS), "--out", str(out)],
        faults=f"sigkill@worker=1,step={at},phase={phase}",
        timeout=280,
    )
    assert proc.returncode == 0, f"{proc.stderr}\n{job.logs_tail()}"
    status = job.status()
    assert status["state"] == "succeeded", summarize(status)
    sizes = [g["world_size"] for g in status["generations"] if g["start_step"] is not None]
    assert sizes[:2] == [2, 3] and 1 in sizes and sizes[-1] == 2, summarize(status)
    assert any("worker 1 failed" in g["reason"] for g in status["generations"]), summarize(status)
    members = sorted(out.glob("worker-*.safetensors"))
    assert len(members) == 2, [m.name for m in members]
    for m in members:  # the tracker's run id: the job's, in every member (a joiner too)
        assert json.loads(m.with_suffix(".json").read_text())["job_name"] == name
    return members


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_token_weighted_losses_are_the_global_token_mean_at_every_size(
    tidal_home: Home, tmp_path: Path
) -> None:
    reference = _alone("items-ref", tmp_path / "ref")  # a plain loop: the global token mean
    for member in _resized_run(tidal_home, "items", "items", tmp_path / "out"):
        rel = relative_l2(member, reference)
        assert rel <= EXACT, f"{member.name}: {rel:.3e} from the global token mean"


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_head_unused_on_odd_steps_trains_exactly(tidal_home: Home, tmp_path: Path) -> None:
    reference = _alone("unused", tmp_path / "ref")
    for member in _resized_run(tidal_home, "unused", "unused", tmp_path / "out"):
        rel = relative_l2(member, reference)
        assert rel <= EXACT, f"{member.name}: {rel:.3e} from one process"


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_gradients_compressed_to_bf16_keep_the_members_equal(
    tidal_home: Home, tmp_path: Path
) -> None:
    """Not exact (each all-reduce rounds to bfloat16: at this learning rate the rounding
    alone moves a one-process run's parameters by ~60%), but every member holds the same
    parameters through the resizes and the kill."""
    from safetensors.torch import load_file

    reference = _alone("compressed", tmp_path / "ref")  # alone: nothing to compress
    first, *others = _resized_run(tidal_home, "compressed", "compressed", tmp_path / "out")
    for member in others:
        assert relative_l2(member, first) == 0.0, member.name
    assert relative_l2(first, reference) > 1e-6  # the gradients did travel rounded
    assert all(t.isfinite().all() for t in load_file(str(first)).values())


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_gan_with_two_optimizers_trains_exactly(tidal_home: Home, tmp_path: Path) -> None:
    """Adam for the generator, SGD with momentum and a scheduler for the discriminator:
    both states healed to joiners and carried through the kill, as one process's."""
    reference = _alone("gan", tmp_path / "ref")
    for member in _resized_run(tidal_home, "gan", "gan", tmp_path / "out"):
        rel = relative_l2(member, reference)
        assert rel <= EXACT, f"{member.name}: {rel:.3e} from one process"
        facts = json.loads(member.with_suffix(".json").read_text())
        assert facts["g_steps"] == STEPS  # Adam's own count, carried with its state


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_an_evaluation_split_across_members_gives_one_process_means(
    tidal_home: Home, tmp_path: Path
) -> None:
    """``trainer.evaluate`` at steps 10 (2 members), 30 (3: worker 1 killed right after
    publishing its first batch: the others compute the rest of its share), 60 (1) and 80
    (2): every member's means equal one process's, and so do the parameters."""
    reference = _alone("eval", tmp_path / "ref")
    expected = json.loads(reference.with_suffix(".json").read_text())["evaluated"]
    assert sorted(expected) == ["10", "30", "60", "80"]
    members = _resized_run(tidal_home, "eval", "eval", tmp_path / "out", "evaluate", 30)
    seen = set()
    for member in members:
        assert relative_l2(member, reference) <= EXACT, member.name
        got = json.loads(member.with_suffix(".json").read_text())["evaluated"]
        for step, means in got.items():
            seen.add(step)
            for name, value in means.items():
                assert value == pytest.approx(expected[step][name], rel=EXACT, abs=0), (
                    member.name,
                    step,
                    name,
                )
    assert "30" in seen and "80" in seen  # the killed evaluation finished on a survivor
    log = "\n".join(p.read_text() for p in tidal_home.path.rglob("*.log"))
    assert "phase evaluate" in log  # the fault fired inside the evaluation


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("form", "words"),
    [
        ("raw", ("were not all-reduced", "trainer.model(")),
        ("bare", ("step.backward() was never called", "call step.backward(loss)")),
        ("scale", ("grad_scaler.scale()", "unscaled loss")),
        ("loader", ("batch_size=5 would be ignored", "micro_batch_size=5")),
    ],
)
def test_a_trap_fails_the_job_at_its_first_step_in_one_line(
    tidal_home: Home, tmp_path: Path, form: str, words: tuple[str, str]
) -> None:
    proc, job = tidal_home.run(
        form,
        "--workers",
        "2",
        script=SCRIPT,
        script_args=["--form", form, "--max-steps", "20", "--out", str(tmp_path / "out")],
    )
    assert proc.returncode != 0
    status = job.status()
    assert status["state"] == "failed" and status["step"] == 0, summarize(status)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "out").exists()  # nobody finished
