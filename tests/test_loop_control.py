"""Loop control from the script, end to end (issue 49's loop control, issue 50's finding 1):
an early stop (``break`` out of ``trainer.run``, ``trainer.stop()``) on every member or on
one ends the whole job at one committed step, its final checkpoint included, and an
evaluation on one member longer than ``--collective-timeout`` fails nobody.

Real ``tidal run`` jobs of two workers (``tests/scripts/loop_control.py``); each worker
writes its committed step when its loop ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e_helpers import Home, event_messages, summarize
from tidal.worker.trainer.step import COMMITTED, LEFT
from tidal.worker.trainer.stopping import commits_on_break

SCRIPT = Path(__file__).parent / "scripts" / "loop_control.py"


def _finals(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("worker-*.json"))}


def _run(home: Home, name: str, out: Path, *script_args: str, opts=(), timeout=150):
    proc, job = home.run(
        name,
        "--workers",
        "2",
        *opts,
        script=SCRIPT,
        script_args=["--out", str(out), *script_args],
        timeout=timeout,
    )
    return proc, job, job.status()


def _assert_stopped_at(proc, job, status, out: Path, step: int, *, checkpoint: bool) -> None:
    """The job succeeded at ``step``: every member ended there, nothing was re-formed or
    replaced, and (``checkpoint``) the final checkpoint is of that step."""
    text = summarize(status) + "\n" + job.logs_tail()
    assert proc.returncode == 0, f"tidal run exited {proc.returncode}\n{proc.stderr}\n{text}"
    assert status["state"] == "succeeded" and status["step"] == step, text
    finals = _finals(out)
    assert len(finals) == 2 and {f["step"] for f in finals.values()} == {step}, (finals, text)
    assert len(status["generations"]) == 1, text  # no re-form, no replacement
    assert [w["id"] for w in status["workers"]] == [0, 1], text
    assert not event_messages(status, "failure"), text
    stops = [m for m in event_messages(status, "stop") if "script stopped the job" in m]
    assert len(stops) == 1 and f"at step {step}" in stops[0], text
    if checkpoint:
        assert status["checkpoints"][-1]["step"] == step, text
        meta = json.loads((Path(status["checkpoints"][-1]["path"]) / "meta.json").read_text())
        assert meta["step"] == step, text


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_every_member_breaking_at_step_50_ends_the_job_with_its_checkpoint(
    tidal_home: Home, tmp_path: Path
) -> None:
    # The break comes after step 50's backward: the step is committed (51 steps done).
    out = tmp_path / "out"
    proc, job, status = _run(
        tidal_home, "break-all", out, "--stop-at", "50", opts=("--checkpoint-every", "10")
    )
    _assert_stopped_at(proc, job, status, out, 51, checkpoint=True)
    tidal_home.assert_no_processes()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_every_member_breaking_without_checkpoints_succeeds(
    tidal_home: Home, tmp_path: Path
) -> None:
    # Before step 50's forward: the step is not committed (50 steps done).
    out = tmp_path / "out"
    proc, job, status = _run(tidal_home, "break-before", out, "--stop-at", "50", "--stop-before")
    _assert_stopped_at(proc, job, status, out, 50, checkpoint=False)
    assert not status["checkpoints"]
    tidal_home.assert_no_processes()


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("how, who", [("stop", "rank1"), ("break", "rank0")])
def test_one_member_ending_the_loop_ends_the_job_on_every_member(
    tidal_home: Home, tmp_path: Path, how: str, who: str
) -> None:
    out = tmp_path / "out"
    proc, job, status = _run(
        tidal_home,
        f"one-{how}",
        out,
        "--stop-at",
        "50",
        "--how",
        how,
        "--who",
        who,
        opts=("--checkpoint-every", "10"),
    )
    _assert_stopped_at(proc, job, status, out, 51, checkpoint=True)
    tidal_home.assert_no_processes()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_raise_after_an_early_stop_still_fails_the_job(tidal_home: Home, tmp_path: Path) -> None:
    # A raise closes the loop's generator exactly as a break does: the process's exit code
    # tells them apart, and a script that raised never reads as a success.
    bad = tmp_path / "bad.py"
    bad.write_text(
        SCRIPT.read_text().replace(
            '            if args.how == "break":\n                break',
            '            if args.how == "break":\n                raise RuntimeError("boom")',
        )
    )
    proc, job = tidal_home.run(
        "raise-bad",
        "--workers",
        "2",
        script=bad,
        script_args=["--out", str(tmp_path / "bad"), "--stop-at", "20", "--who", "rank1"],
        timeout=150,
    )
    status = job.status()
    assert proc.returncode != 0, summarize(status)
    assert status["state"] == "failed", summarize(status)
    assert any("exited with code 1" in m for m in event_messages(status, "job")), summarize(status)
    tidal_home.assert_no_processes()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("eval_s", "timeout_s"),
    [
        (25, 10),  # CI's size: 2.5x the collective timeout
        pytest.param(60, 20, marks=pytest.mark.bench),  # issue 49's size (-m bench)
    ],
)
def test_a_long_evaluation_on_rank_0_fails_nobody(
    tidal_home: Home, tmp_path: Path, eval_s: int, timeout_s: int
) -> None:
    # An evaluation on rank 0 longer than the collective timeout: rank 1 waits in its next
    # all-reduce, its abort watch told by the heartbeats that rank 0 is alive and busy
    # outside the collective.
    out = tmp_path / "out"
    proc, job, status = _run(
        tidal_home,
        "long-eval",
        out,
        "--max-steps",
        "40",
        "--eval-at",
        "20",
        "--eval-s",
        str(eval_s),
        opts=("--collective-timeout", str(timeout_s), "--heartbeat-timeout", "5"),
        timeout=240,
    )
    text = summarize(status) + "\n" + job.logs_tail()
    assert proc.returncode == 0 and status["state"] == "succeeded", text
    assert status["step"] == 40 and status["metrics"].get("evaluated") == 20.0, text
    assert len(status["generations"]) == 1, text
    assert not event_messages(status, "failure"), text
    tidal_home.assert_no_processes()


def _alone(stop_at: int, how: str, before: bool = False):
    """A Trainer run alone (no ``tidal run``), left at ``stop_at`` by ``how``."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import tidal

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = tidal.Trainer(model, opt, data, global_batch_size=8, micro_batch_size=4)
    for step in trainer.run(100):
        if step.index == stop_at and before:
            break
        for x, y in step.micro_batches():
            step.backward(F.cross_entropy(trainer.model(x), y))
        if step.index == stop_at:
            if how == "break":
                break
            trainer.stop()
    return trainer


