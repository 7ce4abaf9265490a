"""End-to-end acceptance tests: real coordinators and workers driven through the ``tidal`` CLI.

Each test runs jobs of ``examples/digits.py`` in a temporary ``--home``; the ``tidal_home``
fixture kills whatever a test leaves behind. Jobs manipulated live get a huge ``--max-steps``
and are stopped; jobs that must end by themselves get a small one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
from pathlib import Path

import pytest
from e2e_helpers import (
    DIGITS,
    Home,
    event_messages,
    pid_alive,
    relative_l2,
    running_workers,
    summarize,
    workers_by_id,
)

from tidal.protocol import PAUSE_PHASES

BIG = "100000"  # steps: more than any test lets a live job take
TOLERANCE = 1e-4  # relative L2 distance between elastic and single-worker parameters


def failure_generations(status: dict, worker_id: int | None = None) -> list[dict]:
    """Generations opened because a worker failed (optionally: that worker)."""
    who = "worker " if worker_id is None else f"worker {worker_id} "
    return [g for g in status["generations"] if who in g["reason"] and "failed" in g["reason"]]


def assert_succeeded(proc, job, steps: int) -> dict:
    assert proc.returncode == 0, (
        f"tidal run exited {proc.returncode}\nstderr: {proc.stderr}\n{job.logs_tail()}"
    )
    status = job.status()
    assert status["state"] == "succeeded", summarize(status)
    assert status["step"] == steps, summarize(status)
    return status


# -- a -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_run_trains_to_success(tidal_home: Home) -> None:
    proc, job = tidal_home.run(
        "digits", "--workers", "2", "--max-workers", "3", script_args=["--max-steps", "300"]
    )
    status = assert_succeeded(proc, job, 300)
    assert status["metrics"].get("accuracy", 0.0) >= 0.9, summarize(status)
    assert [g["world_size"] for g in status["generations"]] == [2], summarize(status)
    assert status["max_workers"] == 3
    assert len(status["workers"]) == 2, summarize(status)
    for w in status["workers"]:
        assert (w["state"], w["exit_code"]) == ("exited", 0), summarize(status)
    tidal_home.assert_no_processes()


# -- b -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_scale_up_keeps_the_running_workers(tidal_home: Home) -> None:
    job = tidal_home.start(
        "grow", "--workers", "2", "--max-workers", "3", script_args=["--max-steps", BIG]
    )
    status = job.wait_running(min_step=50, timeout=60)
    before = {w["id"]: w["pid"] for w in running_workers(status)}
    assert len(before) == 2, summarize(status)
    n_gens = len(status["generations"])

    proc = job.scale(3)
    assert proc.returncode == 0, proc.stderr
    assert "target 3" in proc.stdout, proc.stdout

    def grown(s: dict) -> dict | None:
        return next(
            (
                g
                for g in s["generations"][n_gens:]
                if g["world_size"] == 3 and g["pause_s"] is not None
            ),
            None,
        )

    status = job.wait_for(grown, 90, "a generation of 3 workers with a measured pause")
    gen = grown(status)
    workers = workers_by_id(status)
    for wid, pid in before.items():
        assert workers[wid]["pid"] == pid, summarize(status)
        assert workers[wid]["state"] == "running", summarize(status)
        assert pid_alive(pid), f"worker {wid} (pid {pid}) is gone\n{summarize(status)}"
        assert wid in gen["members"], summarize(status)
    assert gen["pause_s"] < 0.5, (
        f"scale-up paused training {gen['pause_s']:.3f} s\n{summarize(status)}"
    )
    assert status["target_workers"] == 3

    assert job.stop().returncode == 0
    status = job.wait_state("stopped", "succeeded", "failed", timeout=60)
    assert status["state"] == "stopped", summarize(status)
    tidal_home.assert_no_processes()


# -- c -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigkill_of_a_worker_is_survived(tidal_home: Home) -> None:
    # 1,000 steps: ~10 s of training left after the kill at step 50+, at any machine speed
    # the kill lands first (the test's time is mostly the steps after it).
    job = tidal_home.start("kill", "--workers", "3", script_args=["--max-steps", "1000"])
    status = job.wait_running(min_step=50, timeout=60)
    n_gens = len(status["generations"])
    victim = next(w for w in running_workers(status) if w["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)

    status = job.wait_state("succeeded", "failed", "stopped", timeout=120)
    status = job.status()
    assert status["state"] == "succeeded", summarize(status)
    assert status["step"] == 1000, summarize(status)
    after = status["generations"][n_gens:]
    assert after, f"no generation after the kill\n{summarize(status)}"
    gen = after[0]
    assert f"worker {victim['id']}" in gen["reason"], summarize(status)
    assert "failed" in gen["reason"] and "SIGKILL" in gen["reason"], summarize(status)
    assert victim["id"] not in gen["members"] and gen["world_size"] == 2, summarize(status)
    assert gen["pause_s"] is not None and gen["pause_s"] < 2, summarize(status)
    dead = workers_by_id(status)[victim["id"]]
    assert (dead["state"], dead["exit_code"]) == ("failed", -signal.SIGKILL), summarize(status)
    tidal_home.assert_no_processes()


# -- d -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_failure_inside_allreduce_applies_no_step_twice(
    tidal_home: Home, tmp_path: Path, reference_params, device: str
) -> None:
    """On every device (``DEVICES``): on a GPU the three workers share it over gloo, their
    gradients and control word CUDA tensors."""
    out = tmp_path / "elastic.safetensors"
    on_gpu = ["--comm", "gloo", "--share-gpus"] if device == "cuda" else []
    proc, job = tidal_home.run(
        "allreduce-kill",
        "--workers",
        "3",
        *on_gpu,
        script_args=["--max-steps", "200", "--seed", "0", "--save", str(out), "--device", device],
        faults="sigkill@worker=1,step=60,phase=allreduce",
    )
    status = assert_succeeded(proc, job, 200)
    failed = failure_generations(status, worker_id=1)
    assert len(failed) == 1, summarize(status)
    gen = failed[0]
    assert "SIGKILL" in gen["reason"] and 1 not in gen["members"], summarize(status)
    # The survivors waited in step 60's all-reduce and did not apply it: the next generation
    # redoes step 60 (at most one step is redone).
    assert gen["start_step"] in (59, 60), summarize(status)
    survivors = [w for w in (0, 2) if "collective failed" in job.worker_log(w)]
    assert survivors, job.logs_tail()
    for w in survivors:
        reported = re.findall(
            r"collective failed in generation \d+ at step (\d+)", job.worker_log(w)
        )
        assert set(reported) == {"60"}, (w, reported, job.logs_tail())
    assert (workers_by_id(status)[1]["exit_code"]) == -signal.SIGKILL, summarize(status)

    rel = relative_l2(out, reference_params(200, 0))
    assert rel <= TOLERANCE, f"parameters differ from the 1-worker run: relative L2 {rel:.3e}"


# -- e -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_failures_in_a_row_without_replacements(
    tidal_home: Home, tmp_path: Path, reference_params
) -> None:
    out = tmp_path / "elastic.safetensors"
    proc, job = tidal_home.run(
        "two-kills",
        "--workers",
        "3",
        "--max-restarts",
        "0",
        script_args=["--max-steps", "200", "--seed", "0", "--save", str(out)],
        faults="sigkill@worker=1,step=50;sigkill@worker=2,step=90",
    )
    status = assert_succeeded(proc, job, 200)
    rel = relative_l2(out, reference_params(200, 0))
    assert rel <= TOLERANCE, f"parameters differ from the 1-worker run: relative L2 {rel:.3e}"

    first, second = failure_generations(status, 1), failure_generations(status, 2)
    assert len(first) == 1 and len(second) == 1, summarize(status)
    assert sorted(first[0]["members"]) == [0, 2], summarize(status)
    assert first[0]["start_step"] == 50 and second[0]["start_step"] == 90, summarize(status)
    assert sorted(workers_by_id(status)) == [0, 1, 2], f"a replacement started\n{summarize(status)}"
    # Exactly one new generation trained in per failure: 3 workers, then 2, then 1 to the end.
    # (A generation that never formed, start_step None, trained nothing and is not counted:
    # one can be opened and abandoned when a failure report beats the exit to the coordinator.)
    formed = [g for g in status["generations"] if g["start_step"] is not None]
    assert len(failure_generations({"generations": formed})) == 2, summarize(status)
    assert [g["world_size"] for g in formed] == [3, 2, 1], summarize(status)
    assert formed[-1]["members"] == [0], summarize(status)


# -- f -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_scheduled_resizes_match_one_worker(
    tidal_home: Home, tmp_path: Path, reference_params
) -> None:
    out = tmp_path / "elastic.safetensors"
    proc, job = tidal_home.run(
        "schedule",
        "--workers",
        "2",
        "--max-workers",
        "3",
        "--schedule",
        "40:3,100:1,160:2",
        script_args=["--max-steps", "200", "--seed", "0", "--save", str(out)],
        timeout=140,
    )
    status = assert_succeeded(proc, job, 200)
    gens = status["generations"]
    assert [g["world_size"] for g in gens] == [2, 3, 1, 2], summarize(status)
    assert [g["start_step"] for g in gens] == [0, 40, 100, 160], summarize(status)
    assert not failure_generations(status), summarize(status)
    # Each resize's pause is broken down into its phases, which add up to it.
    for g in gens[1:]:
        phases = g["pause_phases"]
        assert list(phases) == list(PAUSE_PHASES), summarize(status)
        assert all(v >= 0 for v in phases.values()), phases
        assert sum(phases.values()) == pytest.approx(g["pause_s"], abs=1e-3), (g, phases)
        assert phases["first_step_s"] > 0 and phases["form_s"] > 0, phases

    rel = relative_l2(out, reference_params(200, 0))
    assert rel <= TOLERANCE, f"parameters differ from the 1-worker run: relative L2 {rel:.3e}"


# -- g -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_hung_worker_is_killed_after_the_heartbeat_timeout(tidal_home: Home) -> None:
    proc, job = tidal_home.run(
        "hung",
        "--workers",
        "3",
        "--heartbeat-timeout",
        "2",
        script_args=["--max-steps", "400"],
        faults="sigstop@worker=1,step=80",
    )
    status = assert_succeeded(proc, job, 400)
    missed = [m for m in event_messages(status, "failure") if "missed heartbeats" in m]
    assert missed and all(m.startswith("worker 1 ") for m in missed), summarize(status)
    silence = float(re.search(r"missed heartbeats for ([\d.]+) s", missed[0]).group(1))
    assert 2.0 <= silence < 6.0, missed
    failed = failure_generations(status, worker_id=1)
    assert len(failed) == 1 and "heartbeats" in failed[0]["reason"], summarize(status)
    assert 1 not in failed[0]["members"], summarize(status)
    hung = workers_by_id(status)[1]
    assert (hung["state"], hung["exit_code"]) == ("failed", -signal.SIGKILL), summarize(status)
    assert not pid_alive(hung["pid"]), f"the stopped worker (pid {hung['pid']}) still exists"
    tidal_home.assert_no_processes()


# -- h -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_scale_down_is_a_planned_leave(tidal_home: Home) -> None:
    job = tidal_home.start("shrink", "--workers", "3", script_args=["--max-steps", BIG])
    status = job.wait_running(min_step=20, timeout=60)
    members = status["generations"][-1]["members"]
    assert len(members) == 3, summarize(status)
    n_gens = len(status["generations"])

    proc = job.scale(1)
    assert proc.returncode == 0, proc.stderr

    def settled(s: dict) -> bool:
        gens = s["generations"][n_gens:]
        ws = workers_by_id(s)
        left = [m for m in members if not gens or m not in gens[-1]["members"]]
        return (
            bool(gens)
            and gens[-1]["world_size"] == 1
            and gens[-1]["start_step"] is not None
            and all(ws[m]["state"] in ("exited", "failed") for m in left)
        )

    status = job.wait_for(settled, 60, "a generation of 1 and the leavers' exits")
    gen = status["generations"][-1]
    assert "left" in gen["reason"] and "failed" not in gen["reason"], summarize(status)
    assert not failure_generations(status), summarize(status)
    workers = workers_by_id(status)
    (stay,) = gen["members"]
    for m in members:
        if m == stay:
            assert workers[m]["state"] == "running", summarize(status)
        else:
            assert (workers[m]["state"], workers[m]["exit_code"]) == ("exited", 0), summarize(
                status
            )
    step = status["step"]
    job.wait_for(lambda s: s["step"] > step + 20, 30, "training to go on with 1 worker")

    assert job.stop().returncode == 0
    status = job.wait_state("stopped", "succeeded", "failed", timeout=60)
    assert status["state"] == "stopped", summarize(status)
    tidal_home.assert_no_processes()


# -- i -----------------------------------------------------------------------------------
def assert_one_line_error(proc, *needles: str) -> str:
    assert proc.returncode != 0, f"exit 0: {proc.stdout}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert lines[0].startswith("tidal: error:"), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_input_gets_one_line_and_harms_nothing(tidal_home: Home) -> None:
    job = tidal_home.start(
        "live", "--workers", "1", "--max-workers", "3", script_args=["--max-steps", BIG]
    )
    job.wait_running(min_step=10, timeout=60)

    assert_one_line_error(tidal_home.cli("scale", "nosuchjob", "2"), "nosuchjob")
    assert_one_line_error(tidal_home.cli("scale", "live", "9"), "9")
    assert_one_line_error(tidal_home.cli("run", "missing.py"), "missing.py")
    assert_one_line_error(tidal_home.cli("run", "--workers", "0", str(DIGITS)), "--workers")

    step = job.poll()["step"]
    status = job.wait_for(
        lambda s: s["step"] > step + 20, 30, "training to go on after the rejected scale"
    )
    assert status["state"] == "running" and status["target_workers"] == 1, summarize(status)
    assert len(status["generations"]) == 1, summarize(status)
    rows = json.loads(tidal_home.cli("jobs", "--json").stdout)
    assert [r["name"] for r in rows] == ["live"], rows  # rejected runs leave no record

    assert job.stop().returncode == 0
    assert job.wait_state("stopped", "succeeded", "failed", timeout=60)["state"] == "stopped"


PER_WORKER = """
import os, sys, torch, tidal
from torch.utils.data import TensorDataset
torch.set_num_threads(1)
sharding, differs = sys.argv[1], sys.argv[2]
# The bug: something built from what differs between workers (here the id).
odd = os.environ["TIDAL_WORKER_ID"] != "0"
hidden = 33 if odd and differs == "model" else 32
batch = 32 if odd and differs == "batch" else 16
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Linear(hidden, 2))
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
optim = torch.optim.Adam if odd and differs == "optimizer" else torch.optim.SGD
if differs == "file" and odd:  # started beside worker 0 (a spare for the scale-up): the
    import time                # file it reads must be the edited one, as a late joiner's is
    while "# edited" not in open(__file__).read():
        time.sleep(0.01)
