"""A plain PyTorch loop changed only by ``tidal.prepare`` (issue 55): ``examples/plain_loop.py``
(AdamW, a warm-up and cosine LambdaLR, ``clip_grad_norm_``, a DataLoader, epoch by epoch) and
``examples/prepared_loop.py``, the same file with ``import tidal`` and one ``tidal.prepare``
line. Alone the prepared loop trains exactly as the plain one (bitwise); under the real
``tidal run`` it goes 2 -> 3 -> (worker 1 SIGKILLed inside the all-reduce of an epoch's last
step; replaced) -> 1 worker, and every member that finishes holds the plain loop's
parameters within 1e-12 (float64).

The script saves its parameters after its loop: under ``tidal run`` only the members that
finished the job get there (one, here). A ``sitecustomize`` of this test's own, on the
workers' ``PYTHONPATH``, also saves every member's parameters as its loop ends (those that
leave at the scale-down too) and, alone, after every step; the library reads nothing of it.
"""

from __future__ import annotations

import ast
import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import ROOT, Home, call_log, relative_l2, summarize

PLAIN = ROOT / "examples" / "plain_loop.py"
PREPARED = ROOT / "examples" / "prepared_loop.py"
EXACT = 1e-12
#: 1,200 samples, a global batch of 40: 30 steps an epoch, 3 epochs.
STEPS, PER_EPOCH = 90, 30

SAVE_STATES = """
import os
from tidal.worker.trainer import driven as _driven
from tidal.worker.trainer import elastic as _elastic

# Once per process (the zygote's interpreter may run this again: then it is wrapped already).
if os.environ.get("PREPARE_STATES") and not hasattr(_driven.Driven._loop_ended, "saving"):
    from safetensors.torch import save_file

    _folder = os.path.dirname(os.environ["PREPARE_STATES"])

    def _write(parts, name):
        state = parts.objects.module.state_dict()
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(_folder, name))

    _ended = _driven.Driven._loop_ended

    def _save(self):  # every member as its loop ends: finished, or leaving (then it exits)
        parts = self.parts
        if parts.link.worker_id is not None and parts.update.has_state:
            how = "done" if self.trainer.completed else "left"
            _write(parts, f"member-{parts.link.worker_id}-{how}-{parts.update.step:03d}.st")
        _ended(self)

    _commit = _elastic.ElasticLoop.commit

    def _commit_and_save(self):  # alone: the state after every step
        _commit(self)
        if self.parts.link.worker_id is None:
            _write(self.parts, f"alone-{self.parts.update.step:03d}.st")

    _save.saving = True
    _driven.Driven._loop_ended = _save
    _elastic.ElasticLoop.commit = _commit_and_save
"""


def code_lines(path: Path) -> list[str]:
    """The file's lines after its module docstring (what the two forms' docstrings say of
    themselves differs)."""
    text = path.read_text()
    doc = ast.parse(text).body[0]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), path
    return text.splitlines()[doc.end_lineno :]


def changed_lines(a: list[str], b: list[str]) -> list[str]:
    """The non-blank lines removed from ``a`` or added in ``b``."""
    diff = difflib.unified_diff(a, b, lineterm="", n=0)
    return [
        line
        for line in diff
        if line[:1] in "+-" and not line.startswith(("+++", "---")) and line[1:].strip()
    ]


def alone(*scripts: Path, out: Path) -> list[Path]:
    """Each of ``scripts`` in one process, no ``tidal run``, side by side; returns the
    parameters each saved (``out/NAME.safetensors``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    saved = [out / f"{script.stem}.safetensors" for script in scripts]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "--save", str(path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for script, path in zip(scripts, saved, strict=True)
    ]
    for proc, path in zip(procs, saved, strict=True):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and path.is_file(), err[-3000:]
    return saved


def test_the_prepared_loop_is_the_plain_loop_and_one_line() -> None:
    changed = changed_lines(code_lines(PLAIN), code_lines(PREPARED))
    assert changed == [
        "+import tidal",
        "+    model, opt, loader, sched = tidal.prepare(model, opt, loader, sched, epochs=args.epochs)",
    ], changed
    assert len(changed) <= 5


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_prepared_plain_loop_is_one_process_through_resizes_and_a_kill(
    tidal_home: Home, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    call_log(tmp_path, monkeypatch, SAVE_STATES, "PREPARE_STATES")
    plain, prepared = alone(PLAIN, PREPARED, out=tmp_path)
    assert relative_l2(prepared, plain) == 0.0  # alone, the prepared loop is the plain one
    assert relative_l2(tmp_path / f"alone-{STEPS:03d}.st", plain) == 0.0  # the hook's own
    kill = PER_EPOCH * 2 - 1  # the last step of epoch 1: the redo may heal into epoch 2
    proc, job = tidal_home.run(
        "prepared",
        "--workers",
        "2",
        "--max-workers",
        "3",
        "--schedule",
        "20:3,70:1",
        script=PREPARED,
        script_args=["--save", str(tmp_path / "final.safetensors")],
        faults=f"sigkill@worker=1,step={kill},phase=allreduce",
        timeout=140,
    )
    status = job.status()
    assert proc.returncode == 0, f"{proc.stderr}\n{summarize(status)}\n{job.logs_tail()}"
    assert status["state"] == "succeeded" and status["step"] == STEPS, summarize(status)
    sizes = [g["world_size"] for g in status["generations"] if g["start_step"] is not None]
    assert sizes[:2] == [2, 3] and sizes[-1] == 1, summarize(status)
    assert any("worker 1 failed" in g["reason"] for g in status["generations"]), summarize(status)
    logs = "\n".join(p.read_text() for p in tidal_home.path.rglob("*.log"))
    assert f"fired at step {kill} phase allreduce" in logs
    # Every member as its loop ended, the one that finished and those that left at the
    # scale-down, against one process at the same step.
    members = sorted(tmp_path.glob("member-*.st"))
    done = [m for m in members if f"-done-{STEPS:03d}" in m.name]
    left = [m for m in members if "-left-" in m.name]  # worker 2 at 70; a replacement too
    assert len(done) == 1 and left, summarize(status)
    for member in members:
        step = int(member.stem.rsplit("-", 1)[1])
        rel = relative_l2(member, tmp_path / f"alone-{step:03d}.st")
        assert rel <= EXACT, f"{member.name}: {rel:.3e} from one process at step {step}"
    # The script's own save after its loop: the finishing member's (the leavers exited).
    rel = relative_l2(tmp_path / "final.safetensors", plain)
    assert rel <= EXACT, f"the script's save: {rel:.3e} from the plain loop in one process"
