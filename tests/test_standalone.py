"""The digits example run as a plain script: Trainer trains alone, with the same mathematics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "digits.py"


def run_digits(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_micro_batches_give_the_full_batch_update(tmp_path: Path) -> None:
    full, micro = tmp_path / "full.safetensors", tmp_path / "micro.safetensors"
    out = run_digits("--max-steps", "120", "--save", str(full))
    run_digits("--max-steps", "120", "--micro-batch-size", "16", "--save", str(micro))

    accuracy = re.findall(r"accuracy (\d\.\d+)", out)
    assert accuracy, out
    assert float(accuracy[-1]) >= 0.85, out
    assert "done after 120 steps" in out

    a, b = load_file(str(full)), load_file(str(micro))
    assert a.keys() == b.keys() and len(a) == 6
    for name in a:
        rel = torch.linalg.vector_norm(a[name] - b[name]) / torch.linalg.vector_norm(a[name])
        assert rel < 1e-5, (name, rel.item())
