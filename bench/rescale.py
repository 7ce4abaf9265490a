"""Planned rescale pause.

Tidal: ``tidal run --workers 2 --max-workers 3 --schedule`` with changes 2 -> 3 -> 2 ...
every ``spacing`` steps; each change's pause is its generation's ``pause_s`` (the largest
gap, among the members, between their last step before the change and their first step
after it), read from ``tidal status --json``.

Peer: torchrun elastic, ``--nnodes=1:2 --nproc-per-node=1`` with c10d rendezvous on a free
port, its rendezvous tuned for fast elasticity (``bench.peers.TORCHRUN_RDZV_CONF``) and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. A
second agent joins (1 -> 2) and later leaves (SIGTERM to it: 2 -> 1); torchrun restarts the
workers each time. The pause has the same definition as Tidal's: from the last step before
the change to the first step at the new size (from the step records). The time from the
joining agent's launch to that first step is recorded too (``join_to_step_s``).
"""

from __future__ import annotations

import json
import signal
import statistics
import time
from pathlib import Path

from bench.common import (
    TORCHRUN_ENV,
    TRAIN,
    Procs,
    ends,
    free_port,
    log,
    median_step,
    read_records,
    tidal_cmd,
    torchrun_cmd,
    wait_until,
)
from bench.peers import torchrun_opts
from bench.rows import split_by_direction
from bench.train_mlp import build as build_mlp


def tidal_status(home: Path, name: str) -> dict:
    """``tidal status --json``, computed in this process (the same code path as the CLI)."""
    from tidal.lookup import get_status

    return json.loads(get_status(home, name).model_dump_json())


def tidal_pauses(events: int, tmp: Path, *, first: int = 200, spacing: int = 12) -> dict:
    schedule = ",".join(f"{first + i * spacing}:{3 if i % 2 == 0 else 2}" for i in range(events))
    steps = first + events * spacing + 10
    home, name = tmp / "home", "rescale"
    procs = Procs()
    try:
        proc = procs.start(
            tidal_cmd(home, name, "--workers", "2", "--max-workers", "3", "--schedule", schedule)
            + [str(TRAIN), "--mode", "tidal", "--steps", str(steps), "--out", str(tmp / "tidal")],
            tmp / "tidal-rescale.log",
        )
        rc = proc.wait(timeout=120 + steps * 0.5)
    finally:
        procs.cleanup()
    if rc != 0:
        raise RuntimeError(f"tidal run exited {rc}; see {tmp}")
    status = tidal_status(home, name)
    gens = sorted(status["generations"], key=lambda g: g["id"])[1:]
    pauses = [g["pause_s"] for g in gens if g["pause_s"] is not None]
    ups, downs = split_by_direction(sorted(status["generations"], key=lambda g: g["id"]))
    recs = read_records(tmp / "tidal")
    step = {w: median_step(recs, w) for w in (2, 3)}
    excess = [g["pause_s"] - step[g["world_size"]] for g in gens if g["pause_s"] is not None]
    phase_p50 = _phases_p50(gens)
    by_size = {w: _phases_p50([g for g in gens if g["world_size"] == w]) for w in (3, 2)}
    for what, p50 in (("", phase_p50), (" up", by_size[3]), (" down", by_size[2])):
        if p50:
            log(
                f"tidal{what} pause phases, median (ms): "
                + ", ".join(f"{k.removesuffix('_s')} {v * 1000:.1f}" for k, v in p50.items())
            )
    floor = stat_floor(recs)
    log(
        "tidal pause statistic at ordinary steps, over one step (ms): "
        + ", ".join(f"{k} {v * 1000:.1f}" for k, v in floor.items() if v is not None)
    )
    return {
        "pauses_s": pauses,
        "stat_floor_s": floor,
        "phases_p50_s": phase_p50,
        "phases_up_p50_s": by_size[3],
        "phases_down_p50_s": by_size[2],
        "excess_up_s": [
            g["pause_s"] - step[3]
            for g in gens
            if g["pause_s"] is not None and g["world_size"] == 3
        ],
        "excess_down_s": [
            g["pause_s"] - step[2]
            for g in gens
            if g["pause_s"] is not None and g["world_size"] == 2
        ],
        "excess_s": excess,
        "step_s": step,
        "up_s": ups,
        "down_s": downs,
        "generations": len(gens),
        "reasons": sorted({g["reason"] for g in gens}),
    }


