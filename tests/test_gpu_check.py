"""The GPU check (``python -m bench.gpu``, docs/gpu.md): its refusal without CUDA, its whole
logic on the CPU (``--device cpu``: gloo instead of NCCL, CPU tensors), and, where CUDA
exists, the check itself (``pytest -m gpu``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = "no CUDA device: the GPU check needs one; `--device cpu` runs its logic on CPU"


def gpu_check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.timeout(60)
def test_without_cuda_the_check_says_so_in_one_line_and_exits_2() -> None:
    proc = gpu_check(timeout=50)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [NO_CUDA], proc.stderr


def run_on_cpu(tmp_path: Path, keys: str, *only: str, timeout: float = 140) -> tuple[dict, str]:
    """``python -m bench.gpu --device cpu --quick [--only ...]``: its JSON and its summary,
    after the checks every part in ``keys`` must pass."""
    out = tmp_path / "gpu.json"
    proc = gpu_check("--device", "cpu", "--quick", *only, "--json", str(out), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = proc.stderr[-3000:]  # the human summary, one line a part
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == result
    assert result["device"] == "cpu" and result["passed"] is True
    parts = result["parts"]
    for key in keys:
        assert parts[key]["passed"] is True, (parts[key], summary)
        assert parts[key]["checks"] and all(c["ok"] for c in parts[key]["checks"]), parts[key]
        assert 0 < parts[key]["seconds"] <= parts[key]["timeout_s"], (parts[key], summary)
    assert parts["d"]["skipped"], parts["d"]  # two GPUs or --only d
    assert "GPU check on cpu" in proc.stderr and "PASSED" in proc.stderr
    return result, summary


def check_a(a: dict, summary: str) -> None:
    assert a["world_sizes"][0] == 2 and 3 in a["world_sizes"] and a["world_sizes"][-1] == 1, a
    assert a["rel_l2"] and finite(a["max_rel_l2"]) and a["max_rel_l2"] <= a["rel_bound"], a
    assert finite(a["kill_pause_s"]), (a, summary)


def check_b(b: dict) -> None:
    assert finite(b["reform_pause_s"]) and b["reform_pause_s"] > 0, b
    assert b["resumed_from_step"] >= 20 and b["checkpoints"], b
    assert finite(b["max_rel_l2"]) and b["max_rel_l2"] <= 1e-4, b


def check_c(c: dict, rows: list[dict]) -> None:
    assert finite(c["tidal_samples_per_s"]) and c["tidal_samples_per_s"] > 0, c
    assert finite(c["peer_samples_per_s"]) and c["peer_samples_per_s"] > 0, c
    (row,) = rows
    assert set(row) == {"name", "tidal", "peer", "ratio", "unit", "peer_name", "peer_config"}
    assert row["unit"] == "samples/s" and finite(row["ratio"]) and row["peer_name"] == "torchrun"
    # the pairs alternate, and the row's ratio is their median, inside their spread
    assert c["pairs"] >= 2 and len(c["pair_ratios"]) == c["pairs"], c
    low, high = c["ratio_spread"]
    assert low <= row["ratio"] <= high and [low, high] == [
        min(c["pair_ratios"]),
        max(c["pair_ratios"]),
    ]


def check_e(e: dict, summary: str) -> None:
    """AMP: bf16 autocast, and fp16 with a GradScaler killed and resumed."""
    assert set(e["runs"]) == {"bf16", "fp16"}, e
    for mode, run in e["runs"].items():
        first, final = run["val_loss_first"], run["val_loss_final"]
        assert finite(first) and finite(final) and final < first, (mode, run)
    fp16 = e["runs"]["fp16"]
    assert fp16["first_run_exit"] != 0 and fp16["checkpoints"], fp16
    assert e["checkpoint_every"] <= e["resumed_from_step"] < e["kill_step"] < e["steps"], e
    assert finite(fp16["grad_scaler_at_resume"]["scale"]), fp16
    assert "bf16 val_loss" in summary and "fp16 val_loss" in summary, summary


def check_f(f: dict) -> None:
    """``sharding="fsdp"``: a re-form, then a lost job resumed at fsdp and at ddp."""
    assert finite(f["reform_pause_s"]) and f["reform_pause_s"] > 0, f
    assert f["first_run_exit"] != 0 and f["checkpoints"], f
    assert set(f["resumes"]) == {"fsdp", "ddp"}, f
    for sharding, r in f["resumes"].items():
        assert r["resumed_from_step"] == max(f["checkpoints"]) >= 20, (sharding, f)
        assert r["rel_l2"] and all(finite(v) and v <= 1e-4 for v in r["rel_l2"].values()), r
    assert finite(f["max_rel_l2"]) and f["max_rel_l2"] <= 1e-4, f


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_sharded_part_passes_on_cpu(tmp_path: Path) -> None:
    """Part (f), ``sharding="fsdp"`` over one worker's group: issue 56's CPU acceptance
    (``bench.gpu --device cpu --only f``)."""
    result, summary = run_on_cpu(tmp_path, "f", "--only", "f", timeout=190)
    assert "(f) PASS" in summary, summary
    check_f(result["parts"]["f"])


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_amp_part_passes_on_cpu(tmp_path: Path) -> None:
    """CI's small part of the check (the whole is ``-m bench``): (e), AMP with a GradScaler
    carried through a resume. Part (b)'s mechanisms (a failed collective, a lost job and its
    resume) are CI's end-to-end tests on the CPU already (``test_e2e_runtime``,
    ``test_e2e_checkpoint``); its harness runs in the ``bench`` test below."""
    result, summary = run_on_cpu(tmp_path, "e", "--only", "e")
    parts = result["parts"]
    assert parts["a"]["skipped"] and parts["b"]["skipped"] and parts["c"]["skipped"], parts
    assert parts["f"]["skipped"], parts
    check_e(parts["e"], summary)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_speed_part_runs_alternating_pairs_on_cpu(tmp_path: Path) -> None:
    """Part (c) is what a GPU session measures throughput with, and it runs nowhere else:
    its CPU form in CI (two pairs, the order swapped) keeps it from breaking unseen."""
    result, _ = run_on_cpu(tmp_path, "c", "--only", "c")
    check_c(result["parts"]["c"], result["rows"])


@pytest.mark.bench
@pytest.mark.timeout(300)
def test_the_check_logic_passes_on_cpu(tmp_path: Path) -> None:
    result, summary = run_on_cpu(tmp_path, "abcef", timeout=290)
    parts = result["parts"]
    check_a(parts["a"], summary)
    check_b(parts["b"])
    check_c(parts["c"], result["rows"])
    check_e(parts["e"], summary)
    check_f(parts["f"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(620)
def test_the_gpu_check_passes(tmp_path: Path) -> None:
    proc = gpu_check("--workdir", str(tmp_path / "work"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout)
    assert result["device"] == "cuda" and result["passed"] is True, proc.stderr[-6000:]
    for key in "abce":
        assert result["parts"][key]["passed"] is True, result["parts"][key]


@pytest.mark.timeout(120)
def test_the_nccl_leave_probe_runs_its_logic_on_cpu(tmp_path: Path) -> None:
    """``python -m bench.gpu.leave --cpu``: the probe's three ways of leaving, on gloo."""
    out = tmp_path / "leave.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.leave", "--cpu", "--cycles", "2", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["passed"] and all(result["checks"].values()), result["checks"]
    assert [r["way"] for r in result["rows"]] == [
        w for w in ("abort", "destroy", "detached") for _ in range(2)
    ]
    for way in ("abort", "detached"):  # both timed the abort apart from the wait
        assert finite(result["summary_median"][way]["pg_abort_ms"]), result["summary_median"]
    # the second detached cycle formed while the first's abort ran, and waited for it after
    assert result["rows"][-1]["previous_abort_done"] is True, result["rows"][-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.timeout(60)
def test_without_cuda_the_leave_probe_says_so_in_one_line_and_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.leave"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == ["no CUDA device: the NCCL leave probe needs one"]
