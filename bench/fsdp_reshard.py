"""Sharded training (``sharding="fsdp"``, issue 16): the reshard pause, the memory per worker,
the steps a failure redoes, and the cost of the copy that bounds them.

Model: ``bench/train_fsdp.py``, a float32 stack of Linear layers, 13.7 MB of parameters and
27.4 MB of AdamW state (41 MB), global batch 64.

Tidal, one job: ``tidal run --workers 2 --max-workers 3 --max-restarts K-1 --schedule
12:3,22:2,...`` with ``sharding="fsdp"``. Each planned change's pause is its generation's
``pause_s`` from ``tidal status --json`` (the largest gap, among the members, between the
last step before the change and the first step committed after it: leave, rendezvous,
resharding over the new group, the neighbour copy of the new layout, and one step). Once
the schedule is done the job trains ``steady`` steps at 2 members, then the bench SIGKILLs
a member K times, each at a chosen step (a fault, ``tidal.testing.fault_env``, armed
through a file once the victim's id is known), and reads the failure generation's
``redone_steps``; after the last kill the survivor trains alone. A failure reported before
the first kill fails the bench (float32 must train: FSDP2's PREMUL_SUM once failed every
step on gloo). Every member writes what it holds once per generation
(``train_fsdp.memory_facts``) and every neighbour copy it takes (``train_fsdp.CopyLog``:
the snapshot on the training thread, the exchange on the ring's thread); the step records
give the same cost as the training loop sees it (``boundary_costs``), and the job's
``copy_*`` metrics are sampled from the status.

Peer, what a torchtitan / DCP user does for a resize: ``torchrun --standalone
--nproc-per-node N`` on the same model under FSDP2; at the change the job saves
``get_state_dict`` + ``dcp.async_save`` (staged, then written) and its processes exit; ``torchrun`` starts at the new size,
``dcp.load`` + ``set_state_dict`` and takes its first step. The pause has Tidal's definition:
from the last step completed before the change (the latest member's) to the first step
completed after it (the latest member's), from the step records. The checkpoint lives on
the local disk (page cache): the floor of what a shared filesystem would cost.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.common import (
    ROOT,
    TORCHRUN_ENV,
    Procs,
    ends,
    log,
    median_step,
    read_records,
    tidal_cmd,
    torchrun_cmd,
    wait_until,
)
from bench.rescale import tidal_status

TRAIN_FSDP = ROOT / "bench" / "train_fsdp.py"
MB = 1e6


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- Tidal -----------------------------------------------------------------------------------
def _write_fault(path: Path, spec: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(spec)
    os.replace(tmp, path)


def tidal_sharded(
    changes: int,
    kill_offsets: list[int],
    tmp: Path,
    *,
    steady: int = 5,
    first: int = 12,
    spacing: int = 10,
    timeout: float = 120,
) -> dict:
    """One job: ``changes`` planned changes 2 -> 3 -> 2 ..., then ``steady`` steps at 2
    members (copies every ``DEFAULT_EVERY``: their cost to the steps), then a SIGKILL of a
    member at each step ``s`` with ``s % every == offset`` for each of ``kill_offsets``."""
    from tidal.testing import fault_env
    from tidal.worker.sharded.ring import DEFAULT_EVERY

    schedule = ",".join(f"{first + i * spacing}:{3 if i % 2 == 0 else 2}" for i in range(changes))
    last_change = first + (changes - 1) * spacing
    home, name, out = tmp / "home", "fsdp", tmp / "out"
    faults = tmp / "faults.txt"
    faults.write_text("")
    procs = Procs()
    kills: list[dict] = []
    samples: list[dict] = []  # the job's copy metrics, each time they change
    kills_armed = False
    try:
        env = fault_env(f"@{faults}", procs.env())
        cmd = tidal_cmd(home, name, "--workers", "2", "--max-workers", "3")
        cmd += ["--max-restarts", str(max(0, len(kill_offsets) - 1)), "--schedule", schedule]
        cmd += [str(TRAIN_FSDP), "--mode", "tidal", "--steps", "10000000", "--out", str(out)]
        proc = procs.start(cmd, tmp / "tidal.log", env)

        def status() -> dict | None:
            if proc.poll() is not None:
                raise RuntimeError(f"tidal run exited {proc.returncode}; see {tmp}")
            try:
                s = tidal_status(home, name)
            except Exception:  # noqa: BLE001 - not up yet
                return None
            _sample_metrics(s, samples)
            if not kills_armed:  # no failure is expected before the first kill
                failed = [e["message"] for e in s["events"] if e["kind"] == "failure"]
                if failed:
                    raise RuntimeError(
                        f"float32 sharded training failed before any kill ({len(failed)} "
                        f"failures; the first: {failed[0]}); see {tmp}"
                    )
            return s

        def settled(min_step: int) -> dict | None:
            """The status once two members train in a generation 5+ steps old."""
            s = status()
            if not s or s["state"] != "running" or s["world_size"] != 2 or s["step"] < min_step:
                return None
            latest = max(s["generations"], key=lambda g: g["id"])
            if latest["start_step"] is None or s["step"] < latest["start_step"] + 5:
                return None
            return s

        wait_until(lambda: settled(last_change + steady), timeout, "the steady steps", 0.2)
        for k, offset in enumerate(kill_offsets):
            s = wait_until(lambda: settled(0), timeout, "two members training", 0.2)
            latest = max(s["generations"], key=lambda g: g["id"])
            victim = latest["members"][-1]

            def arm(step: int, v: int = victim, k: int = k, offset: int = offset) -> int:
                at = step + 4  # a few steps ahead: the fault file is read at every probe
                at += (offset - at) % DEFAULT_EVERY
                _write_fault(faults, f"sigkill@worker={v},step={at},id=k{k}-{at}")
                log(f"tidal: SIGKILL of worker {v} armed at step {at} (kill {k + 1})")
                return at

            armed_at = [arm(s["step"])]
            kills_armed = True
            armed = time.time()

            def recovered(v=victim, t=armed, armed_at=armed_at, arm=arm) -> dict | None:
                st = status()
                if not st:
                    return None
                after = [
                    g
                    for g in st["generations"]
                    if g["opened_at"] >= t and v not in g["members"] and g["start_step"] is not None
                ]
                if after:
                    return after[0] if after[0]["redone_steps"] is not None else None
                # The status's step trails the workers' (heartbeats once a second, the view
                # published every 0.5 s): by more than 4 steps, the armed step had passed
                # before the fault was written. Far past it with the victim still running,
                # it never fired: arm it again ahead of where the job is now.
                running = any(w["id"] == v and w["state"] == "running" for w in st["workers"])
                if running and st["step"] > armed_at[0] + 3 * DEFAULT_EVERY:
                    armed_at[0] = arm(st["step"])
                return None

            g = wait_until(recovered, timeout, f"the recovery from kill {k + 1}", 0.2)
            kills.append(
                {
                    "worker": victim,
                    "at_step": armed_at[0],
                    "offset": offset,
                    "generation": g["id"],
                    "start_step": g["start_step"],
                    "redone_steps": g["redone_steps"],
                    "recovery": g["recovery"],
                    "pause_s": g["pause_s"],
                }
            )
            log(
                f"tidal: kill {k + 1}: recovery {g['recovery']}, {g['redone_steps']} steps "
                f"redone (resumed at {g['start_step']}), pause {g['pause_s']:.3f} s"
            )

        def alone_recorded() -> bool:
            status()
            return any(m["world"] == 1 for m in _memory(out))

        wait_until(alone_recorded, timeout, "the survivor's memory record", 0.2)
        final = tidal_status(home, name)
    finally:
        procs.cleanup()
    gens = sorted(final["generations"], key=lambda g: g["id"])
    planned = [g for g in gens[1 : 1 + changes] if g["pause_s"] is not None]
    recs = read_records(out)
    step = {w: median_step(recs, w) for w in (1, 2, 3)}
    mem = _memory(out)
    bad = [m for m in mem if m["dtypes"] != ["torch.float32"]]
    if bad:
        raise RuntimeError(f"the bench measures float32 shards, a member held {bad[0]['dtypes']}")
    copies = _jsonl(out, "copies")
    return {
        "pauses_s": [g["pause_s"] for g in planned],
        "up_s": [g["pause_s"] for g in planned if g["world_size"] == 3],
        "down_s": [g["pause_s"] for g in planned if g["world_size"] == 2],
        "excess_s": [g["pause_s"] - step[g["world_size"]] for g in planned],
        "phases": [g.get("pause_phases") for g in planned],
        "recovery": [g["recovery"] for g in planned],
        "planned_redone": [g["redone_steps"] for g in planned],
        "step_s": step,
        "kills": kills,
        "memory": mem,
        "copy_every": DEFAULT_EVERY,
        "copies": {w: copy_costs(copies, w) for w in (1, 2, 3)},
        "copy_errors": [c["error"] for c in copies if c["kind"] == "error"],
        "boundary": {w: boundary_costs(recs, w, DEFAULT_EVERY) for w in (2, 3)},
        "metric_samples": samples,
        "final_metrics": {k: v for k, v in final["metrics"].items() if k.startswith("copy_")},
        "generations": gens,
    }


def _jsonl(out: Path, prefix: str) -> list[dict]:
    rows = []
    for path in out.glob(f"{prefix}-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a kill
    return rows


def _memory(out: Path) -> list[dict]:
    return _jsonl(out, "mem")


def _sample_metrics(status: dict, samples: list[dict]) -> None:
    """Append the job's ``copy_*`` metrics (rank 0's last copy) when they changed."""
    m = status.get("metrics") or {}
    got = {k: m[k] for k in ("copy_snapshot_s", "copy_exchange_s") if k in m}
    if got and (not samples or {k: samples[-1].get(k) for k in got} != got):
        samples.append({"step": status["step"], "world": status["world_size"], **got})


def memory_per_worker(mem: list[dict], world: int) -> dict | None:
    """The most any member held at ``world`` members: its rows, its copies, their total."""
    rows = [m for m in mem if m["world"] == world]
    if not rows:
        return None
    worst = max(rows, key=lambda m: m["params"] + m["optimizer"] + m["copy_own"] + m["copy_theirs"])
    shard = worst["params"] + worst["optimizer"]
    copies = worst["copy_own"] + worst["copy_theirs"]
    return {"shard": shard, "copies": copies, "total": shard + copies}


def copy_costs(copies: list[dict], world: int) -> dict:
    """Every member's neighbour copies at ``world`` members (``train_fsdp.CopyLog``): the
    training thread's snapshot and the exchange on the ring's thread, in seconds."""
    snap = [c["seconds"] for c in copies if c["kind"] == "snapshot" and c["world"] == world]
    exch = [c["seconds"] for c in copies if c["kind"] == "exchange" and c["world"] == world]
    return {
        "snapshots": len(snap),
        "snapshot_s_p50": _median(snap),
        "snapshot_s_max": max(snap, default=float("nan")),
        "exchanges": len(exch),
        "exchange_s_p50": _median(exch),
        "exchange_s_max": max(exch, default=float("nan")),
    }


def boundary_costs(recs: list, world: int, every: int) -> dict:
    """What a copy costs the training loop, from the step records alone: each member's
    gap between a step's end and the next step's begin (the commit, the optimizer update
    and, after every ``every``-th committed step, the copy's snapshot), at copy steps and
    at others; and the period (end to end) of the step during which the exchange runs
    (the first after a copy) against the steps 3 or more past a copy (none of it)."""
    by_pid: dict[int, list] = {}
    for r in recs:
        if r.world == world:
            by_pid.setdefault(r.pid, []).append(r)
    gap_copy: list[float] = []
    gap_other: list[float] = []
    period: dict[int, list[float]] = {}
    for rs in by_pid.values():
        for a, b in zip(rs, rs[1:], strict=False):
            if a.kind == "E" and b.kind == "B" and b.index == a.index + 1:
                gap = b.time - a.time
                if gap < 1.0:  # not a pause (a change, a failure)
                    (gap_copy if b.index % every == 0 else gap_other).append(gap)
        ends_ = [r for r in rs if r.kind == "E"]
        for a, b in zip(ends_, ends_[1:], strict=False):
            if b.index == a.index + 1 and b.time - a.time < 2.0:
                period.setdefault(b.index % every, []).append(b.time - a.time)
    base = _median([x for k, v in period.items() if k >= 3 for x in v])
    p50 = {k: _median(v) for k, v in sorted(period.items())}
    return {
        "gap_copy_s_p50": _median(gap_copy),
        "gap_other_s_p50": _median(gap_other),
        "gap_extra_s": _median(gap_copy) - _median(gap_other),
        "copies": len(gap_copy),
        "period_by_offset_s_p50": p50,
        "period_base_s": base,
        # the steps after a copy (offsets 0 to 2) over the ones without: snapshot + the
        # exchange's CPU taken from the training, per copy
        "copy_extra_s": sum(p50.get(k, base) - base for k in (0, 1, 2)),
    }


# -- the DCP peer ------------------------------------------------------------------------------
def peer_dcp(changes: int, tmp: Path, *, first: int = 10, spacing: int = 6) -> dict:
    """torchrun at 2, then 3, 2, ... members: each run saves with DCP and exits at its last
    step, the next loads and continues."""
    worlds = [2] + [3 if i % 2 == 0 else 2 for i in range(changes)]
    stops = [first + i * spacing for i in range(len(worlds))]
    procs = Procs()
    try:
        for i, (world, stop) in enumerate(zip(worlds, stops, strict=True)):
            args = ["--mode", "dcp", "--stop-at", str(stop), "--out", str(tmp / f"run{i}")]
            if i > 0:
                args += ["--resume", str(tmp / f"ckpt{i - 1}")]
            if i < len(worlds) - 1:
                args += ["--save", str(tmp / f"ckpt{i}")]
            proc = procs.start(
                torchrun_cmd("--standalone", f"--nproc-per-node={world}", str(TRAIN_FSDP), *args),
                tmp / f"torchrun-{i}.log",
                TORCHRUN_ENV,
            )
            rc = proc.wait(timeout=180)
            if rc != 0:
                raise RuntimeError(f"torchrun at {world} exited {rc}; see {tmp}/torchrun-{i}.log")
    finally:
        procs.cleanup()
    runs = []
    for i, world in enumerate(worlds):
        phases = [
            json.loads(p.read_text())["phases"] for p in (tmp / f"run{i}").glob("phases-*.json")
        ]
        runs.append({"world": world, "records": read_records(tmp / f"run{i}"), "phases": phases})
    pauses, parts, step = [], [], {}
    for a, b in zip(runs, runs[1:], strict=False):
        last = max(r.time for r in ends(a["records"]))
        firsts: dict[int, float] = {}
        for r in ends(b["records"]):
            firsts.setdefault(r.pid, r.time)
        pauses.append(max(firsts.values()) - last)

        def latest(phases: list[dict], key: str) -> float:
            return max(p[key] for p in phases)

        pa, pb = a["phases"], b["phases"]
        parts.append(
            {
                "save_s": latest(pa, "save_end") - latest(pa, "save_begin"),
                "stage_s": latest(pa, "save_staged") - latest(pa, "save_begin"),
                "exit_and_relaunch_s": min(p["start"] for p in pb) - latest(pa, "save_end"),
                "import_and_group_s": latest(pb, "group") - min(p["start"] for p in pb),
                "build_s": latest(pb, "built") - latest(pb, "group"),
                "load_s": latest(pb, "loaded") - latest(pb, "built"),
                "first_step_s": latest(pb, "first_step") - latest(pb, "loaded"),
                "last_step_to_save_s": latest(pa, "save_begin") - last,
            }
        )
    for run in runs:
        s = median_step(run["records"], run["world"])
        step.setdefault(run["world"], []).append(s)
    return {
        "pauses_s": pauses,
        "up_s": [p for p, r in zip(pauses, runs[1:], strict=True) if r["world"] == 3],
        "down_s": [p for p, r in zip(pauses, runs[1:], strict=True) if r["world"] == 2],
        "parts": parts,
        "parts_p50": {k: _median([p[k] for p in parts]) for k in (parts[0] if parts else {})},
        "step_s": {w: _median(v) for w, v in step.items()},
        "save_s": [p["save_s"] for p in parts],
        "stage_s": [p["stage_s"] for p in parts],
        "save_world": worlds[:-1],
    }


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        which = sys.argv[1] if len(sys.argv) > 1 else "tidal"
        if which == "tidal":
            res = tidal_sharded(2, [5], Path(t), steady=30)
            res.pop("generations")
            print(json.dumps(res, indent=1, default=str))
        else:
            print(json.dumps(peer_dcp(2, Path(t)), indent=1, default=str))
