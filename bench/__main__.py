"""Tidal against torchrun, side by side in one run.

``python -m bench [--quick] [--json FILE] [--only NAMES]``

Each measurement runs Tidal and its peer (torchrun on the same script, or the raw
transfer, or a synchronous save) back to back and prints a table of ratios; ``--json``
writes a list of ``{name, tidal, peer, ratio, unit}``. ``ratio`` is above 1 when Tidal is
better: Tidal / peer for throughput, peer / Tidal for times and stalls. See
``docs/benchmarks.md``.
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

from bench.common import log, percentile, row

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
        fsdp_steady=60, tc_steps=600, sa_gens=200,
    ),
    "quick": dict(
        tput_steps=120, tput_reps=2, events=6, joins=1, kills=3, peer_kills=1, mb=100, reps=3,
        loader_steps=80, loader_reps=1, cp_window_s=10.0, cp_warmup_s=3.0, cap_joins=2,
        ckcpu_reps=3, fsdp_changes=2, fsdp_kills=[5], fsdp_peer_changes=2,
        fsdp_steady=30, tc_steps=300, sa_gens=80,
    ),
    "tiny": dict(
        tput_steps=30, tput_reps=1, events=2, joins=1, kills=1, peer_kills=1, mb=2, reps=1,
        loader_steps=20, loader_reps=1, cp_window_s=3.0, cp_warmup_s=1.0, cap_joins=1,
        ckcpu_reps=1, fsdp_changes=2, fsdp_kills=[5], fsdp_peer_changes=1,
        fsdp_steady=5, tc_steps=30, sa_gens=10,
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
    "checkpoint_stall_pct": "Tidal <= 3.5 %",
    "checkpoint_cpu": "Tidal <= 2x floor (ratio >= 0.5)",
    "dataloader_workers": "ratio >= 0.95",
    "control_plane_1024": "Tidal p99 < 50 ms on one core",
    "time_to_capacity_spare": "Tidal <= 1 s",
    "cold_start": "Tidal <= 4 s and below torchrun",
    "store_auth_reform": "Tidal <= 1.25x unauthenticated (ratio >= 0.8), 0 values per step",
}


def met(r: dict, extra: dict) -> bool | None:
    t, ratio = r["tidal"], r["ratio"]
    if t is None or ratio is None:
        return None
    name = r["name"]
    if name.startswith("throughput"):
        return ratio >= 0.98
    if name == "rescale_pause_p50":
        return t <= 0.05 and ratio >= 20
    if name in ("rescale_pause_net_p50", "rescale_down_net_p50"):
        return t <= 0.015
    if name == "recovery_p50":
        return t <= 0.1 and max(extra.get("steps_lost", [0]) or [0]) <= 1
    if name == "state_transfer":
        return ratio >= 1 / 1.5
    if name == "checkpoint_stall_pct":
        return t <= 3.5
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
        return ratio >= 0.8 and extra.get("values_per_step") == 0
    return None


def run_throughput(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import throughput

    rows, details = [], {}
    for world in (1, 2):
        res = throughput.measure(world, size["tput_steps"], tmp / f"ws{world}", size["tput_reps"])
        rows.append(
            row(
                f"throughput_ws{world}",
                res["tidal"],
                res["peer"],
                "samples/s",
                higher_is_better=True,
            )
        )
        details[f"ws{world}"] = res
    return rows, details


def times_rows(prefix: str, tidal: list, peer: list, tidal_net: list, peer_net: list) -> list:
    """p50 and p90 of a stall, and the p50 of its excess over one ordinary step."""

    def r(name: str, a: list, b: list, q: float) -> dict:
        return row(name, percentile(a, q), percentile(b, q), "s", higher_is_better=False)

    return [
        r(f"{prefix}_p50", tidal, peer, 50),
        r(f"{prefix}_p90", tidal, peer, 90),
        r(f"{prefix}_net_p50", tidal_net, peer_net, 50),
    ]


def run_rescale(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import rescale

    (tmp / "tidal").mkdir(parents=True)
    (tmp / "peer").mkdir(parents=True)
    t = rescale.tidal_pauses(size["events"], tmp / "tidal")
    log(f"tidal rescale pauses (s): {[round(p, 3) for p in t['pauses_s']]}, step {t['step_s']}")
    p = rescale.peer_pauses(size["joins"], tmp / "peer")
    log(f"torchrun pauses (s): {[round(x, 3) for x in p['pauses_s']]}, step {p['step_s']}")
    rows = times_rows("rescale_pause", t["pauses_s"], p["pauses_s"], t["excess_s"], p["excess_s"])
    # Each direction apart. A scale-up moves the joiner's state (the bench model's parameters
    # and momentum) before its first step: its floor is that transfer at the fastest of
    # loopback gloo, a socket and one copy between the processes (``state_transfer``'s floor),
    # measured here in the same run (``bench.state_transfer``, the same bytes).
    floor = rescale.up_floor(tmp / "floor", reps=size["reps"])
    log(
        f"scale-up floor: {floor['bytes'] / 1e6:.0f} MB {floor['floor'] * 1000:.1f} ms "
        f"(heal {floor['heal'] * 1000:.1f} ms)"
    )
    peer_down = [x - p["step_s"][1] for x in p["down_s"]]
    # What the net pause reads at a change that cost nothing (``rescale.stat_floor``): each
    # change's kind at its own floor, their median as the net's.
    kinds = [t["stat_floor_s"]["up"]] * len(t["excess_up_s"]) + [t["stat_floor_s"]["down"]] * len(
        t["excess_down_s"]
    )
    rows += [
        row(
            "rescale_pause_stat_floor",
            percentile(t["excess_s"], 50),
            percentile(kinds, 50) if kinds and None not in kinds else float("nan"),
            "s",
            higher_is_better=False,
        ),
        row(
            "rescale_up_net_p50",
            percentile(t["excess_up_s"], 50),
            floor["floor"],
            "s",
            higher_is_better=False,
        ),
        row(
            "rescale_down_net_p50",
            percentile(t["excess_down_s"], 50),
            percentile(peer_down, 50),
            "s",
            higher_is_better=False,
        ),
    ]
    return rows, {"tidal": t, "peer": p, "up_floor": floor}


def run_recovery(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import recovery

    (tmp / "tidal").mkdir(parents=True)
    (tmp / "peer").mkdir(parents=True)
    t = recovery.tidal_recovery(size["kills"], tmp / "tidal")
    log(
        f"tidal recovery (s): {[round(p, 3) for p in t['recovery_s']]}, steps lost {t['steps_lost']}"
    )
    p = recovery.peer_recovery(size["peer_kills"], tmp / "peer")
    log(f"torchrun recovery (s): {[round(x, 3) for x in p['recovery_s']]}, step {p['step_s']:.3f}")
    rows = times_rows("recovery", t["recovery_s"], p["recovery_s"], t["excess_s"], p["excess_s"])
    # against its floor in the same run (``bench.recovery``): what Tidal adds, as a ratio
    floor = row(
        "recovery_floor", percentile(t["recovery_s"], 50), t["floor_s"], "s", higher_is_better=False
    )
    rows.append(floor)
    return rows, {"tidal": t, "peer": p, "steps_lost": t["steps_lost"]}


def run_state_transfer(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import state_transfer

    res = state_transfer.measure(tmp, mb=size["mb"], reps=size["reps"])
    log(
        f"state transfer {res['bytes'] / 1e6:.0f} MB: heal {res['heal']:.3f} s, gloo "
        f"{res['gloo']:.3f} s, socket {res['socket']:.3f} s"
    )
    rows = [row("state_transfer", res["heal"], res["raw"], "s", higher_is_better=False)]
    if res["copy"] is not None:  # against one copy between the processes: the host's floor
        rows.append(
            row("state_transfer_copy", res["heal"], res["copy"], "s", higher_is_better=False)
        )
    return rows, res


def run_checkpoint_stall(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import checkpoint_stall

    quick = size is not SIZES["full"]
    steps = 8 if size is SIZES["tiny"] else None
    res = checkpoint_stall.measure(quick=quick, steps=steps)
    keys = ("name", "tidal", "peer", "ratio", "unit")
    return [{k: res[k] for k in keys}], res


def run_checkpoint_cpu(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import checkpoint_cpu

    res = checkpoint_cpu.measure(quick=size is not SIZES["full"], repeats=size["ckcpu_reps"])
    keys = ("name", "tidal", "peer", "ratio", "unit")
    return [{k: res[k] for k in keys}], res


def run_dataloader(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import dataloader

    res = dataloader.measure(size["loader_steps"], tmp, size["loader_reps"])
    t1, t0, p1, p0 = (res[k] for k in ("tidal_nw1", "tidal_nw0", "torchrun_nw1", "torchrun_nw0"))
    rows = [
        row("dataloader_workers", t1, p1, "samples/s", higher_is_better=True),
        row("dataloader_workers_0", t0, p0, "samples/s", higher_is_better=True),
        # each tool's speed-up from one DataLoader worker per training worker over none
        row("dataloader_speedup", t1 / t0, p1 / p0, "x", higher_is_better=True),
    ]
    return rows, res


def run_control_plane(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import control_plane

    return control_plane.run(
        list(control_plane.SIZES), tmp, window_s=size["cp_window_s"], warmup_s=size["cp_warmup_s"]
    )


def run_capacity(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import capacity, rescale

    res = {}
    for kind, spares in (("cold", 0), ("spare", 1)):
        (tmp / kind).mkdir()
        res[kind] = capacity.tidal_capacity(size["cap_joins"], tmp / kind, spares=spares)
    (tmp / "peer").mkdir()
    res["peer"] = rescale.peer_pauses(size["cap_joins"], tmp / "peer")
    (tmp / "cold_start").mkdir()
    res["cold_start"] = capacity.cold_start(tmp / "cold_start", reps=size["cap_joins"])
    start = res["cold_start"]
    peer = percentile(res["peer"]["join_to_step_s"], 50)
    rows = [
        row(
            "cold_start",
            percentile(start["tidal"], 50),
            percentile(start["torchrun"], 50),
            "s",
            higher_is_better=False,
        )
    ]
    rows += [
        row(
            f"time_to_capacity_{kind}",
            percentile(res[kind]["join_to_step_s"], 50),
            peer,
            "s",
            higher_is_better=False,
        )
        for kind in ("cold", "spare")
    ]
    return rows, res


def run_fsdp_reshard(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import fsdp_reshard as fr
    from bench.train_fsdp import ddp_bytes

    (tmp / "tidal").mkdir()
    (tmp / "peer").mkdir()
    t = fr.tidal_sharded(
        size["fsdp_changes"], size["fsdp_kills"], tmp / "tidal", steady=size["fsdp_steady"]
    )
    log(
        f"tidal reshard pauses (s): up {[round(p, 3) for p in t['up_s']]}, down "
        f"{[round(p, 3) for p in t['down_s']]}; step {t['step_s']}"
    )
    p = fr.peer_dcp(size["fsdp_peer_changes"], tmp / "peer")
    log(
        f"DCP restart pauses (s): up {[round(x, 2) for x in p['up_s']]}, down "
        f"{[round(x, 2) for x in p['down_s']]}; parts p50 "
        + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in p["parts_p50"].items())
    )
    ddp = ddp_bytes()
    full = (ddp["params"] + ddp["optimizer"]) / fr.MB
    rows = [row("fsdp_reshard", percentile(t["pauses_s"], 50), percentile(p["pauses_s"], 50), "s",
                higher_is_better=False)]  # fmt: skip
    memory = {}
    for world in (1, 2, 3):
        m = fr.memory_per_worker(t["memory"], world)
        memory[world] = m
        held = m["total"] / fr.MB if m else float("nan")
        rows.append(row(f"fsdp_memory_ws{world}", held, full, "MB", higher_is_better=False))
    redone = [k["redone_steps"] for k in t["kills"]]
    rows.append(
        row("fsdp_redone_steps", percentile(redone, 50), float(t["copy_every"]), "steps",
            higher_is_better=False)
    )  # fmt: skip
    # what a copy costs the training thread (the snapshot; the exchange runs beside the
    # training) against what a DCP user's training waits for (a dcp.save), at 2 members
    c2, b2 = t["copies"][2], t["boundary"][2]
    save_s = [s for s, w in zip(p["save_s"], p["save_world"], strict=True) if w == 2]
    save = percentile(save_s, 50)
    rows.append(row("fsdp_copy_stall_s", c2["snapshot_s_p50"], save, "s", higher_is_better=False))
    # ... and what it costs the steps (the exchange's CPU comes out of them on busy cores)
    rows.append(row("fsdp_copy_cost_s", b2["copy_extra_s"], save, "s", higher_is_better=False))
    step2 = t["step_s"][2]
    rows.append(row("fsdp_step_ws2_s", step2, p["step_s"].get(2, float("nan")), "s",
                    higher_is_better=False))  # fmt: skip
    every = t["copy_every"]
    log(
        "memory per worker (MB, rows + neighbour copies): "
        + ", ".join(
            f"{w}: {m['shard'] / fr.MB:.1f} + {m['copies'] / fr.MB:.1f}" if m else f"{w}: -"
            for w, m in memory.items()
        )
        + f"; DDP {full:.1f}; kills {t['kills']}"
    )
    log(
        f"copies at 2 members: snapshot p50 {c2['snapshot_s_p50'] * 1e3:.1f} ms "
        f"(max {c2['snapshot_s_max'] * 1e3:.1f}, n {c2['snapshots']}), exchange p50 "
        f"{c2['exchange_s_p50'] * 1e3:.1f} ms (max {c2['exchange_s_max'] * 1e3:.1f}, n "
        f"{c2['exchanges']}); from the step records: boundary +"
        f"{b2['gap_extra_s'] * 1e3:.1f} ms at a copy step, steps after it +"
        f"{b2['copy_extra_s'] * 1e3:.1f} ms; snapshot / ({every} steps of {step2 * 1e3:.0f} "
        f"ms) = {c2['snapshot_s_p50'] / (every * step2):.2%}; at 1 member "
        f"{t['copies'][1]['snapshots']} snapshots; copy errors {t['copy_errors']}; job "
        f"metrics {t['final_metrics']}"
    )
    return rows, {"tidal": t, "peer": p, "ddp_bytes": ddp, "memory": memory}


def run_tracked_copy(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import tracked_copy

    res = tracked_copy.measure(size["tc_steps"])
    log(
        f"tracked copy: mark p50 {res['mark_s_p50'] * 1e3:.3f} ms ({res['copied_per_mark']} "
        f"tensors, {res['copied_bytes_per_mark'] / 1e6:.2f} MB), step p50 "
        f"{res['step_s_p50'] * 1e3:.2f} ms against {res['peer_step_s_p50'] * 1e3:.2f} ms"
    )
    r = row("tracked_copy_overhead", res["tidal"], res["peer"], "steps/s", higher_is_better=True)
    return [r | {"peer_name": "floor", "peer_config": res["config"]}], res


def run_store_auth(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import store_auth

    res = store_auth.measure(tmp, generations=size["sa_gens"])
    log(
        f"store auth: re-form {res['auth_s'] * 1e3:.2f} ms against {res['raw_s'] * 1e3:.2f} ms "
        f"unauthenticated; {res['values_per_reform']} values per re-form and member, "
        f"{res['values_per_step']:g} per step"
    )
    r = row("store_auth_reform", res["auth_s"], res["raw_s"], "s", higher_is_better=False)
    return [r | {"peer_name": "unauthenticated store", "peer_config": res["config"]}], res


RUNNERS = {
    "throughput": (run_throughput, ["throughput_ws1", "throughput_ws2"], "samples/s"),
    "rescale": (run_rescale, ["rescale_pause_p50"], "s"),
    "recovery": (run_recovery, ["recovery_p50"], "s"),
    "state_transfer": (run_state_transfer, ["state_transfer"], "s"),
    "checkpoint_stall": (run_checkpoint_stall, ["checkpoint_stall_pct"], "% of step"),
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
}


def fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"


def suite(names: list[str], size: dict) -> tuple[list[dict], dict, list[str]]:
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
                rows += [
                    {"name": n, "tidal": None, "peer": None, "ratio": None, "unit": unit}
                    for n in expected
                ]
            log(f"{name} done in {time.monotonic() - t0:.0f} s")
    return rows, details, errors


def print_table(rows: list[dict], details: dict) -> None:
    lost = details.get("recovery", {}).get("steps_lost", [])
    print(
        f"{'measurement':<22} {'tidal':>10} {'torchrun/peer':>14} {'unit':<10} {'ratio':>8}  goal"
    )
    for r in rows:
        goal = GOALS.get(r["name"], "")
        steady = details.get("store_auth", {}).get("values_per_step")
        ok = met(r, {"steps_lost": lost, "values_per_step": steady}) if goal else None
        mark = "" if ok is None else (" met" if ok else " NOT met")
        print(
            f"{r['name']:<22} {fmt(r['tidal']):>10} {fmt(r['peer']):>14} {r['unit']:<10} "
            f"{fmt(r['ratio']):>8}  {goal}{mark}"
        )
    if lost:
        print(f"recovery: steps lost per kill {lost} (the interrupted step, redone)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events and steps (< 10 min)")
    parser.add_argument("--tiny", action="store_true", help="smallest sizes (the smoke test)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(MEASUREMENTS)}")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(MEASUREMENTS)
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        parser.error(f"unknown measurement(s) {unknown}; known: {MEASUREMENTS}")
    size = SIZES["tiny" if args.tiny else "quick" if args.quick else "full"]
    t0 = time.monotonic()
    rows, details, errors = suite(names, size)
    print()
    print_table(rows, details)
    print(
        f"\n{'tiny' if args.tiny else 'quick' if args.quick else 'full'} run, {time.monotonic() - t0:.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
        details_path = args.json.with_suffix(".details.json")
        details_path.write_text(json.dumps(details, indent=2, default=str))
    for e in errors:
        print(f"FAILED {e}", file=sys.stderr)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
