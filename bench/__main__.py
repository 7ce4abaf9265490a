"""Tidal against its peers, side by side in one run.

``python -m bench [--quick|--tiny] [--json FILE] [--only NAMES] [--results DIR]``

Each measurement runs Tidal and its peer (torchrun with its rendezvous tuned, plain DDP,
TorchFT, DCP's ``async_save``, or a floor measured in the same run) back to back and prints
a table of ratios, each row naming its peer, and each peer's configuration once below it;
``--json`` writes a list of ``{name, tidal, peer, ratio, unit, peer_name, peer_config}``
(``bench.rows``). ``ratio`` is above 1 when Tidal is better: Tidal / peer for rates,
peer / Tidal for times and stalls; except ``sim_vs_live*`` (``tidal simulate`` against a
live job on the same trace), whose ratio is simulated / live, its goal 0.9 to 1.1. A full run also writes
``bench/results/<date>-<commit>.json`` and a plot beside it (``bench.results``). How each
peer is tuned: docs/decisions/bench-peers.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import results
from bench.common import log
from bench.rows import failed, public
from bench.runners import (
    run_capacity,
    run_compat_restart,
    run_dataloader,
    run_recovery,
    run_rescale,
    run_state_transfer,
    run_throughput,
)
from bench.runners_state import (
    run_checkpoint_cpu,
    run_checkpoint_stall,
    run_control_plane,
    run_fsdp_reshard,
    run_store_auth,
    run_tracked_copy,
)
from bench.sim_vs_live import run_sim_vs_live, within
from bench.torchft_peer import run_torchft

MEASUREMENTS = (
    "throughput",
    "rescale",
    "recovery",
    "state_transfer",
    "checkpoint_stall",
    "checkpoint_cpu",
    "dataloader",
    "control_plane",
    "capacity",
    "fsdp_reshard",
    "tracked_copy",
    "store_auth",
    "torchft",
    "sim_vs_live",
    "compat_restart",
)

SIZES = {
    # steps per throughput run and repetitions, rescale events and torchrun joins,
    # kills (Tidal, torchrun), state transfer MB and repetitions, steps per input-pipeline
    # run and its repetitions; sharded: planned changes, kills (the step offset of each
    # within the neighbour-copy interval), the DCP peer's restarts, and the steps at 2
    # members between the changes and the kills (copies' cost to the steps)
    # events: 48 planned changes in one job (24 before 2026-12-05: each change's net pause
    # spreads 2 to 40 ms, and the median of 24 moved by 2 ms between runs of the same code;
    # docs/benchmarks.md, "Runs Z7 and Z8").
    "full": dict(
        tput_steps=300, tput_reps=8, events=48, joins=2, kills=10, peer_kills=3, mb=100, reps=5,
        loader_steps=150, loader_reps=3, cp_window_s=20.0, cp_warmup_s=3.0, cap_joins=3,
        ckcpu_reps=7, fsdp_changes=6, fsdp_kills=[3, 8], fsdp_peer_changes=4,
        fsdp_steady=60, tc_steps=600, sa_gens=200, ck_quick=False, ck_steps=None,
        sim_trace_s=120.0, compat_changes=6,
    ),
    "quick": dict(
        tput_steps=120, tput_reps=2, events=6, joins=1, kills=3, peer_kills=1, mb=100, reps=3,
        loader_steps=80, loader_reps=1, cp_window_s=10.0, cp_warmup_s=3.0, cap_joins=2,
        ckcpu_reps=3, fsdp_changes=2, fsdp_kills=[5], fsdp_peer_changes=2,
        fsdp_steady=30, tc_steps=300, sa_gens=80, ck_quick=True, ck_steps=None,
        sim_trace_s=90.0, compat_changes=2,
    ),
    "tiny": dict(
        tput_steps=30, tput_reps=1, events=2, joins=1, kills=1, peer_kills=1, mb=2, reps=1,
        loader_steps=20, loader_reps=1, cp_window_s=3.0, cp_warmup_s=1.0, cap_joins=1,
        ckcpu_reps=1, fsdp_changes=2, fsdp_kills=[5], fsdp_peer_changes=1,
        fsdp_steady=5, tc_steps=30, sa_gens=10, ck_quick=True, ck_steps=8,
        sim_trace_s=60.0, compat_changes=2,
    ),
}  # fmt: skip

GOALS = {
    "throughput_ws1": "ratio >= 0.98",
    "throughput_ws2": "ratio >= 0.98",
    "rescale_pause_p50": "Tidal <= 0.05 s and ratio >= 20",
    "rescale_pause_net_p50": "Tidal <= 0.015 s",
    "rescale_down_net_p50": "Tidal <= 0.015 s",
    "rescale_up_net_p50": "peer: the joiner's state moved at the floor (one copy)",
    "rescale_pause_stat_floor": "peer: what the net pause reads at an ordinary step",
    "recovery_p50": "Tidal <= 0.1 s, <= 1 step lost",
    "state_transfer": "Tidal <= 1.5x raw (ratio >= 0.667)",
    "state_transfer_copy": "peer: one copy between the processes, the host's floor",
    "checkpoint_stall_spare_core_pct": "Tidal <= 3.5 %",
    "checkpoint_stall_floor_pct": "Tidal <= 1.25x floor (ratio >= 0.8)",
    "checkpoint_cpu": "Tidal <= 2x floor (ratio >= 0.5)",
    "dataloader_workers": "ratio >= 0.95",
    "control_plane_1024": "Tidal p99 < 50 ms on one core",
    "time_to_capacity_spare": "Tidal <= 1 s",
    "cold_start": "Tidal <= 4 s and below torchrun",
    "store_auth_reform": "Tidal <= 1.25x unauthenticated (ratio >= 0.8), 0 values per step",
    "sim_vs_live": "simulated / live completion time within 0.9..1.1",
    "sim_vs_live_cost": "simulated / live cost within 0.9..1.1",
}


def met(r: dict, extra: dict) -> bool | None:
    t, ratio = r["tidal"], r["ratio"]
    if t is None or ratio is None:
        return None
    name = r["name"]
    if name in ("throughput_ws1", "throughput_ws2"):
        return ratio >= 0.98
    if name == "rescale_pause_p50":
        return t <= 0.05 and ratio >= 20
    if name in ("rescale_pause_net_p50", "rescale_down_net_p50"):
        return t <= 0.015
    if name == "recovery_p50":
        return t <= 0.1 and max(extra.get("steps_lost", [0]) or [0]) <= 1
    if name == "state_transfer":
        return ratio >= 1 / 1.5
    if name == "checkpoint_stall_spare_core_pct":
        return t <= 3.5
    if name == "checkpoint_stall_floor_pct":
        return ratio >= 0.8
    if name == "checkpoint_cpu":
        return ratio >= 0.5
    if name == "dataloader_workers":
        return ratio >= 0.95
    if name == "control_plane_1024":
        return t < 50
    if name == "time_to_capacity_spare":
        return t <= 1.0
    if name == "cold_start":
        return t <= 4.0 and ratio > 1
    if name == "store_auth_reform":
        # the values per step are in the run's details; a results file alone (bench.page)
        # is judged on the row
        return ratio >= 0.8 and extra.get("values_per_step", 0) == 0
    if name in ("sim_vs_live", "sim_vs_live_cost"):
        return within(ratio)
    return None


RUNNERS = {
    "throughput": (run_throughput, [f"throughput_ws{w}{s}" for w in (1, 2)
                                    for s in ("", "_step_p50")], "samples/s"),
    "rescale": (run_rescale, ["rescale_pause_p50", "rescale_join_p50", "rescale_leave_p50"], "s"),
    "recovery": (run_recovery, ["recovery_p50", "recovery_same_world_p50"], "s"),
    "state_transfer": (run_state_transfer, ["state_transfer"], "s"),
    "checkpoint_stall": (run_checkpoint_stall,
                         ["checkpoint_stall_pct", "checkpoint_stall_floor_pct",
                          "checkpoint_stall_spare_core_pct"], "% of step"),
    "checkpoint_cpu": (run_checkpoint_cpu, ["checkpoint_cpu"], "CPU-s/GB"),
    "dataloader": (
        run_dataloader,
        ["dataloader_workers", "dataloader_workers_0", "dataloader_speedup"],
        "samples/s",
    ),
    "control_plane": (
        run_control_plane,
        [
            "control_plane_256",
            "control_plane_256_cpu",
            "control_plane_1024",
            "control_plane_1024_cpu",
        ],
        "ms p99",
    ),
    "capacity": (
        run_capacity,
        ["cold_start", "time_to_capacity_cold", "time_to_capacity_spare"],
        "s",
    ),
    "fsdp_reshard": (
        run_fsdp_reshard,
        [
            "fsdp_reshard",
            "fsdp_memory_ws1",
            "fsdp_memory_ws2",
            "fsdp_memory_ws3",
            "fsdp_redone_steps",
            "fsdp_copy_stall_s",
            "fsdp_copy_cost_s",
            "fsdp_step_ws2_s",
        ],
        "s",
    ),
    "tracked_copy": (run_tracked_copy, ["tracked_copy_overhead"], "steps/s"),
    "store_auth": (run_store_auth, ["store_auth_reform"], "s"),
    "torchft": (run_torchft, ["torchft_recovery", "torchft_join", "torchft_throughput"], "s"),
    "sim_vs_live": (run_sim_vs_live, ["sim_vs_live", "sim_vs_live_cost"], "s"),
    "compat_restart": (run_compat_restart, ["compat_restart", "compat_restart_join_p50",
                                            "compat_restart_leave_p50"], "s"),
}  # fmt: skip


def fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"


def suite(names: list[str], size: dict) -> tuple[list[dict], dict, list[str]]:
    """Run each measurement; one that fails gives its expected rows without numbers and
    the error as their ``peer_config``, and the suite goes on."""
    rows, details, errors = [], {}, []
    with tempfile.TemporaryDirectory(prefix="tidal-bench-") as tmp:
        for name in names:
            fn, expected, unit = RUNNERS[name]
            d = Path(tmp) / name
            d.mkdir()
            t0 = time.monotonic()
            log(f"{name} ...")
            try:
                r, det = fn(size, d)
                rows += r
                details[name] = det
            except Exception as exc:  # noqa: BLE001 - one failed measurement does not end the suite
                traceback.print_exc()
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                rows += [failed(n, unit, reason=f"failed: {type(exc).__name__}: {exc}")
                         for n in expected]  # fmt: skip
            log(f"{name} done in {time.monotonic() - t0:.0f} s")
    return rows, details, errors


def short_config(config: str | dict) -> str:
    """One line for a peer's configuration (a dict as ``k=v; ...``)."""
    if isinstance(config, dict):
        return "; ".join(f"{k}={short_config(v) if isinstance(v, dict) else v}"
                         for k, v in config.items())  # fmt: skip
    return str(config)