def up_floor(tmp: Path, *, reps: int = 5) -> dict:
    """The floor of a scale-up's pause net of its first step: a joiner's state (the bench
    model's parameters and SGD momentum) moved at the floor's speed (``state_transfer``'s
    ``floor``: the fastest of a gloo broadcast, a plain socket and one copy between the
    processes' memories, into touched memory); its
    ``heal`` is Tidal's own heal of the same bytes, for comparison."""
    from bench import state_transfer

    model, _, _ = build_mlp()
    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    tmp.mkdir(parents=True, exist_ok=True)
    return state_transfer.measure(tmp, mb=mb, reps=reps)


def max_gap_floor(recs: list, world: int, pids: set[int] | None = None) -> float | None:
    """What the pause statistic reads where nothing changed: at ordinary steps of ``world``
    members, the median of the largest interval between consecutive step starts (each
    member's start follows its commit of the step before: the moments ``pause_s`` is taken
    between) among ``pids`` (all the members when None), less the median step. A change's
    ``pause_s`` is the largest of its members' gaps, and the members' commits of one step
    land milliseconds apart on busy cores, so even a change that cost nothing reads this
    much above one ordinary step. None without two consecutive ordinary steps."""
    starts: dict[int, dict[int, float]] = {}
    for r in recs:
        if r.kind == "B" and r.world == world and (pids is None or r.pid in pids):
            starts.setdefault(r.pid, {})[r.index] = r.time
    if len(starts) < 2:
        return None
    common = set.intersection(*(set(s) for s in starts.values()))
    gaps = [
        max(s[i + 1] - s[i] for s in starts.values()) for i in sorted(common) if i + 1 in common
    ]
    return statistics.median(gaps) - median_step(recs, world) if gaps else None


def stat_floor(recs: list) -> dict[str, float | None]:
    """``max_gap_floor`` for each kind of change of ``tidal_pauses``: a scale-up's pause is
    the largest gap of the two members that continue (the joiner has no step before it),
    at three; a scale-down's, of the two that remain, at two."""
    stay = {r.pid for r in recs if r.world == 2}
    return {"up": max_gap_floor(recs, 3, stay), "down": max_gap_floor(recs, 2, stay)}


def _phases_p50(gens: list[dict]) -> dict[str, float]:
    """The median of each pause phase over ``gens`` (the survivors' own report)."""
    phases = [g["pause_phases"] for g in gens if g.get("pause_phases")]
    return {k: statistics.median(ph[k] for ph in phases) for k in (phases[0] if phases else {})}


def _gap(recs, before: float, new_world: int) -> tuple[float, float] | None:
    """(last step end before ``before`` at another size, first end at ``new_world`` after)."""
    e = ends(recs)
    after = [r for r in e if r.time > before and r.world == new_world]
    if not after:
        return None
    first = after[0]
    prior = [r for r in e if r.time < first.time and r.world != new_world]
    if not prior:
        return None
    return prior[-1].time, first.time


