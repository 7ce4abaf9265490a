"""The rules behind issue 50 findings 2 and 3, table-tested, and the checkpoint fence on real
files with the real asynchronous writer."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tidal.checkpoint import fence, store
from tidal.checkpoint.writer import AsyncCheckpointer
from tidal.coordinator.process.fencing import OldWorker, end_previous_run, settled_rows, to_end
from tidal.coordinator.process.supervisor import unsupervised
from tidal.terminal import Terminal, output_lost


# -- checkpoint.fence.refusal ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("held", "on_disk", "refused"),
    [
        (None, fence.Fence("a"), None),  # a script run alone: not fenced
        ("a", None, None),  # a folder of a job from before fences
        ("a", fence.Fence("a"), None),  # this run owns the folder
        ("a", fence.Fence("b"), "a newer run of the job (`tidal resume`) owns its checkpoints"),
        ("a", fence.Fence("a", sealed="job j succeeded at step 9"), "final (job j succeeded"),
        ("a", fence.Fence("b", sealed="job j failed at step 3"), "final (job j failed"),
    ],
)
def test_fence_refusal(held, on_disk, refused) -> None:
    why = fence.refusal(held, on_disk)
    assert (why is None) == (refused is None), why
    if refused:
        assert refused in why


def _writer(folder: Path, epoch: str | None, failures: list, written: list) -> AsyncCheckpointer:
    return AsyncCheckpointer(
        folder,
        keep=1,
        on_written=written.append,
        on_failed=lambda step, error: failures.append((step, error)),
        fence=epoch,
    )


def _save(writer: AsyncCheckpointer, step: int) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    writer.save(step=step, module=model, optimizer=opt, meta={"step": step})
    writer.wait()


def test_a_fenced_writer_neither_publishes_nor_prunes(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    fence.write(folder, fence.Fence("old"))
    failures, written = [], []
    old = _writer(folder, "old", failures, written)
    _save(old, 10)
    assert [w.step for w in written] == [10] and not failures
    before = sorted(p.name for p in folder.iterdir())

    fence.write(folder, fence.Fence("new"))  # `tidal resume`: a new run owns the folder
    new_failures, new_written = [], []
    new = _writer(folder, "new", new_failures, new_written)
    _save(new, 20)
    assert [w.step for w in new_written] == [20] and not new_failures
    assert (folder / "step-00000010").exists()  # pruned as the next write begins, or ...
    new.close()
    assert not (folder / "step-00000010").exists()  # ... at close: the new run's (keep=1)
    _save(old, 30)  # the old run's write: refused, and it prunes nothing of the new run's
    assert failures and failures[0][0] == 30 and "owns its checkpoints" in failures[0][1]
    names = sorted(p.name for p in folder.iterdir())
    assert names == [".fence", "step-00000020"], (before, names)

    fence.write(folder, fence.Fence("new", sealed="job j succeeded at step 20"))
    mtime = (folder / "step-00000020" / "MANIFEST.json").stat().st_mtime_ns
    _save(_writer(folder, "new", new_failures, new_written), 20)  # the same step, again
    assert new_failures and "final (job j succeeded at step 20)" in new_failures[-1][1]
    assert (folder / "step-00000020" / "MANIFEST.json").stat().st_mtime_ns == mtime
    store.verify(folder / "step-00000020")


def test_a_writer_without_a_fence_is_not_fenced(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    fence.write(folder, fence.Fence("x", sealed="ended"))
    failures, written = [], []
    _save(_writer(folder, None, failures, written), 5)  # the script run alone
    assert [w.step for w in written] == [5] and not failures


# -- coordinator.fencing -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("worker", "ended"),
    [
        (OldWorker(0, 123, "running", runs=True), True),
        (OldWorker(1, 124, "failed", runs=True), True),  # the records lag: it runs
        (OldWorker(2, 125, "running", runs=False), False),  # gone, or a recycled pid
        (OldWorker(3, None, "pending", runs=False), False),  # never started
    ],
)
def test_to_end(worker: OldWorker, ended: bool) -> None:
    picked = to_end([worker])
    assert bool(picked) == ended
    if ended:
        assert f"worker {worker.worker_id} (pid {worker.pid})" in picked[0][1]
        assert f"({worker.state} in the records)" in picked[0][1]


def test_settled_rows() -> None:
    rows = [
        (0, 10, "h", "running", 0, 1.0, None, "n"),
        (1, 11, "h", "standby", None, 1.0, None, "n"),
        (2, 12, "h", "exited", None, 1.0, 0, "n"),
        (3, 13, "h", "failed", None, 1.0, -9, "n"),
        (4, 14, "h", "stopping", None, 1.0, 0, "n"),
    ]
    assert settled_rows(rows) == [
        (0, 10, "h", "failed", None, 1.0, -9, "n"),
        (1, 11, "h", "failed", None, 1.0, -9, "n"),
        (4, 14, "h", "failed", None, 1.0, 0, "n"),
    ]


def test_end_previous_run_kills_only_identified_processes(tmp_path: Path) -> None:
    """Real processes: the one identified as worker 0 is SIGKILLed and waited for; the other
    (a process that is not the job's worker 1, e.g. a recycled pid) is left alone."""
    from tidal.protocol import JobStatus

    procs = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)
    ]
    reaper = [threading.Thread(target=p.wait, daemon=True) for p in procs]
    for t in reaper:
        t.start()
    try:
        status = JobStatus(
            name="j",
            state="interrupted",
            step=5,
            world_size=0,
            target_workers=2,
            min_workers=1,
            max_workers=2,
            script="s.py",
            created=1.0,
            workers=[
                {"id": 0, "pid": procs[0].pid, "state": "running", "rank": 0},
                {"id": 1, "pid": procs[1].pid, "state": "running", "rank": 1},
            ],
        )
        lines = end_previous_run(
            status,
            log_dir=tmp_path,
            backend="local",
            runs_as_worker=lambda _d, wid, _pid, _url: wid == 0,
        )
        assert len(lines) == 1 and f"worker 0 (pid {procs[0].pid})" in lines[0], lines
        reaper[0].join(5)
        assert procs[0].returncode == -9
        assert procs[1].poll() is None
        assert end_previous_run(status, log_dir=tmp_path, backend="ray") == []
    finally:
        for p in procs:
            p.kill()
            p.wait()


