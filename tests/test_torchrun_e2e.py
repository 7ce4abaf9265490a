"""``tidal run --torchrun`` end to end (issue 55): an unmodified DDP script written for
torchrun (``examples/ddp_torchrun.py``: ``env://``, ``DistributedSampler``, its own
``torch.save`` snapshot) scaled 2 -> 3 -> 1 with ``tidal scale`` while it trains, each world
restarted from the script's snapshot; and scripts that never form a process group, which
fail in one line instead of restarting."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from e2e_helpers import ROOT, Home, summarize

SCRIPT = ROOT / "examples" / "ddp_torchrun.py"


def records(log: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):  # a line being written
        return []


def wait_log(log: Path, pred, timeout: float, what: str, job) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = records(log)
        if pred(found):
            return found
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}\n{summarize(job.poll())}\n{job.logs_tail()}")


def last_step(found: list[dict], world: int) -> int:
    return max((r["step"] for r in found if "step" in r and r["world"] == world), default=0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_unmodified_ddp_script_scales_2_3_1_resuming_from_its_snapshot(
    tidal_home: Home, tmp_path: Path
) -> None:
    log, snap = tmp_path / "log.jsonl", tmp_path / "snapshot.pt"
    args = ["--snapshot", str(snap), "--record", str(log), "--max-steps", "150", "--sleep", "0.02"]
    run = tidal_home.popen(
        "run", "--name", "ddp", "--quiet", "--torchrun", "--workers", "2", "--max-workers", "3",
        str(SCRIPT), *args,
    )  # fmt: skip
    job = tidal_home.job("ddp")
    try:
        wait_log(log, lambda f: last_step(f, 2) >= 20, 60, "20 steps at 2 workers", job)
        assert job.scale(3).returncode == 0
        wait_log(log, lambda f: last_step(f, 3) >= 60, 60, "steps at 3 workers", job)
        assert job.scale(1).returncode == 0
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    status = job.status()
    assert run.returncode == 0, f"{err}\n{summarize(status)}\n{job.logs_tail()}"
    assert status["state"] == "succeeded", summarize(status)
    assert [g["world_size"] for g in status["generations"]] == [2, 3, 1], summarize(status)
    assert all(g["start_step"] is not None for g in status["generations"])  # each formed
    assert all(g["pause_s"] is not None for g in status["generations"][1:]), summarize(status)

    found = records(log)
    starts = [r for r in found if "resumed_step" in r]
    by_world = {}
    for r in starts:
        by_world.setdefault(r["restart_count"], []).append(r)
    # TORCHELASTIC_RESTART_COUNT counts the worlds; every member of one agrees on its size
    assert sorted(by_world) == [0, 1, 2], starts
    assert [sorted(r["rank"] for r in by_world[c]) for c in (0, 1, 2)] == [[0, 1], [0, 1, 2], [0]]
    assert {r["world"] for r in by_world[1]} == {3} and {r["world"] for r in by_world[2]} == {1}
    # the first world started from scratch; each restart resumed from the snapshot, not 0
    resumed = [{r["resumed_step"] for r in by_world[c]} for c in (0, 1, 2)]
    assert resumed[0] == {0} and all(len(s) == 1 for s in resumed), starts
    assert 20 <= min(resumed[1]) and min(resumed[1]) < min(resumed[2]) < 150, starts
    assert last_step(found, 1) == 150  # and the last world finished the job
    tidal_home.assert_no_processes()


ALONE = "import time\nprint('training alone')\n"
RAISES = "raise RuntimeError('no data here')\n"
HANGS = "import time\ntime.sleep(600)\n"


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("body", "opts", "line"),
    [
        (ALONE, (), "bad.py exited 0 before its process group formed: under --torchrun"),
        (
            RAISES,
            (),
            "worker 0 exited with code 1 before its process group formed: RuntimeError: no data",
        ),
        (HANGS, ("--start-timeout", "6"), "the process group of generation 1 did not form"),
    ],
    ids=["exits-0", "raises", "never-forms"],
)
def test_a_script_that_never_forms_a_process_group_fails_in_one_line(
    tidal_home: Home, tmp_path: Path, body: str, opts: tuple[str, ...], line: str
) -> None:
    script = tmp_path / "bad.py"
    script.write_text(body)
    proc, job = tidal_home.run(
        "bad", "--torchrun", "--workers", "2", *opts, script=script, timeout=60
    )
    status = job.status()
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 1 and len(lines) == 1, f"{proc.stderr}\n{summarize(status)}"
    assert lines[0].startswith("tidal: error: job bad failed: "), lines
    assert line in lines[0] or line.replace("worker 0", "worker 1") in lines[0], lines
    assert status["state"] == "failed" and len(status["generations"]) == 1, summarize(status)
    tidal_home.assert_no_processes()


LOGS_STEPS = """
import atexit, gc, os, sys, time
import torch, torch.distributed as dist
import tidal

snap = sys.argv[1]
frozen = gc.get_freeze_count()  # the zygote's imports, if it forked this worker
def note_frozen():  # at the exit, after the launcher's freeze
    with open(f"{snap}.frozen-{os.getpid()}", "w") as f:
        f.write(f"{frozen} {gc.get_freeze_count()}")
atexit.register(note_frozen)
dist.init_process_group("gloo")
step = int(open(snap).read()) if os.path.exists(snap) else 0
while step < 60:
    t = torch.ones(1)
    dist.all_reduce(t)
    step += 1
    time.sleep(0.02)
    if dist.get_rank() == 0:
        with open(snap + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(snap + ".tmp", snap)
    tidal.log(step=step, loss=1.0 / step, world=t.item())
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_script_that_logs_its_steps_gets_them_and_the_schedule(
    tidal_home: Home, tmp_path: Path
) -> None:
    """``tidal.log(step=N, ...)`` from a --torchrun script: the job's step, its metrics,
    and a ``--schedule`` that restarts the world at its step."""
    script = tmp_path / "logs.py"
    script.write_text(LOGS_STEPS)
    proc, job = tidal_home.run(
        "logs", "--torchrun", "--workers", "2", "--schedule", "20:1",
        script=script, script_args=[str(tmp_path / "snap.txt")], timeout=60,
    )  # fmt: skip
    status = job.status()
    assert proc.returncode == 0, f"{proc.stderr}\n{summarize(status)}\n{job.logs_tail()}"
    assert status["state"] == "succeeded" and status["step"] == 60, summarize(status)
    assert [g["world_size"] for g in status["generations"]] == [2, 1], summarize(status)
    assert status["metrics"]["loss"] == pytest.approx(1 / 60) and status["metrics"]["world"] == 1
    assert any("--schedule at step 20" in e["message"] for e in status["events"])
    # The last member's exit froze what its script made (the launcher's gc.freeze): the
    # interpreter's last collection does not walk it (docs/decisions/hf-lightning.md). The
    # first world's members ended by the SIGTERM's default action: no exit handlers.
    counts = [f.read_text().split() for f in tmp_path.glob("snap.txt.frozen-*")]
    assert len(counts) == 1 and int(counts[0][1]) > int(counts[0][0]), counts
    tidal_home.assert_no_processes()
