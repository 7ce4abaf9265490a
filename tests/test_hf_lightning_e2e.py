"""Hugging Face ``Trainer`` and Lightning under ``tidal run --torchrun`` (issue 55), with the
real libraries: ``examples/hf_trainer.py`` (a tiny GPT-2, random weights and token ids) and
``examples/lightning_ddp.py`` (a small ``LightningModule``, ``strategy="ddp"``), each as its
users write it, scaled 2 -> 3 -> 1 with ``tidal scale`` while it trains. Each world after
the first resumes from the newest checkpoint the script's library saved (HF's
``checkpoint-N``, Lightning's ``last.ckpt``), the last world ends at the requested number of
steps, and the loss falls.

Each world starts the script again (an import of the library, its setup): the scale to the
next size is sent as soon as the world has saved a checkpoint of its own, and the steps are
paced (``--sleep``) so that a world does not finish the job before it is scaled."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from e2e_helpers import ROOT, Home, summarize

if not os.environ.get("CI"):  # CI installs both (the test extra): there, a missing one fails
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")

MAX_STEPS, SAVE_STEPS = 30, 4


def records(log: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):  # a line being written
        return []


def last_step(found: list[dict], world: int) -> int:
    return max((r["step"] for r in found if "step" in r and r["world"] == world), default=0)


def wait_step(log: Path, world: int, step: int, timeout: float, job) -> int:
    """Wait until rank 0 of the world of size ``world`` logged ``step``: every checkpoint
    due before it is then complete (each library saves in the step that is due, before the
    next one starts). Returns the resumed step of that world."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = records(log)
        if last_step(found, world) >= step:
            starts = (r for r in found if "resumed_step" in r and r["world"] == world)
            return next(starts)["resumed_step"]
        time.sleep(0.05)
    status = summarize(job.poll())
    pytest.fail(
        f"timed out waiting for step {step} at {world} workers\n{status}\n{job.logs_tail()}"
    )


def scale(job, workers: int) -> None:
    """``tidal scale``'s own call, made in this process: the CLI's interpreter start (~1.5 s
    of a core) would let a world of these fast steps train on well past the point the test
    scales it at, or to its end."""
    from tidal.lookup import running_client

    client = running_client(job.home.path, job.name)
    try:
        assert client.scale(workers).target_workers == workers
    finally:
        client.close()


CASES = {
    "hf": ("hf_trainer.py", "--output-dir", "hf-out"),
    "lightning": ("lightning_ddp.py", "--checkpoint-dir", "ckpt"),
}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_library_trainer_scales_2_3_1_resuming_from_its_newest_checkpoint(
    tidal_home: Home, tmp_path: Path, case: str
) -> None:
    script, out_flag, out = CASES[case]
    log = tmp_path / "log.jsonl"
    args = [out_flag, str(tmp_path / out), "--record", str(log), "--max-steps", str(MAX_STEPS)]
    args += ["--save-steps", str(SAVE_STEPS), "--sleep", "0.05"]
    run = tidal_home.popen(
        "run", "--name", case, "--quiet", "--torchrun", "--workers", "2", "--max-workers", "3",
        str(ROOT / "examples" / script), *args,
    )  # fmt: skip
    job = tidal_home.job(case)
    try:
        # Scale once the world has a checkpoint of its own: its first save is complete once
        # rank 0 logged the step after it.
        wait_step(log, 2, SAVE_STEPS + 1, 60, job)
        scale(job, 3)
        resumed = wait_step(log, 3, 1, 60, job)
        wait_step(log, 3, resumed + SAVE_STEPS + 1, 60, job)
        scale(job, 1)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    status = job.status()
    assert run.returncode == 0, f"{err}\n{summarize(status)}\n{job.logs_tail()}"
    assert status["state"] == "succeeded", summarize(status)
    assert [g["world_size"] for g in status["generations"]] == [2, 3, 1], summarize(status)

    found = records(log)
    starts = [r for r in found if "resumed_step" in r]
    by_world: dict[int, list[dict]] = {}
    for r in starts:
        by_world.setdefault(r["restart_count"], []).append(r)
    # TORCHELASTIC_RESTART_COUNT counts the worlds; the library saw each world's size
    assert sorted(by_world) == [0, 1, 2], starts
    assert [sorted(r["rank"] for r in by_world[c]) for c in (0, 1, 2)] == [[0, 1], [0, 1, 2], [0]]
    assert [{r["world"] for r in by_world[c]} for c in (0, 1, 2)] == [{2}, {3}, {1}], starts
    resumed = []
    for c in (0, 1, 2):
        steps = {r["resumed_step"] for r in by_world[c]}
        assert len(steps) == 1, starts  # every member of a world resumed from the same one
        resumed.append(steps.pop())
    assert resumed[0] == 0, starts  # the first world started from scratch
    # Each restart resumed from the newest checkpoint: a saved step, no older than the last
    # save due before the last step the previous world logged (complete by then).
    for c, world in ((1, 2), (2, 3)):
        done = last_step(found, world)
        newest = SAVE_STEPS * ((done - 1) // SAVE_STEPS)
        assert resumed[c] % SAVE_STEPS == 0 and 0 < newest <= resumed[c] <= done, (c, starts)
    assert resumed[1] <= resumed[2] < MAX_STEPS, starts
    # The last world finished the job at the requested step, the loss fell
    assert [r["final_step"] for r in found if "final_step" in r] == [MAX_STEPS], found
    assert last_step(found, 1) == MAX_STEPS
    losses = [r["loss"] for r in found if "loss" in r]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, losses
    tidal_home.assert_no_processes()
