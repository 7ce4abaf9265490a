"""The suite's measurements of training under a change (throughput, rescale, recovery,
state transfer, input pipeline, capacity): each ``run_NAME(size, tmp) -> (rows, details)``
runs Tidal and its peer and builds the rows (``bench.rows``), each naming its peer and how
that peer was configured (``bench.peers``)."""

from __future__ import annotations

from pathlib import Path

from bench import peers
from bench.common import log
from bench.rows import percentile, row

FLOOR_TRANSFER = (
    "the same bytes moved at the host's floor: fastest of one gloo broadcast of a flat "
    "tensor, a loopback TCP socket, one process_vm_readv copy (bench.state_transfer)"
)


def run_throughput(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import throughput

    rows, details = [], {}
    for world in (1, 2):
        res = throughput.measure(world, size["tput_steps"], tmp / f"ws{world}", size["tput_reps"])
        config = peers.DDP | {"world": world, "window": "rank 0, steps past the first fifth"}
        rows += [
            row(f"throughput_ws{world}", res["tidal"], res["peer"], "samples/s",
                higher_is_better=True, peer_name="ddp", peer_config=config,
                tidal_samples=res["tidal_all"], peer_samples=res["peer_all"]),
            row(f"throughput_ws{world}_step_p50", res["tidal_step_s"], res["peer_step_s"], "s",
                higher_is_better=False, peer_name="ddp", peer_config=config,
                tidal_samples=res["tidal_step_all"], peer_samples=res["peer_step_all"]),
        ]  # fmt: skip
        details[f"ws{world}"] = res
    return rows, details


def times_rows(prefix: str, t: list, p: list, t_net: list, p_net: list, **peer) -> list:
    """p50 and p90 of a stall, and the p50 of its excess over one ordinary step."""

    def r(name: str, a: list, b: list, q: float) -> dict:
        return row(name, percentile(a, q), percentile(b, q), "s", higher_is_better=False,
                   tidal_samples=a, peer_samples=b, **peer)  # fmt: skip

    return [
        r(f"{prefix}_p50", t, p, 50),
        r(f"{prefix}_p90", t, p, 90),
        r(f"{prefix}_net_p50", t_net, p_net, 50),
    ]


def run_rescale(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import rescale

    (tmp / "tidal").mkdir(parents=True)
    (tmp / "peer").mkdir(parents=True)
    t = rescale.tidal_pauses(size["events"], tmp / "tidal")
    log(f"tidal rescale pauses (s): {[round(p, 3) for p in t['pauses_s']]}, step {t['step_s']}")
    p = rescale.peer_pauses(size["joins"], tmp / "peer")
    log(f"torchrun pauses (s): {[round(x, 3) for x in p['pauses_s']]}, step {p['step_s']}")
    torchrun = {"peer_name": "torchrun", "peer_config": peers.TORCHRUN_ELASTIC}
    rows = times_rows("rescale_pause", t["pauses_s"], p["pauses_s"], t["excess_s"],
                      p["excess_s"], **torchrun)  # fmt: skip
    # Each direction against the same direction: Tidal's joins (2 -> 3) against torchrun's
    # (1 -> 2), its leaves (3 -> 2) against torchrun's (2 -> 1).
    for kind, a, b in (("join", t["up_s"], p["up_s"]), ("leave", t["down_s"], p["down_s"])):
        rows.append(row(f"rescale_{kind}_p50", percentile(a, 50), percentile(b, 50), "s",
                        higher_is_better=False, tidal_samples=a, peer_samples=b, **torchrun))  # fmt: skip
    # A scale-up moves the joiner's state (the bench model's parameters and momentum) before
    # its first step: its floor is that transfer at the host's floor, measured in this run.
    floor = rescale.up_floor(tmp / "floor", reps=size["reps"])
    log(
        f"scale-up floor: {floor['bytes'] / 1e6:.0f} MB {floor['floor'] * 1000:.1f} ms "
        f"(heal {floor['heal'] * 1000:.1f} ms)"
    )
    peer_down = [x - p["step_s"][1] for x in p["down_s"]]
    # What the net pause reads at a change that cost nothing (``rescale.stat_floor``): each
    # change's kind at its own floor, their median as the net's.
    sf = t["stat_floor_s"]
    kinds = [sf["up"]] * len(t["excess_up_s"]) + [sf["down"]] * len(t["excess_down_s"])
    stat = percentile(kinds, 50) if kinds and None not in kinds else float("nan")
    rows += [
        row("rescale_pause_stat_floor", percentile(t["excess_s"], 50), stat, "s",
            higher_is_better=False, peer_name="floor",
            peer_config="the net-pause statistic at ordinary steps of the same job "
            "(bench.rescale.stat_floor)"),
        row("rescale_up_net_p50", percentile(t["excess_up_s"], 50), floor["floor"], "s",
            higher_is_better=False, peer_name="floor", peer_config=FLOOR_TRANSFER,
            tidal_samples=t["excess_up_s"]),
        row("rescale_down_net_p50", percentile(t["excess_down_s"], 50),
            percentile(peer_down, 50), "s", higher_is_better=False,
            tidal_samples=t["excess_down_s"], peer_samples=peer_down, **torchrun),
    ]  # fmt: skip
    return rows, {"tidal": t, "peer": p, "up_floor": floor}


def run_recovery(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import recovery

    (tmp / "tidal").mkdir(parents=True)
    (tmp / "peer").mkdir(parents=True)
    t = recovery.tidal_recovery(size["kills"], tmp / "tidal")
    log(
        f"tidal recovery (s): {[round(p, 3) for p in t['recovery_s']]}, back at 2 "
        f"{[round(p, 3) for p in t['back_at_2_s']]}, steps lost {t['steps_lost']}"
    )
    p = recovery.peer_recovery(size["peer_kills"], tmp / "peer")
    log(f"torchrun recovery (s): {[round(x, 3) for x in p['recovery_s']]}, step {p['step_s']:.3f}")
    torchrun = {"peer_name": "torchrun", "peer_config": peers.TORCHRUN_STANDALONE}
    rows = times_rows("recovery", t["recovery_s"], p["recovery_s"], t["excess_s"],
                      p["excess_s"], **torchrun)  # fmt: skip
    # at equal world sizes: Tidal back at 2 members (its replacement's first step) against
    # torchrun's restarted pair's first step
    a, b = t["back_at_2_s"], p["recovery_s"]
    rows.append(row("recovery_same_world_p50", percentile(a, 50), percentile(b, 50), "s",
                    higher_is_better=False, tidal_samples=a, peer_samples=b, **torchrun))  # fmt: skip
    # against its floor in the same run (``bench.recovery``): what Tidal adds, as a ratio
    rows.append(row("recovery_floor", percentile(t["recovery_s"], 50), t["floor_s"], "s",
                    higher_is_better=False, peer_name="floor",
                    peer_config="one step to the all-reduce at 2 plus one step alone, from "
                    "the same job's records"))  # fmt: skip
    return rows, {"tidal": t, "peer": p, "steps_lost": t["steps_lost"]}


def run_state_transfer(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import state_transfer

    res = state_transfer.measure(tmp, mb=size["mb"], reps=size["reps"])
    log(
        f"state transfer {res['bytes'] / 1e6:.0f} MB: heal {res['heal']:.3f} s, gloo "
        f"{res['gloo']:.3f} s, socket {res['socket']:.3f} s"
    )
    rows = [row("state_transfer", res["heal"], res["raw"], "s", higher_is_better=False,
                peer_name="floor", peer_config="the wire: the faster of one gloo broadcast "
                "of a flat tensor and a loopback TCP socket, same bytes")]  # fmt: skip
    if res["copy"] is not None:  # against one copy between the processes: the host's floor
        rows.append(row("state_transfer_copy", res["heal"], res["copy"], "s",
                        higher_is_better=False, peer_name="floor",
                        peer_config="one process_vm_readv copy of the same bytes between the "
                        "two processes"))  # fmt: skip
    return rows, res


def run_dataloader(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import dataloader

    res = dataloader.measure(size["loader_steps"], tmp, size["loader_reps"])
    t1, t0, p1, p0 = (res[k] for k in ("tidal_nw1", "tidal_nw0", "torchrun_nw1", "torchrun_nw0"))
    cfg = ("torchrun --standalone --nproc-per-node 2, DDP over gloo, a plain "
           "DataLoader(num_workers={n}) over the same dataset")  # fmt: skip
    peer = {"peer_name": "torchrun"}
    rows = [
        row("dataloader_workers", t1, p1, "samples/s", higher_is_better=True,
            peer_config=cfg.format(n=1), **peer),
        row("dataloader_workers_0", t0, p0, "samples/s", higher_is_better=True,
            peer_config=cfg.format(n=0), **peer),
        # each tool's speed-up from one DataLoader worker per training worker over none
        row("dataloader_speedup", t1 / t0, p1 / p0, "x", higher_is_better=True,
            peer_config=cfg.format(n="1 vs 0"), **peer),
    ]  # fmt: skip
    return rows, res


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
    join = res["peer"]["join_to_step_s"]
    rows = [row("cold_start", percentile(start["tidal"], 50), percentile(start["torchrun"], 50),
                "s", higher_is_better=False, peer_name="torchrun",
                peer_config="torchrun --standalone --nproc-per-node=2, launch to first step",
                tidal_samples=start["tidal"], peer_samples=start["torchrun"])]  # fmt: skip
    rows += [
        row(f"time_to_capacity_{kind}", percentile(res[kind]["join_to_step_s"], 50),
            percentile(join, 50), "s", higher_is_better=False, peer_name="torchrun",
            peer_config=peers.TORCHRUN_ELASTIC | {"measured": "second agent's launch to the "
                                                  "first step at 2 nodes"},
            tidal_samples=res[kind]["join_to_step_s"], peer_samples=join)
        for kind in ("cold", "spare")
    ]  # fmt: skip
    return rows, res


def run_compat_restart(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    """An unmodified torchrun script's restart-based changes: Tidal's ``--torchrun`` against
    torchrun's own, the same script and the same pause (``bench.compat_restart``)."""
    from bench import compat_restart

    (tmp / "tidal").mkdir(parents=True)
    (tmp / "peer").mkdir(parents=True)
    t = compat_restart.tidal_pauses(size["compat_changes"], tmp / "tidal")
    p = compat_restart.peer_pauses(size["compat_changes"], tmp / "peer")
    config = peers.torchrun_config("--nnodes=1:2 --nproc-per-node=1, one agent per node") | {
        "script": "examples/ddp_torchrun.py (unmodified: env://, DistributedSampler, its own "
        "torch.save snapshot), " + " ".join(compat_restart.SCRIPT_ARGS),
        "tidal": "tidal run --torchrun --workers 1 --max-workers 2, tidal scale 2 / 1",
    }
    torchrun = {"peer_name": "torchrun", "peer_config": config}
    rows = [
        row("compat_restart", percentile(t["pauses_s"], 50), percentile(p["pauses_s"], 50), "s",
            higher_is_better=False, tidal_samples=t["pauses_s"], peer_samples=p["pauses_s"],
            **torchrun),
        row("compat_restart_join_p50", percentile(t["up_s"], 50), percentile(p["up_s"], 50),
            "s", higher_is_better=False, tidal_samples=t["up_s"], peer_samples=p["up_s"],
            **torchrun),
        row("compat_restart_leave_p50", percentile(t["down_s"], 50),
            percentile(p["down_s"], 50), "s", higher_is_better=False,
            tidal_samples=t["down_s"], peer_samples=p["down_s"], **torchrun),
    ]  # fmt: skip
    return rows, {"tidal": t, "peer": p}
