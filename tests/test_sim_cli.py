"""``tidal simulate`` end to end, as a user runs it (a subprocess per call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPOT = str(ROOT / "examples" / "traces" / "spot.csv")
COMPARED = ("static-min", "static-max", "throughput", "cost", "oracle")


def tidal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tidal.cli", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def compare_json() -> list[dict]:
    out = tidal("--compare", "--json", "--trace", SPOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_compare_json_shape(compare_json):
    assert [r["policy"] for r in compare_json] == [
        "static-min",
        "static-max",
        "throughput",
        "cost",
        "oracle",
    ]
    for r in compare_json:
        assert {"policy", "completion_s", "cost", "cost_per_sample", "worker_hours"} <= set(r)
        assert r["completed"] and r["completion_s"] > 0 and r["cost"] > 0
        assert r["cost_per_sample"] == pytest.approx(r["cost"] / r["samples"])


def test_acceptance_cost_policy_is_25_percent_cheaper_and_at_most_10_percent_slower(
    compare_json,
):
    by = {r["policy"]: r for r in compare_json}
    fast, cheap = by["static-max"], by["cost"]
    assert cheap["deadline_s"] == pytest.approx(1.1 * fast["completion_s"])
    assert cheap["cost_per_sample"] <= 0.75 * fast["cost_per_sample"]
    assert cheap["completion_s"] <= 1.1 * fast["completion_s"]
    assert by["static-min"]["completion_s"] > fast["completion_s"]


def test_compare_json_rows_carry_vs_oracle(compare_json):
    by = {r["policy"]: r for r in compare_json}
    ref = by["oracle"]
    assert ref["vs_oracle"] == 1.0 and ref["oracle"]["method"] in ("exact", "lagrangian")
    assert ref["deadline_s"] == by["cost"]["deadline_s"]
    assert ref["oracle"]["lower_bound"] <= ref["cost"] * (1 + 1e-9)
    for r in compare_json:
        assert r["vs_oracle"] == pytest.approx(r["cost_per_sample"] / ref["cost_per_sample"])
    # The acceptance on this trace: within 10% of the oracle, never above static-max.
    assert by["cost"]["vs_oracle"] <= 1.10
    assert by["cost"]["cost_per_sample"] <= by["static-max"]["cost_per_sample"]


def test_compare_table_is_readable_at_80_columns():
    out = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "simulate", "--compare", "--trace", SPOT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in out.stdout
    names = [line.split()[0] for line in lines if line.split()[:1] and line.split()[0] in COMPARED]
    assert names == list(COMPARED)  # every name whole, in order
    assert SPOT in out.stdout.replace("\n", "")  # the trace path, not cut
    for word in ("vs or", "deadline", "lower bound", "Δ$/s"):
        assert word in out.stdout


def test_oracle_alone_needs_a_deadline_and_meets_it():
    line = one_error_line(tidal("--policy", "oracle", "--trace", SPOT))
    assert "the oracle needs a deadline" in line
    out = tidal("--policy", "oracle", "--trace", SPOT, "--deadline", "3h", "--json")
    assert out.returncode == 0, out.stderr
    (r,) = json.loads(out.stdout)
    assert r["policy"] == "oracle" and r["completion_s"] <= 3 * 3600 and r["vs_oracle"] == 1.0


def test_one_policy_with_a_deadline_and_explicit_job_flags():
    out = tidal(
        "--policy", "cost", "--deadline", "3h", "--trace", SPOT, "--json",
        "--steps", "50000", "--bandwidth-gbit", "100", "--workers-max", "64",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (r,) = json.loads(out.stdout)
    assert r["policy"] == "cost" and r["deadline_s"] == 3 * 3600
    assert r["completion_s"] <= 3 * 3600 and r["peak_workers"] <= 64
    assert r["samples"] == 50000 * 1024 and r["job"] == "resnet50-v100 (modified)"


def test_list_jobs():
    out = tidal("--list-jobs")
    assert out.returncode == 0 and "resnet50-v100:" in out.stdout and "25 Gbit/s" in out.stdout


def one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("tidal: error: ")
    return lines[0]


def test_malformed_trace_is_one_error_line_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("time_s,capacity,price_per_worker_hour\n0,4,1.0\n60,four,1.0\n")
    line = one_error_line(tidal("--policy", "cost", "--trace", str(bad)))
    assert f"{bad}:3: capacity must be a whole number" in line


def test_unknown_policy_is_one_error_line_listing_the_known_ones():
    line = one_error_line(tidal("--policy", "cheapest", "--trace", SPOT))
    assert "unknown policy 'cheapest'" in line and "cost, oracle, static, static-max" in line


@pytest.mark.parametrize(
    "args, words",
    [
        (["--compare", "--trace", "missing.csv"], "trace file not found: missing.csv"),
        (["--compare", "--trace", SPOT, "--deadline", "soon"], "bad duration 'soon'"),
        (["--compare", "--trace", SPOT, "--job", "gpt"], "unknown job 'gpt'"),
        (["--compare"], "needs --trace FILE"),
        (["--trace", SPOT], "needs --policy NAME or --compare"),
        (["--compare", "--trace", SPOT, "--min-efficiency", "2"], "min_efficiency"),
    ],
)
def test_other_bad_input_is_one_error_line(args, words):
    assert words in one_error_line(tidal(*args))


def test_status_is_readable_at_80_columns(monkeypatch, capsys):
    """tidal status at 80 columns: the script path and the URLs whole (folded when longer
    than a line, never cut with an ellipsis)."""
    import time

    from tidal.display import print_status
    from tidal.protocol import GenerationView, JobState, JobStatus, WorkerState, WorkerView

    monkeypatch.setenv("COLUMNS", "80")
    script = "/home/alice/projects/a-rather-long-project-name/examples/train_gpt_tokens.py"
    long_path = "/srv/" + "very-long-directory-name/" * 4 + "train.py"  # over 80 characters
    for path in (script, long_path):
        s = JobStatus(
            name="gpt-small-7f3a9c21",
            state=JobState.RUNNING,
            step=12345,
            world_size=3,
            target_workers=4,
            min_workers=1,
            max_workers=8,
            script=path,
            created=time.time(),
            url="http://127.0.0.1:48213/api/jobs/gpt-small-7f3a9c21",
            workers=[WorkerView(id=0, rank=0, pid=4000, state=WorkerState.RUNNING)],
            generations=[
                GenerationView(
                    id=1,
                    world_size=3,
                    members=[0, 1, 2],
                    start_step=100,
                    reason="policy cost: shrink 4 -> 3: deadline in 2.4 h (reserve 85.8 s)",
                    pause_s=0.09,
                    opened_at=time.time(),
                )
            ],
            dashboard_url="http://127.0.0.1:48213/dashboard/gpt-small-7f3a9c21",
            metrics_url="http://127.0.0.1:48213/metrics",
        )
        print_status(s)
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert max(len(line) for line in lines) <= 80 and "…" not in out
        flat = "".join(line.strip() for line in lines)
        for value in (path, s.url, s.dashboard_url, s.metrics_url):
            assert value in flat
