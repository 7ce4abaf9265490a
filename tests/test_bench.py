"""Smoke test of the bench suite: one tiny case runs end to end and writes its rows.

No timing assertions: the numbers depend on the machine and its load. The case is the
state transfer at 2 MB (two gloo processes, Tidal's heal against a raw broadcast and a
socket), which exercises the suite's process handling, its table and its JSON.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_tiny(measurement: str, out: Path, *, timeout: float) -> subprocess.CompletedProcess:
    """``python -m bench --tiny --only MEASUREMENT --json OUT`` from the checkout."""
    cmd = [sys.executable, "-m", "bench", "--tiny", "--only", measurement, "--json", str(out)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bench_tiny_state_transfer(tmp_path: Path, cross_memory: bool) -> None:
    out = tmp_path / "out.json"
    proc = run_tiny("state_transfer", out, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    # Against the wire (loopback), and against one copy between the processes (this
    # machine allows ``process_vm_readv``: the heal's own path here).
    copy = ["state_transfer_copy"] if cross_memory else []
    assert [r["name"] for r in rows] == ["state_transfer", *copy]
    for r in rows:
        assert set(r) == {"name", "tidal", "peer", "ratio", "unit", "peer_name", "peer_config"}
        assert r["unit"] == "s" and r["peer_name"] == "floor" and r["peer_config"]
        for key in ("tidal", "peer", "ratio"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, r
    assert all(r["tidal"] == rows[0]["tidal"] for r in rows)  # the same heals, two floors
    assert "state_transfer" in proc.stdout  # the table


@pytest.mark.bench
@pytest.mark.timeout(200)
def test_bench_tiny_checkpoint_cpu(tmp_path: Path) -> None:
    """The row's shape and sanity: positive, finite CPU costs. No speed is asserted."""
    out = tmp_path / "out.json"
    proc = run_tiny("checkpoint_cpu", out, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (r,) = json.loads(out.read_text())
    assert r["name"] == "checkpoint_cpu" and r["unit"] == "CPU-s/GB"
    for key in ("tidal", "peer", "ratio"):
        assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, r
    assert "checkpoint_cpu" in proc.stdout


def test_bench_tiny_store_auth(tmp_path: Path) -> None:
    """The re-form row's shape; the steady state seals and checks nothing (no speed is
    asserted): every re-form authenticated values, no step did."""
    out = tmp_path / "out.json"
    proc = run_tiny("store_auth", out, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (r,) = json.loads(out.read_text())
    assert r["name"] == "store_auth_reform" and r["unit"] == "s"
    assert r["peer_name"] == "unauthenticated store" and "re-form" in r["peer_config"]
    for key in ("tidal", "peer", "ratio"):
        assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, r
    assert re.search(r"\b(\d+) values per re-form and member, 0 per step", proc.stderr)
    assert int(re.search(r"(\d+) values per re-form", proc.stderr).group(1)) > 0


def test_bench_cli_rejects_unknown_measurement() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown measurement" in proc.stderr


@pytest.mark.bench
@pytest.mark.timeout(300)
def test_bench_tiny_dataloader(tmp_path: Path) -> None:
    """The input-pipeline rows: Tidal and torchrun with 1 and 0 DataLoader workers (four
    jobs of three to five processes each, ~70 s on 2 cores: ``pytest -m bench`` runs it; CI
    does not)."""
    out = tmp_path / "out.json"
    proc = run_tiny("dataloader", out, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    names = ["dataloader_workers", "dataloader_workers_0", "dataloader_speedup"]
    assert [r["name"] for r in rows] == names
    assert [r["unit"] for r in rows] == ["samples/s", "samples/s", "x"]
    for r in rows:
        for key in ("tidal", "peer", "ratio"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, r
    assert "dataloader_workers" in proc.stdout and "ratio >= 0.95" in proc.stdout


@pytest.mark.bench
@pytest.mark.timeout(420)
def test_bench_tiny_control_plane(tmp_path: Path) -> None:
    """The control-plane rows: one real coordinator, 256 then 1,024 simulated workers
    heartbeating over its HTTP API (~1 min on 2 cores: ``pytest -m bench`` runs it; CI does
    not). Shape and sanity only: no latency is asserted."""
    out = tmp_path / "out.json"
    proc = run_tiny("control_plane", out, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    sizes = (256, 1024)
    assert [r["name"] for r in rows] == [
        name for n in sizes for name in (f"control_plane_{n}", f"control_plane_{n}_cpu")
    ]
    assert [r["unit"] for r in rows] == ["ms p99", "cores"] * len(sizes)
    for r in rows:
        if r["name"].endswith("_cpu"):  # a budget, no peer (docs/decisions/bench-peers.md)
            assert r["peer_name"] == "none" and r["peer"] is None and r["tidal"] > 0, r
            continue
        assert r["peer_name"] == "floor", r
        for key in ("tidal", "peer", "ratio"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, r
    details = json.loads(out.with_suffix(".details.json").read_text())["control_plane"]
    for n in sizes:
        d = details[str(n)]
        assert d["workers"] == n and d["heartbeats"] > 0, d
        assert d["job_state"] == "running" and d["errors"] == {}, d
        lat = d["latency_s"]
        assert 0 < lat["p50"] <= lat["p99"] <= lat["max"], lat
        assert d["floor_latency_s"]["n"] > 0 and d["probe_s"]["n"] > 0, d
        assert 0 < d["coordinator_cpu"] < 2.5 and 0 < d["generator_cpu"] < 2.5, d
    assert "control_plane_1024" in proc.stdout and "p99 < 50 ms" in proc.stdout


@pytest.mark.bench
@pytest.mark.timeout(420)
def test_bench_tiny_capacity(tmp_path: Path) -> None:
    """Time to capacity (issue 17): a cold join, a join from a warm spare, torchrun's join
    (~130 s on 2 cores: ``pytest -m bench``; CI does not). The spare is admitted at the next
    control-loop pass, so it must beat the cold join, whatever the machine's load."""
    out = tmp_path / "out.json"
    proc = run_tiny("capacity", out, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["cold_start", "time_to_capacity_cold", "time_to_capacity_spare"]
    for r in rows.values():
        assert r["unit"] == "s" and all(r[k] > 0 for k in ("tidal", "peer", "ratio")), r
    assert rows["time_to_capacity_spare"]["tidal"] < rows["time_to_capacity_cold"]["tidal"]


@pytest.mark.bench
@pytest.mark.timeout(240)
def test_bench_tiny_fsdp_reshard(tmp_path: Path) -> None:
    """The sharded rows (issue 16): one ``sharding="fsdp"`` job that resizes 2 -> 3 -> 2 and
    loses a member, and torchrun restarted once through a DCP checkpoint (~40 s on 2 cores:
    ``pytest -m bench``; CI does not). No speed is asserted; what is asserted holds on any
    machine: float32 trained without a failure until the kill, the shards really are smaller
    at more members, a lone member keeps no copy (its memory is a DDP member's), every copy
    at 2 members was snapshot and exchanged, and the failure redid no more than the
    neighbour-copy interval."""
    out = tmp_path / "out.json"
    proc = run_tiny("fsdp_reshard", out, timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert list(rows) == [
        "fsdp_reshard",
        "fsdp_memory_ws1",
        "fsdp_memory_ws2",
        "fsdp_memory_ws3",
        "fsdp_redone_steps",
        "fsdp_copy_stall_s",
        "fsdp_copy_cost_s",
        "fsdp_step_ws2_s",
    ]
    assert [r["unit"] for r in rows.values()] == ["s", "MB", "MB", "MB", "steps", "s", "s", "s"]
    for name, r in rows.items():
        if name == "fsdp_copy_cost_s":  # a difference of step times: noise can make it <= 0
            assert math.isfinite(r["tidal"]) and r["peer"] > 0, r
            continue
        if name == "fsdp_redone_steps":  # a bound, not a peer
            assert r["peer_name"] == "none" and r["peer"] is None, r
            continue
        for key in ("tidal", "peer", "ratio"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, r
    details = json.loads(out.with_suffix(".details.json").read_text())["fsdp_reshard"]
    memory = details["memory"]
    shards = [memory[str(n)]["shard"] for n in (1, 2, 3)]
    assert shards[0] > shards[1] > shards[2], shards
    assert memory["1"]["copies"] == 0, memory["1"]  # alone: no copy kept
    ws1 = rows["fsdp_memory_ws1"]
    assert abs(ws1["tidal"] - ws1["peer"]) < 0.01 * ws1["peer"], ws1  # a DDP member's bytes
    tidal = details["tidal"]
    assert rows["fsdp_redone_steps"]["tidal"] <= tidal["copy_every"]  # the bound
    assert [k["recovery"] for k in tidal["kills"]] == ["neighbour_copy"]
    assert set(tidal["recovery"]) == {"reshard"}
    copies = tidal["copies"]["2"]
    assert copies["snapshots"] > 0 and copies["exchanges"] > 0, copies
    assert tidal["copies"]["1"]["snapshots"] == 0, tidal["copies"]["1"]
    assert tidal["copy_errors"] == []
    assert {"copy_snapshot_s", "copy_exchange_s"} <= set(tidal["final_metrics"])


def test_the_load_generator_reads_a_token_that_begins_with_a_dash(tmp_path: Path) -> None:
    """``secrets.token_urlsafe`` may begin with ``-``; passed before the options, argparse
    took it for one and the generator exited 2 (run Z2, 2026-12-04)."""
    from bench.control_plane import load_args
    from bench.control_plane_load import parse_args

    out = tmp_path / "load.json"
    args = parse_args(load_args("http://h:1", "-x_Y", 256, 42, out, 5.0, 1.0, "1"))
    assert (args.url, args.token, args.n, args.host_pid, args.out) == (
        "http://h:1",
        "-x_Y",
        256,
        42,
        str(out),
    )
    assert (args.window_s, args.warmup_s, args.cpus) == (5.0, 1.0, "1")


def _records(starts: dict[int, list[float]], world: int) -> list:
    """Step records of members (pid -> each step's start, ms): every step ends 5 ms after it
    starts, at ``world`` members."""
    from bench.common import Rec

    recs = []
    for pid, ts in starts.items():
        for i, t in enumerate(ts):
            recs.append(Rec("B", t / 1000, i, world, 0, pid))
            recs.append(Rec("E", (t + 5) / 1000, i, world, 0, pid))
    return recs


@pytest.mark.parametrize(
    "starts, pids, floor_ms",
    [
        # in step: the largest member's interval is the median step, nothing more
        ({1: [0, 10, 20, 30, 40], 2: [0, 10, 20, 30, 40]}, None, 0.0),
        # member 2 commits 2 ms late every other step: its intervals 12, 8, 12, 8; the
        # largest of the two members' is 12, 10, 12, 10 (median 11), one step 10
        ({1: [0, 10, 20, 30, 40], 2: [0, 12, 20, 32, 40]}, None, 1.0),
        # ... unless only member 1 is asked about
        ({1: [0, 10, 20, 30, 40], 2: [0, 12, 20, 32, 40]}, {1}, None),
        ({1: [0, 10, 20, 30, 40], 2: [0, 12, 20, 32, 40], 3: [0, 10, 20, 30, 40]}, {1, 3}, 0.0),
    ],
)
def test_the_pause_statistic_at_ordinary_steps(starts, pids, floor_ms) -> None:
    from bench.rescale import max_gap_floor

    got = max_gap_floor(_records(starts, 2), 2, pids)
    assert got == (None if floor_ms is None else pytest.approx(floor_ms / 1000))


def test_cpu_split_charges_each_thread_to_its_part() -> None:
    """Two workers (pids 10, 11): their main threads train, their other threads are the
    workers' own; every other process is beside them; a thread first seen in the second
    reading counts from zero. Over 2 s, 1 CPU-s is 50% of a core."""
    from bench.cpu_split import split

    before = {(10, 10): 5.0, (10, 12): 1.0, (11, 11): 4.0, (5, 5): 2.0, (5, 6): 0.5}
    after = {(10, 10): 6.0, (10, 12): 1.2, (11, 11): 5.5, (5, 5): 2.1, (5, 6): 0.5, (11, 13): 0.3}
    assert split(before, after, {10, 11}, 2.0) == {
        "training": 125.0,  # (1.0 + 1.5) / 2
        "worker_other": 25.0,  # (0.2 + 0.3) / 2
        "beside": 5.0,
    }


def test_cpu_split_phases_are_medians_over_every_worker(tmp_path: Path) -> None:
    """Each worker's ``B``/``E`` records: to_sync is E - B of a step, after_sync is the
    next step's B - this step's E; steps outside the range do not count."""
    from bench.cpu_split import phases

    for pid, offset in ((100, 0.0), (101, 0.001)):
        lines = []
        for i in range(6):
            start = 1000.0 + 0.010 * i + offset
            sync = start + (0.006 if i in (2, 3) else 0.5)  # the others are outside 2..3
            lines += [f"B {start:.6f} {i} 2 {pid - 100}", f"E {sync:.6f} {i} 2 {pid - 100}"]
        (tmp_path / f"steps-{pid}.txt").write_text("\n".join(lines) + "\n")
    assert phases(tmp_path, 2, 3) == {"to_sync_ms": 6.0, "after_sync_ms": 4.0}
