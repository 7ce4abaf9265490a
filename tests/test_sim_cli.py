"""``tidal simulate`` end to end, as a user runs it (a subprocess per call)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPOT = str(ROOT / "examples" / "traces" / "spot.csv")


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


def test_compare_prints_a_table():
    out = tidal("--compare", "--trace", SPOT)
    assert out.returncode == 0, out.stderr
    for word in ("static-min", "static-max", "throughput", "cost", "worker-h", "deadline"):
        assert word in out.stdout


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
    assert "unknown policy 'cheapest'" in line and "cost, static, static-max" in line


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