def print_table(rows: list[dict], details: dict) -> None:
    """The table on stdout, then each distinct peer configuration once, numbered."""
    lost = details.get("recovery", {}).get("steps_lost", [])
    configs: list[str] = []
    print(
        f"{'measurement':<26} {'tidal':>10} {'peer':>10} {'unit':<10} {'ratio':>8}  "
        f"{'peer_name':<22} goal"
    )
    for r in rows:
        goal = GOALS.get(r["name"], "")
        steady = details.get("store_auth", {}).get("values_per_step")
        ok = met(r, {"steps_lost": lost, "values_per_step": steady}) if goal else None
        mark = "" if ok is None else (" met" if ok else " NOT met")
        cfg = short_config(r.get("peer_config", ""))
        if cfg not in configs:
            configs.append(cfg)
        peer = f"{r.get('peer_name', '-')} [{configs.index(cfg) + 1}]"
        print(
            f"{r['name']:<26} {fmt(r['tidal']):>10} {fmt(r['peer']):>10} {r['unit']:<10} "
            f"{fmt(r['ratio']):>8}  {peer:<22} {goal}{mark}"
        )
    if lost:
        print(f"recovery: steps lost per kill {lost} (the interrupted step, redone)")
    print("peer configurations:")
    for i, cfg in enumerate(configs, 1):
        print(f"  [{i}] {cfg}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events and steps (< 10 min)")
    parser.add_argument("--tiny", action="store_true", help="smallest sizes (the smoke test)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(MEASUREMENTS)}")
    parser.add_argument("--results", type=Path, help="write the results file (and its plot) "
                        "into this folder; a full run writes it to bench/results by default")  # fmt: skip
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(MEASUREMENTS)
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        parser.error(f"unknown measurement(s) {unknown}; known: {MEASUREMENTS}")
    kind = "tiny" if args.tiny else "quick" if args.quick else "full"
    size = SIZES[kind]
    t0 = time.monotonic()
    rows, details, errors = suite(names, size)
    print()
    print_table(rows, details)
    print(f"\n{kind} run, {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([public(r) for r in rows], indent=2))
        details_path = args.json.with_suffix(".details.json")
        details_path.write_text(json.dumps(details, indent=2, default=str))
    folder = args.results or (results.RESULTS_DIR if kind == "full" else None)
    if folder is not None:
        path = results.write(folder, rows, run=kind, measurements=names, errors=errors)
        log(f"results: {path}")
    for e in errors:
        print(f"FAILED {e}", file=sys.stderr)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
