"""The workload examples (gpt, cartpole, recsys) under ``tidal run`` with a scale-up and a
scale-down, in short versions; and CartPole's elastic invariance.

Each short version is the full example with tiny sizes: it must succeed, show the scripted
generations (world sizes 2, 3, 2 starting at the scheduled steps), and have learned something.
The quality thresholds of the full runs are in ``docs/examples.md``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from e2e_helpers import ROOT, Home, Status, relative_l2, summarize

EXAMPLES = ROOT / "examples"
ELASTIC = ("--workers", "2", "--max-workers", "3")


def run_elastic(
    home: Home,
    name: str,
    script: str,
    schedule: tuple[int, int],
    script_args: Sequence[str],
    *,
    opts: Sequence[str] = ELASTIC,
    timeout: float = 240,
) -> Status:
    """``tidal run --quiet`` in the foreground, scaling 2 -> 3 -> 2 at the two ``schedule``
    steps; returns the job's final ``tidal status --json``."""
    up, down = schedule
    proc, job = home.run(
        name,
        *opts,
        "--schedule",
        f"{up}:3,{down}:2",
        script=EXAMPLES / script,
        script_args=script_args,
        timeout=timeout,
    )
    status = job.status()
    assert proc.returncode == 0, f"{proc.stderr}\n{summarize(status)}\n{job.logs_tail()}"
    assert status["state"] == "succeeded", summarize(status)
    generations = [(g["world_size"], g["start_step"]) for g in status["generations"]]
    assert generations == [(2, 0), (3, up), (2, down)], summarize(status)
    home.assert_no_processes()
    return status


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_short_elastic(tidal_home: Home, tmp_path: Path) -> None:
    out = tmp_path / "gpt.safetensors"
    args = ["--files", "30", "--dim", "64", "--layers", "2", "--heads", "2", "--context", "64"]
    args += ["--global-batch-size", "12", "--lr", "5e-3", "--warmup", "5", "--max-steps", "60"]
    args += ["--val-windows", "32", "--eval-every", "20", "--save", str(out)]
    args += ["--autocast", "bf16", "--ema", "0.9"]  # bf16 forward passes on the CPU
    args += ["--ragged"]  # token-weighted: padded documents, step.backward(items=)
    status = run_elastic(tidal_home, "gpt", "gpt.py", (15, 40), args)
    metrics = status["metrics"]
    # At initialisation val_loss is about ln(256) = 5.5 nats, far above the unigram baseline.
    assert metrics["val_loss"] < metrics["unigram_loss"], summarize(status)
    assert metrics["ema_val_loss"] < metrics["unigram_loss"], summarize(status)
    assert out.is_file()


def run_alone(script: str, args: Sequence[str], env: dict[str, str] | None = None) -> str:
    """``python examples/SCRIPT ARGS`` without Tidal's environment; returns its stdout."""
    env = env or {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


TINY_GPT = ["--files", "12", "--dim", "32", "--layers", "1", "--heads", "2", "--context", "32"]
TINY_GPT += ["--global-batch-size", "4", "--val-windows", "4"]


# The examples alone are one process each, with no timing in them: not ``slow`` (that is
# the multi-process tests, one at a time), so CI runs them beside the unit tests.
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("script", "args", "done"),
    [
        ("gpt.py", [*TINY_GPT, "--max-steps", "3"], "done after 3 steps"),
        ("gpt.py", [*TINY_GPT, "--max-steps", "3", "--ragged"], "done after 3 steps"),
        ("cartpole.py", ["--max-steps", "2", "--eval-episodes", "2"], "done after 2 updates"),
        ("recsys.py", ["--max-steps", "5", "--interactions", "20000"], "done after 5 steps"),
    ],
)
def test_example_runs_alone(script: str, args: list[str], done: str) -> None:
    assert done in run_alone(script, args)


@pytest.mark.timeout(300)
def test_gpt_compile_runs_standalone(tmp_path: Path) -> None:
    """``--compile`` trains a few steps (alone: compiling in several workers at once on two
    cores would only repeat the same work)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")  # a cold compile
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile workers on 2 cores
    out = run_alone("gpt.py", [*TINY_GPT, "--max-steps", "3", "--compile"], env)
    assert "done after 3 steps" in out, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_recsys_short_elastic(tidal_home: Home) -> None:
    args = ["--max-steps", "250", "--lr", "2e-2", "--log-every", "50"]
    status = run_elastic(tidal_home, "recsys", "recsys.py", (80, 170), args)
    metrics = status["metrics"]
    assert metrics["auc"] >= 0.75, summarize(status)  # 0.5 at initialisation
    assert metrics["auc"] <= metrics["oracle_auc"] + 0.01, summarize(status)


CARTPOLE_UPDATES = 20


@pytest.fixture(scope="module")
def cartpole_elastic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Status, Path]]:
    """CartPole for 20 updates, 2 -> 3 -> 2 workers at updates 5 and 12: (status, params)."""
    root = tmp_path_factory.mktemp("cartpole")
    home = Home(root / "home")
    out = root / "elastic.safetensors"
    args = ["--max-steps", str(CARTPOLE_UPDATES), "--seed", "3", "--save", str(out)]
    try:
        status = run_elastic(home, "cartpole", "cartpole.py", (5, 12), args)
        yield status, out
    finally:
        home.cleanup()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cartpole_short_elastic(cartpole_elastic: tuple[Status, Path]) -> None:
    status, out = cartpole_elastic
    assert out.is_file()
    # A random policy keeps the pole up for about 22 steps.
    assert status["metrics"]["mean_return"] >= 100, summarize(status)  # 419 measured


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cartpole_elastic_invariance(
    cartpole_elastic: tuple[Status, Path], tidal_home: Home, tmp_path: Path
) -> None:
    """Episodes seeded by their index: a resized run ends with a one-worker run's parameters."""
    _, elastic = cartpole_elastic
    alone = tmp_path / "alone.safetensors"
    args = ["--max-steps", str(CARTPOLE_UPDATES), "--seed", "3", "--save", str(alone)]
    proc, job = tidal_home.run(
        "alone", "--workers", "1", script=EXAMPLES / "cartpole.py", script_args=args, timeout=240
    )
    assert proc.returncode == 0, f"{proc.stderr}\n{job.logs_tail()}"
    assert relative_l2(elastic, alone) <= 1e-4


def test_digits_reads_the_same_data_as_scikit_learn() -> None:
    """``examples/digits.py`` reads scikit-learn's bundled file without importing
    scikit-learn (1.5 s a worker start): the same images and labels as ``load_digits``."""
    import importlib.util

    import numpy as np
    from sklearn.datasets import load_digits

    spec = importlib.util.spec_from_file_location("digits_example", EXAMPLES / "digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    data, target = module.digits()
    bunch = load_digits()
    assert data.shape == (1797, 64) and data.dtype == bunch.data.dtype
    assert np.array_equal(data, bunch.data) and np.array_equal(target, bunch.target)


def test_digits_does_not_import_scikit_learn() -> None:
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('d', {str(EXAMPLES / 'digits.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "m.load_data()\n"
        "print('sklearn' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