trainer = tidal.Trainer(model, optim(model.parameters(), lr=0.1), data,
                        global_batch_size=batch, sharding=sharding)
if differs == "file" and not odd:  # the file is edited while the job runs
    with open(__file__, "a") as f:
        f.write("# edited\\n")
for step in trainer.run(1000):
    for x, y in step.micro_batches():
        step.backward(torch.nn.functional.cross_entropy(trainer.model(x), y) / batch)
"""

# What the job's one line says: the first member may be either worker.
DIFFERS = {
    "model": r"ModelMismatch: .* at 0\.weight: \[(\d+), 8\] float32 here, \[(\d+), 8\] float32 at",
    "batch": r"ScriptMismatch: .*global_batch_size: (\d+) here, (\d+) in the first worker",
    "optimizer": r"ScriptMismatch: .*optimizer: '(\w+)' here, '(\w+)' in the first worker",
    "file": r"ScriptMismatch: .*script \(sha256 of the file\): '(\w+)' here, '(\w+)' in the first",
}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("sharding", "differs"),
    [("ddp", "model"), ("fsdp", "model"), ("ddp", "batch"), ("ddp", "optimizer"), ("ddp", "file")],
)
def test_a_worker_whose_script_differs_fails_the_job_in_one_line(
    tidal_home: Home, tmp_path: Path, sharding: str, differs: str
) -> None:
    # Before 2026-12-04 both jobs ran to `succeeded`: a joiner with a wider layer healed a
    # shifted copy of the source's parameters, and one with another global batch computed
    # its share of a different batch. Now the heal (model) or the first join (settings)
    # refuses, and the job fails at once saying why. ``file``: worker 0 edits the script
    # after it started; the joiner runs the edited file, and is refused.
    script = tmp_path / "per_worker.py"
    script.write_text(PER_WORKER)
    proc, job = tidal_home.run(
        "differs",
        *("--workers", "1", "--schedule", "20:2"),
        script=script,
        script_args=[sharding, differs],
        timeout=100,
    )
    line = assert_one_line_error(proc, "differs")
    found = re.search(DIFFERS[differs], line)
    expected = {
        "model": {"32", "33"},
        "batch": {"16", "32"},
        "optimizer": {"Adam", "SGD"},
        "file": {_digest(PER_WORKER), _digest(PER_WORKER + "# edited\n")},
    }[differs]
    assert found and {found[1], found[2]} == expected, line
    status = job.status()
    # Nothing trained past the scheduled change: the member was held at step 20. Its last
    # report before the refusal may be the one of step 19 (on a loaded machine the heartbeat
    # that carries step 20 can come after the joiner's refusal ended the job).
    assert status["state"] == "failed" and status["step"] in (19, 20), summarize(status)
    tidal_home.assert_no_processes()


BATCH_NORM = """
import sys, torch, tidal
from torch.utils.data import TensorDataset
torch.set_num_threads(1)
when = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
if when == "loop":
    model[1].eval()  # frozen when the Trainer is made...
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
trainer = tidal.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                        global_batch_size=16, allow_batch_norm=when == "allowed")
for step in trainer.run(100):
    trainer.model.train()  # ...and un-frozen by the loop
    for x, y in step.micro_batches():
        step.backward(torch.nn.functional.cross_entropy(trainer.model(x), y) / 16)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["trainer", "loop", "allowed"])