@pytest.mark.parametrize(
    "how, before, steps",
    [("break", False, 11), ("stop", False, 11), ("break", True, 10)],
)
def test_an_early_stop_alone_commits_as_under_tidal_run(how, before, steps) -> None:
    trainer = _alone(10, how, before)
    assert trainer.step == steps and not trainer.completed


class _S:  # the attributes ``commits_on_break`` reads of a step
    def __init__(self, consumed: bool, failed: Exception | None, outcome: str | None) -> None:
        self.consumed, self.failed, self.outcome = consumed, failed, outcome


@pytest.mark.parametrize(
    "consumed, failed, outcome, commits",
    [
        (True, None, None, True),  # break after the last backward, all-reduce done: committed
        (False, None, None, False),  # break before (or among) the micro-batches
        (True, RuntimeError("peer left"), None, False),  # its all-reduce failed
        (False, RuntimeError("peer left"), None, False),
        # decided in the body (``tidal.prepare``'s optimizer.step()): never committed again
        (True, None, COMMITTED, False),
        (False, None, COMMITTED, False),
        (True, None, LEFT, False),  # left uncommitted by a member that leaves
    ],
)
def test_commits_on_break(consumed, failed, outcome, commits) -> None:
    assert commits_on_break(_S(consumed, failed, outcome)) is commits