# -- host.output and the supervisor's watch ----------------------------------------------
@pytest.mark.parametrize(
    ("cause", "already", "switch", "says"),
    [
        ("SIGHUP", None, True, "the terminal of `tidal run` hung up (SIGHUP): the job trains on"),
        ("EPIPE", None, True, "the output of `tidal run` was closed (EPIPE): the job trains on"),
        ("EIO", None, True, "was closed (EIO)"),
        ("EPIPE", "SIGHUP", False, None),
        ("SIGHUP", "EPIPE", False, None),
    ],
)
def test_output_lost(cause, already, switch, says) -> None:
    v = output_lost(cause, already=already, job="j", log=Path("/h/jobs/j/coordinator.log"))
    assert v.switch is switch
    if says is None:
        assert v.event is None
    else:
        assert says in v.event and "/h/jobs/j/coordinator.log" in v.event
        assert "`tidal stop j`" in v.event


def test_terminal_switches_to_the_log_when_its_pipe_closes(tmp_path: Path) -> None:
    """In a child process (it rewires descriptors 1 and 2): a line said after the reader of
    stderr went away lands in the log, and the switch is told once."""
    log = tmp_path / "coordinator.log"
    code = (
        "import sys; from pathlib import Path; from tidal.terminal import Terminal\n"
        f"t = Terminal(Path({str(log)!r}), 'j')\n"
        "sys.stdin.read()\n"  # the parent closes our stderr's reader, then our stdin
        "t.say('tidal: job j stopped at step 7')\n"
        "assert t.lost == 'EPIPE', t.lost\n"
        "assert t.lose('SIGHUP') is None\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    proc.stderr.close()  # the reader goes
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    assert log.read_text() == "tidal: job j stopped at step 7\n"
    assert Terminal(log, "j").lost is None


@pytest.mark.parametrize(
    ("supervisor", "parent", "says"), [(None, 1, False), (50, 50, False), (50, 1, True)]
)
def test_unsupervised(supervisor, parent, says) -> None:
    line = unsupervised("j", supervisor, parent)
    assert (line is not None) is says
    if says:
        assert "pid 50" in line and "`tidal attach j`" in line and "unsupervised" in line


# -- exit_rules.judge_exit: an adopted worker's end, its status unknown ---------------------------
@pytest.mark.parametrize(
    ("facts", "state", "kind"),
    [
        (dict(status_known=False, job_decided=True), "exited", "worker"),
        (dict(status_known=False, leaving=True), "exited", "worker"),
        (dict(status_known=False, retired=True), "exited", "worker"),
        (dict(status_known=True, job_decided=True), "failed", "failure"),  # a known SIGKILL
        (dict(status_known=False, job_decided=True, kill_reason="did not leave"), "failed", None),
        (dict(status_known=False, was_member=True), "failed", "failure"),  # mid-job: lost
    ],
)
def test_judge_exit_of_a_worker_whose_status_is_unknown(facts, state, kind) -> None:
    from tidal.coordinator.rules.exit_rules import ExitFacts, judge_exit

    v = judge_exit(
        ExitFacts(worker_id=3, returncode=-9, how="lost (its exit status is unknown)", **facts)
    )
    assert v.state.value == state, v
    if kind is not None:
        assert v.kind == kind, v
    if state == "exited":
        assert v.message == "worker 3 exited (its exit status is unknown: it was adopted)"
        assert not v.lost and not v.fail_job and not v.reform
    elif not facts.get("job_decided"):
        assert v.lost, v
