"""``tidal logs JOB [--worker ID] [--follow]`` over a home laid out as a job leaves it
(``HOME/jobs/NAME/logs/worker-ID.log``); ``--follow`` against a live stand-in coordinator."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tidal.cli import main
from tidal.coordinator.records.home import job_dir

ROOT = Path(__file__).resolve().parents[1]


def make_job(home: Path, name: str, logs: dict[int, str]) -> Path:
    jd = job_dir(home, name)
    jd.logs.mkdir(parents=True)
    for wid, text in logs.items():
        jd.worker_log(wid).write_text(text)
    return jd.path


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_all_workers_prefixed_in_id_order(tmp_path, capsys) -> None:
    make_job(tmp_path, "j", {10: "ten a\nten b\n", 2: "two a\ntwo b (no newline)"})
    rc, out, err = run_cli(capsys, "logs", "j", "--home", str(tmp_path))
    assert rc == 0, err
    assert out.splitlines() == [
        "worker 2 | two a",
        "worker 2 | two b (no newline)",
        "worker 10 | ten a",
        "worker 10 | ten b",
    ]


def test_one_worker_verbatim(tmp_path, capsys) -> None:
    make_job(tmp_path, "j", {0: "zero\n", 1: "step 1: loss 2.3\ndone\n"})
    rc, out, _ = run_cli(capsys, "logs", "j", "--worker", "1", "--home", str(tmp_path))
    assert rc == 0
    assert out == "step 1: loss 2.3\ndone\n"


def test_unknown_worker_and_unknown_job_are_one_line_errors(tmp_path, capsys) -> None:
    make_job(tmp_path, "j", {0: "zero\n"})
    rc, out, err = run_cli(capsys, "logs", "j", "--worker", "5", "--home", str(tmp_path))
    assert rc == 1 and out == ""
    assert err.strip() == f"tidal: error: no log of worker 5 in {tmp_path}/jobs/j/logs (workers: 0)"
    rc, out, err = run_cli(capsys, "logs", "nope", "--home", str(tmp_path))
    assert rc == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "nope" in err


def test_follow_of_a_finished_job_prints_everything_and_returns(tmp_path, capsys) -> None:
    make_job(tmp_path, "j", {0: "a\nb\n"})  # no coordinator.json: the job is over
    rc, out, _ = run_cli(capsys, "logs", "j", "--follow", "--home", str(tmp_path))
    assert rc == 0 and out == "worker 0 | a\nworker 0 | b\n"


class LineReader:
    """A process's stdout lines, collected on a thread."""

    def __init__(self, stream) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, want: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while want not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"did not see {want!r} within {timeout} s; saw {self.seen}")
            try:
                self.seen.append(self.lines.get(timeout=left))
            except queue.Empty:
                continue


@pytest.mark.timeout(60)
def test_follow_prints_new_lines_and_new_workers_until_the_coordinator_exits(tmp_path) -> None:
    path = make_job(tmp_path, "j", {0: "old line\n"})
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    follower = None
    try:
        (path / "coordinator.json").write_text(
            json.dumps({"url": "http://127.0.0.1:1", "token": "t", "pid": stand_in.pid})
        )
        follower = subprocess.Popen(
            [sys.executable, "-m", "tidal.cli", "logs", "j", "--follow", "--home", str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out = LineReader(follower.stdout)
        out.wait_for("worker 0 | old line", 30)
        with open(path / "logs" / "worker-0.log", "a") as f:
            f.write("new ")  # a partial line waits for its end
            f.flush()
            time.sleep(0.5)
            f.write("line\n")
        out.wait_for("worker 0 | new line", 10)
        (path / "logs" / "worker-1.log").write_text("joiner\n")
        out.wait_for("worker 1 | joiner", 10)
        stand_in.kill()  # the coordinator exits: so does --follow
        stand_in.wait()
        assert follower.wait(timeout=10) == 0, follower.stderr.read()
        assert "worker 0 | new " not in out.seen  # a partial line is not printed early
    finally:
        for proc in (follower, stand_in):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