def peer_pauses(joins: int, tmp: Path, timeout: float = 120) -> dict:
    out = tmp / "peer"
    port = free_port()

    def agent(tag: str, procs: Procs):
        return procs.start(
            torchrun_cmd(
                "--nnodes=1:2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=bench-rescale",
                *torchrun_opts(),
                "--max-restarts=100",
                str(TRAIN),
                *("--mode", "ddp", "--steps", "10000000", "--out", str(out)),
            ),
            tmp / f"peer-agent-{tag}.log",
            TORCHRUN_ENV,
        )

    pauses, join_to_step, up, down = [], [], [], []
    procs = Procs()
    try:
        agent("a", procs)
        wait_until(lambda: len(ends(read_records(out))) > 20, timeout, "torchrun's first steps")
        for j in range(joins):
            extra = Procs()
            extra.marker = procs.marker  # cleaned up with the others
            b = agent(f"b{j}", extra)
            procs.popens.append(b)
            t_join = time.time()
            gap = wait_until(
                lambda t=t_join: _gap(read_records(out), t, 2), timeout, "torchrun at 2 nodes"
            )
            pauses.append(gap[1] - gap[0])
            up.append(gap[1] - gap[0])
            join_to_step.append(gap[1] - t_join)
            log(
                f"torchrun join {j}: pause {gap[1] - gap[0]:.2f} s, join->step {gap[1] - t_join:.2f} s"
            )
            wait_until(  # some steps at 2 before it leaves
                lambda g=gap: sum(1 for r in ends(read_records(out)) if r.time > g[1]) > 20,
                timeout,
                "steps at 2 nodes",
            )
            t_leave = time.time()
            Procs.signal_group(b, signal.SIGTERM)
            gap = wait_until(
                lambda t=t_leave: _gap(read_records(out), t, 1), timeout, "torchrun back at 1 node"
            )
            pauses.append(gap[1] - gap[0])
            down.append(gap[1] - gap[0])
            log(f"torchrun leave {j}: pause {gap[1] - gap[0]:.2f} s")
            b.wait(timeout=30)
            wait_until(
                lambda g=gap: sum(1 for r in ends(read_records(out)) if r.time > g[1]) > 10,
                timeout,
                "steps at 1 node",
            )
    finally:
        procs.cleanup()
    recs = read_records(out)
    step = {w: median_step(recs, w) for w in (1, 2)}
    excess = [p - step[2] for p in up] + [p - step[1] for p in down]
    return {
        "pauses_s": pauses,
        "excess_s": excess,
        "step_s": step,
        "up_s": up,
        "down_s": down,
        "join_to_step_s": join_to_step,
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.rescale [--runs N] [--events E] [--peer]``: Tidal's planned changes,
    ``runs`` jobs of ``events`` changes each, one line a run (the median net pause, by kind,
    each change's net pause sorted) and the phases of each kind; the 96 changes of
    docs/benchmarks.md ("The rescale pause at 6599e29") are ``--runs 4 --events 24``.
    ``--peer``: torchrun's join and leave instead."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m bench.rescale", description=main.__doc__)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--events", type=int, default=24)
    parser.add_argument("--peer", action="store_true")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.events < 2:
        parser.error("--runs must be at least 1 and --events at least 2")
    pooled: list[float] = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as t:
            if args.peer:
                print(peer_pauses(1, Path(t)))
                continue
            res = tidal_pauses(args.events, Path(t))
        ms = sorted(x * 1000 for x in res["excess_s"])
        pooled += ms
        up, down = (statistics.median(res[k]) * 1000 for k in ("excess_up_s", "excess_down_s"))
        print(
            f"run {run + 1}: net median {statistics.median(ms):.1f} ms (ups {up:.1f}, downs "
            f"{down:.1f}); each: {' '.join(f'{x:.0f}' for x in ms)}"
        )
        for kind, world in (("up", 3), ("down", 2)):
            ph = res[f"phases_{kind}_p50_s"]
            step = res["step_s"][world] * 1000
            print(
                f"  {kind}: step {step:.1f} ms; phases (ms) "
                + ", ".join(f"{k.removesuffix('_s')} {v * 1000:.1f}" for k, v in ph.items())
                + (f"; first step - step {ph['first_step_s'] * 1000 - step:.1f}" if ph else "")
            )
    if args.runs > 1 and pooled:
        print(f"pooled: {len(pooled)} changes, net median {statistics.median(pooled):.1f} ms")


if __name__ == "__main__":
    main()
