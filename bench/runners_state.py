"""The suite's measurements of state and the control plane (checkpoints, sharded state,
the coordinator, tracked state, the store's authentication): each ``run_NAME(size, tmp) ->
(rows, details)``, every row naming its peer and how it was configured."""

from __future__ import annotations

from pathlib import Path

from bench import peers
from bench.common import log
from bench.rows import percentile, row


def run_checkpoint_stall(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import checkpoint_stall

    res = checkpoint_stall.measure(quick=size["ck_quick"], steps=size["ck_steps"])
    blocked = res["blocked_s"]
    rows = [row(res["name"], res["tidal"], res["peer"], res["unit"], higher_is_better=False,
                peer_name=res["peer_name"], peer_config=res["peer_config"],
                tidal_samples=blocked["async"], peer_samples=blocked["dcp"])]  # fmt: skip
    floor_config = ("a thread that copies the same bytes into memory allocated once and writes "
                    "them to one file, fsynced (bench.checkpoint_stall.FloorWriter), measured "
                    "as Tidal's writer is, in the same run")  # fmt: skip
    rows.append(
        row(
            "checkpoint_stall_floor_pct",
            res["tidal"],
            res["floor_pct"],
            "% of step",
            higher_is_better=False,
            peer_name="floor",
            peer_config=floor_config,
        )
    )
    spare = res["spare_core"]
    rows.append(row("checkpoint_stall_spare_core_pct", spare["async"], spare["dcp"], "% of step",
                    higher_is_better=False, peer_name="dcp.async_save",
                    peer_config={**res["peer_config"], "training_threads": 1},
                    tidal_samples=spare["blocked_s"]["async"],
                    peer_samples=spare["blocked_s"]["dcp"]))  # fmt: skip
    return rows, res


def run_checkpoint_cpu(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import checkpoint_cpu

    res = checkpoint_cpu.measure(quick=size["ck_quick"], repeats=size["ckcpu_reps"])
    cpu = res["details"]["cpu_s"]
    r = row(res["name"], res["tidal"], res["peer"], res["unit"], higher_is_better=False,
            peer_name="floor", peer_config="memcpy + page-cache write + fsync of the same "
            "bytes, steady state (bench.checkpoint_cpu.floor_cpu)",
            tidal_samples=cpu["tidal"], peer_samples=cpu["floor"])  # fmt: skip
    return [r], res


def run_control_plane(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import control_plane

    return control_plane.run(
        list(control_plane.SIZES), tmp, window_s=size["cp_window_s"], warmup_s=size["cp_warmup_s"]
    )


FSDP_PEER = ("torchrun --standalone --nproc-per-node N, FSDP2 (fully_shard per Linear and the "
             "root) over gloo; a resize: get_state_dict + dcp.async_save (DefaultStager, async "
             "staging), exit, relaunch at the new size, dcp.load + set_state_dict")  # fmt: skip


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
    dcp = {"peer_name": "torchrun+dcp", "peer_config": FSDP_PEER}
    rows = [row("fsdp_reshard", percentile(t["pauses_s"], 50), percentile(p["pauses_s"], 50),
                "s", higher_is_better=False, tidal_samples=t["pauses_s"],
                peer_samples=p["pauses_s"], **dcp)]  # fmt: skip
    memory = {}
    for world in (1, 2, 3):
        m = fr.memory_per_worker(t["memory"], world)
        memory[world] = m
        held = m["total"] / fr.MB if m else float("nan")
        rows.append(row(f"fsdp_memory_ws{world}", held, full, "MB", higher_is_better=False,
                        peer_name="ddp", peer_config="a DDP member's parameters + AdamW state "
                        "(the whole model on every member)"))  # fmt: skip
    redone = [k["redone_steps"] for k in t["kills"]]
    every = t["copy_every"]
    rows.append(row("fsdp_redone_steps", percentile(redone, 50), None, "steps",
                    higher_is_better=False, peer_name="none",
                    peer_config=f"none: a bound, not a peer (at most the neighbour-copy "
                    f"interval, {every} steps)", tidal_samples=redone))  # fmt: skip
    # what a copy costs the training thread (the snapshot; the exchange runs beside the
    # training) against what a DCP user's training waits for (async_save's staging), at 2
    c2, b2 = t["copies"][2], t["boundary"][2]
    at2 = [i for i, w in enumerate(p["save_world"]) if w == 2]
    stage = percentile([p["stage_s"][i] for i in at2], 50)
    save = percentile([p["save_s"][i] for i in at2], 50)
    rows.append(row("fsdp_copy_stall_s", c2["snapshot_s_p50"], stage, "s",
                    higher_is_better=False, peer_name="dcp.async_save",
                    peer_config=peers.DCP_ASYNC | {"measured": "begin to staging completion, "
                                                   "FSDP2 at 2 members"}))  # fmt: skip
    # ... and what it costs the steps (the exchange's CPU comes out of them on busy cores)
    rows.append(row("fsdp_copy_cost_s", b2["copy_extra_s"], save, "s", higher_is_better=False,
                    peer_name="dcp.async_save",
                    peer_config=peers.DCP_ASYNC | {"measured": "begin to upload completion "
                                                   "(the work beside the steps), at 2"}))  # fmt: skip
    step2 = t["step_s"][2]
    rows.append(row("fsdp_step_ws2_s", step2, p["step_s"].get(2, float("nan")), "s",
                    higher_is_better=False, **dcp))  # fmt: skip
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
    r = row("tracked_copy_overhead", res["tidal"], res["peer"], "steps/s", higher_is_better=True,
            peer_name="floor", peer_config=res["config"])  # fmt: skip
    return [r], res


def run_store_auth(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import store_auth

    res = store_auth.measure(tmp, generations=size["sa_gens"])
    log(
        f"store auth: re-form {res['auth_s'] * 1e3:.2f} ms against {res['raw_s'] * 1e3:.2f} ms "
        f"unauthenticated; {res['values_per_reform']} values per re-form and member, "
        f"{res['values_per_step']:g} per step"
    )
    r = row("store_auth_reform", res["auth_s"], res["raw_s"], "s", higher_is_better=False,
            peer_name="unauthenticated store", peer_config=res["config"])  # fmt: skip
    return [r], res