def test_batch_norm_in_training_mode_fails_the_job_in_one_line(
    tidal_home: Home, tmp_path: Path, when: str
) -> None:
    # Before 2026-12-04 such a job ran to `succeeded`: each member normalised over its own
    # share, so the updates depended on the number of workers (``tidal.worker.trainer.norms``).
    script = tmp_path / "batch_norm.py"
    script.write_text(BATCH_NORM)
    proc, job = tidal_home.run(
        "bn", "--workers", "2", script=script, script_args=[when], timeout=100
    )
    if when == "allowed":  # per-member statistics, accepted: the job runs as it did before
        assert_succeeded(proc, job, 100)
        return
    assert_one_line_error(proc, "BatchNormRefused", "'1' normalises", "allow_batch_norm=True")
    status = job.status()
    assert status["state"] == "failed" and status["step"] == 0, summarize(status)
    tidal_home.assert_no_processes()


# -- k -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_jobs_lists_the_jobs_of_the_home(tidal_home: Home) -> None:
    proc = tidal_home.cli("jobs", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == [], proc.stdout + proc.stderr

    proc, done = tidal_home.run("done-job", "--workers", "1", script_args=["--max-steps", "20"])
    assert_succeeded(proc, done, 20)
    live = tidal_home.start("live-job", "--workers", "1", script_args=["--max-steps", BIG])
    live.wait_running(min_step=0, timeout=60)

    def listed() -> dict[str, dict]:
        proc = tidal_home.cli("jobs", "--json")
        assert proc.returncode == 0, proc.stderr
        return {row["name"]: row for row in json.loads(proc.stdout)}

    rows = listed()
    assert {n: r["state"] for n, r in rows.items()} == {
        "done-job": "succeeded",
        "live-job": "running",
    }, rows
    assert rows["done-job"]["step"] == 20, rows

    assert live.stop().returncode == 0
    live.wait_state("stopped", "succeeded", "failed", timeout=60)
    rows = listed()
    assert {n: r["state"] for n, r in rows.items()} == {
        "done-job": "succeeded",
        "live-job": "stopped",
    }, rows
