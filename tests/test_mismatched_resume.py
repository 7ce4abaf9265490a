"""A resume with a script that does not fit the checkpoint is refused, and the checkpoint is
kept (issue 50, finding 4), through the real CLI.

Before: the worker marked the checkpoint ``BAD`` for good when it did not load into the
script's model; three resumes with a changed model, then the right script, gave "no good
checkpoint to resume from". Now a checkpoint is marked bad only for what is wrong with it
(a checksum or structure ``verify`` refuses); a mismatch is one error line naming it, a
non-zero exit, and the checkpoint untouched, so the right script resumes from it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from e2e_helpers import Home, summarize

SIDECAR_WIDTH = """
import sys, torch, tidal
from pathlib import Path
from torch.utils.data import TensorDataset
torch.set_num_threads(1)
width = int((Path(__file__).parent / "width.txt").read_text())  # a config file, say
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 2, (256,), generator=g))
trainer = tidal.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                        global_batch_size=16)
for step in trainer.run(int(sys.argv[1])):
    for x, y in step.micro_batches():
        step.backward(torch.nn.functional.cross_entropy(trainer.model(x), y) / 16)
"""


def fingerprint(folder: Path) -> dict[str, str]:
    """Every file of the checkpoints in ``folder`` and its sha256: what a resume must leave
    as it was (the folder's other files, such as a resume's fence, may change)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.glob("step-*/**/*"))
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resumes_with_another_model_refuse_and_keep_every_checkpoint(
    tidal_home: Home, tmp_path: Path
) -> None:
    script, width = tmp_path / "sidecar.py", tmp_path / "width.txt"
    script.write_text(SIDECAR_WIDTH)
    width.write_text("16")
    job = tidal_home.start(
        "shape",
        "--workers",
        "1",
        "--checkpoint-every",
        "5",
        script=script,
        script_args=["10000000"],  # never reached: the test stops it
    )
    job.wait_running(min_step=16, timeout=90)
    assert job.stop().returncode == 0
    status = job.wait_state("stopped", "failed", "succeeded", timeout=60)
    assert status["state"] == "stopped", summarize(status)
    checkpoints = job.dir / "checkpoints"
    newest = max(p.name for p in checkpoints.glob("step-*"))
    kept = fingerprint(checkpoints)
    assert len(list(checkpoints.glob("step-*"))) >= 2, kept

    width.write_text("32")  # the model changed: 0.weight is [32, 8], the checkpoint's [16, 8]
    for attempt in range(2):  # a second refusal: nothing was marked by the first
        proc = tidal_home.cli("resume", "shape", "--quiet", timeout=120)
        assert proc.returncode != 0, proc.stderr
        assert not list(checkpoints.glob("*/BAD")), (attempt, proc.stderr)
        assert fingerprint(checkpoints) == kept, attempt  # not a byte changed, nothing added
        errors = [line for line in proc.stderr.splitlines() if line.startswith("tidal: error:")]
        assert len(errors) == 1, (attempt, proc.stderr)
        assert "CheckpointMismatch" in errors[0] and newest in errors[0], errors[0]
        assert "0.weight is torch.float32 [16, 8], the model's torch.float32 [32, 8]" in errors[0]
        assert "refused, and kept: 0.weight" in errors[0], errors[0]
        assert f"resuming from {newest}" in proc.stderr, (attempt, proc.stderr)

    width.write_text("16")  # the right script: the newest checkpoint resumes
    proc = tidal_home.cli("resume", "shape", "--detach", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"resuming from {newest}" in proc.stderr and "warning" not in proc.stderr, proc.stderr
    step = int(newest.removeprefix("step-"))
    status = job.wait_running(min_step=step + 5, timeout=90)
    assert status["generations"][-1]["start_step"] == step, summarize(status)
    assert job.stop().returncode == 0
    assert job.wait_state("stopped", "failed", "succeeded", timeout=60)["state"] == "stopped"
    tidal_home.assert_no_processes()
