"""A script that exits 0 before it joins the job fails the job at once, in one line (issue 50).

Before: a worker that exited 0 without ever registering (a ``__main__`` guard that calls
nothing, an early return) was a lost worker: replaced until ``--max-restarts`` was spent
(62 starts in 20 s under the default 60/h), and the job's error blamed the restart budget.
Now it is the script's bug, shared by every worker (``exit_rules.judge_exit``,
``docs/decisions/exit-before-joining.md``): the job fails at the first such exit with
``tidal: error: job NAME failed: SCRIPT exited 0 without running a tidal.Trainer (did it run
its main?)``, and no worker is started after it. The rule's table is in
``test_rules.py::test_judge_exit``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import Home, event_messages, summarize

LINE = "exited 0 without running a tidal.Trainer (did it run its main?)"

# The usual mistake: the guard names something else, so nothing runs.
NO_MAIN = """
import tidal


def main():
    raise AssertionError("never called")


if __name__ == "__mian__":
    main()
"""

# Worker 0 trains; any other worker returns before it makes its Trainer.
ONLY_WORKER_0 = """
import os, sys, torch, tidal
from torch.utils.data import TensorDataset


def main():
    if os.environ["TIDAL_WORKER_ID"] != "0":
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    trainer = tidal.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                            global_batch_size=8)
    for step in trainer.run(10_000_000):
        for x, y in step.micro_batches():
            step.backward(torch.nn.functional.cross_entropy(trainer.model(x), y))


if __name__ == "__main__":
    main()
"""


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("tidal: error:")]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_script_that_never_runs_its_main_fails_at_once(tidal_home: Home, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(NO_MAIN)
    proc, job = tidal_home.run("nomain", "--workers", "2", script=script, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert error_lines(proc.stderr) == [f"tidal: error: job nomain failed: train.py {LINE}"], (
        proc.stderr
    )
    status = job.status()
    assert status["state"] == "failed", summarize(status)
    assert sorted(w["id"] for w in status["workers"]) == [0, 1], summarize(status)  # none again
    assert not any("--max-restarts" in m for m in event_messages(status)), summarize(status)
    tidal_home.assert_no_processes()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_joiner_that_returns_before_its_trainer_fails_a_training_job(
    tidal_home: Home, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(ONLY_WORKER_0)
    job = tidal_home.start("early", "--workers", "1", "--max-workers", "2", script=script)
    job.wait_running(min_step=3, timeout=60)
    assert job.scale(2).returncode == 0
    status = job.wait_state("failed", "succeeded", "stopped", timeout=60)
    assert status["state"] == "failed", summarize(status)
    failed = [m for m in event_messages(status, "job") if m.startswith("job failed")]
    assert failed == [f"job failed: train.py {LINE}"], summarize(status)
    assert sorted(w["id"] for w in status["workers"]) == [0, 1], summarize(status)
    tidal_home.assert_no_processes(timeout=20)
