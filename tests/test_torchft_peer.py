"""The TorchFT peer of the bench: its pure parts (the replicas' step logs into recovery and
join times, its configuration in the rows), no processes, no timing assertions; and one
smoke run of ``python -m bench --tiny --only torchft`` marked ``bench`` (not in CI; skipped
without torchft)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peers
from bench.common import Rec
from bench.torchft_measure import (
    commits_since,
    join_time,
    parse_steps,
    ready_time,
    recovery_times,
)
from bench.torchft_peer import ROWS, skipped

ROOT = Path(__file__).resolve().parents[1]


def commits(pid: int, replica: int, *lines: tuple[float, int, int]) -> list[Rec]:
    text = "".join(f"{t:.6f} {s} {n}\n" for t, s, n in lines)
    return parse_steps(f"steps-{replica}-{pid}.txt", text)


def test_a_step_log_is_parsed_into_commits_and_cut_lines_are_skipped() -> None:
    text = "100.5 7 2\n100.6 8 2\n100.7 9\ngarbage a b\n"
    recs = parse_steps("/x/steps-3-4242.txt", text)
    assert recs == [Rec("E", 100.5, 7, 2, 3, 4242), Rec("E", 100.6, 8, 2, 3, 4242)]


def test_recovery_is_last_commit_before_the_kill_to_the_survivors_first_after_it() -> None:
    # step 7's all-reduce ended before the kill: it commits after it at 2, and the
    # recovery ends at the first commit of the quorum without the victim
    survivor = commits(10, 0, (1.0, 5, 2), (1.1, 6, 2), (1.25, 7, 2), (2.5, 8, 1), (2.6, 9, 1))
    victim = commits(11, 1, (1.0, 5, 2), (1.12, 6, 2))
    recs = sorted(survivor + victim, key=lambda r: r.time)
    got = recovery_times(recs, 1.2, 11)
    assert got is not None
    assert got["recovery_s"] == pytest.approx(2.5 - 1.12)
    assert got["kill_to_commit_s"] == pytest.approx(2.5 - 1.2)
    assert got["back_at_2_s"] is None  # no replacement yet
    replacement = commits(12, 2, (4.0, 10, 2))
    recs = sorted(recs + replacement + commits(10, 0, (4.0, 10, 2)), key=lambda r: r.time)
    assert recovery_times(recs, 1.2, 11)["back_at_2_s"] == pytest.approx(4.0 - 1.12)


def test_no_recovery_until_a_survivor_commits() -> None:
    recs = commits(10, 0, (1.0, 5, 2)) + commits(11, 1, (1.0, 5, 2))
    assert recovery_times(recs, 1.2, 11) is None
    # the victim's own late line does not count as the survivor's
    assert recovery_times(recs + commits(11, 1, (1.3, 6, 2)), 1.2, 11) is None
    # nor the survivor's commit of the step in flight at the old size
    assert recovery_times(recs + commits(10, 0, (1.3, 6, 2)), 1.2, 11) is None
    assert recovery_times(commits(10, 0, (2.0, 6, 1)), 1.2, 11) is None  # nothing before


def test_join_is_launch_to_the_first_commit_at_two() -> None:
    recs = commits(10, 0, (1.0, 5, 1), (2.0, 6, 1), (3.0, 7, 2)) + commits(12, 2, (3.0, 7, 2))
    assert join_time(recs, 1.5) == pytest.approx(1.5)
    assert join_time(recs, 3.5) is None
    assert commits_since(recs, 0.0, 2) == 1  # steps, not lines
    assert commits_since(recs, 0.0, 1) == 2


def test_ready_time_reads_the_replicas_file(tmp_path: Path) -> None:
    (tmp_path / "ready-2-77.txt").write_text("12.5\n")
    assert ready_time(tmp_path, 77) == 12.5
    assert ready_time(tmp_path, 78) is None


def test_the_rows_carry_the_whole_configuration() -> None:
    cfg = peers.torchft_config("what")
    assert cfg["lighthouse_conf"] == peers.TORCHFT_LIGHTHOUSE
    assert cfg["manager"] == peers.TORCHFT_MANAGER
    assert {"join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms", "min_replicas"} <= set(
        peers.TORCHFT_LIGHTHOUSE
    )
    assert {"timeout_s", "quorum_timeout_s", "connect_timeout_s", "use_async_quorum"} <= set(
        peers.TORCHFT_MANAGER
    )
    rows = skipped("torchft not usable: x")
    assert [(r["name"], r["unit"]) for r in rows] == list(ROWS)
    assert all(r["peer_name"] == "torchft" and r["tidal"] is None for r in rows)


@pytest.mark.bench
@pytest.mark.timeout(600)
def test_bench_tiny_torchft(tmp_path: Path) -> None:
    """The three rows with numbers on both sides; no speed is asserted."""
    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed")
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "bench", "--tiny", "--only", "torchft", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["name"], r["unit"]) for r in rows] == list(ROWS)
    for r in rows:
        assert r["peer_name"] == "torchft" and r["peer_config"]["lighthouse_conf"]
        for key in ("tidal", "peer", "ratio"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, r
