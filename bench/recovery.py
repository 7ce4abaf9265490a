"""Failure recovery: SIGKILL of a worker, repeatedly.

Tidal: ``tidal run --workers 2 --max-restarts K``; the bench SIGKILLs the rank-1 worker
(pid from the status) once both members train, waits until a replacement has joined and
trained, and repeats. Each kill's recovery is the ``pause_s`` of the generation that
dropped the dead worker (last step before the kill to the survivor's first committed step
after it: it includes the step the kill interrupted), and, at torchrun's world size, the time
until the group is back at 2 members (``back_at_2_s``: the replacement's first step). Steps lost per kill: the step indices
begun before the kill that were redone (from the step records and the generation's
``start_step``).

Peer: ``torchrun --standalone --nproc-per-node 2 --max-restarts K`` on the same script;
its rendezvous tuned as ``bench.peers`` says; the bench SIGKILLs rank 1; torchrun restarts
both workers. The recovery has the same
definition: last step end before the kill to the first step end after it. torchrun keeps no
state across the restart (the script restarts at step 0: everything since the last
checkpoint is lost).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from bench.common import (
    TORCHRUN_ENV,
    TRAIN,
    Procs,
    ends,
    log,
    median_step,
    median_to_sync,
    read_records,
    tidal_cmd,
    torchrun_cmd,
    wait_until,
)
from bench.peers import torchrun_opts
from bench.rescale import tidal_status
from bench.rows import back_at_world


def tidal_recovery(kills: int, tmp: Path, timeout: float = 120) -> dict:
    home, name, out = tmp / "home", "recovery", tmp / "tidal"
    procs = Procs()
    kill_times: list[float] = []
    killed: list[int] = []
    try:
        proc = procs.start(
            tidal_cmd(home, name, "--workers", "2", "--max-restarts", str(kills + 2))
            + [str(TRAIN), "--mode", "tidal", "--steps", "10000000", "--out", str(out)],
            tmp / "tidal-recovery.log",
        )

        def ready():
            if proc.poll() is not None:
                raise RuntimeError(f"tidal run exited {proc.returncode}; see {tmp}")
            try:
                s = tidal_status(home, name)
            except Exception:  # noqa: BLE001 - not up yet
                return None
            if s["state"] != "running" or s["world_size"] != 2:
                return None
            gens = s["generations"]
            latest = max(gens, key=lambda g: g["id"]) if gens else None
            if (
                latest is None
                or latest["start_step"] is None
                or s["step"] < latest["start_step"] + 10
            ):
                return None
            ws = [w for w in s["workers"] if w["state"] == "running" and w["rank"] == 1]
            return ws[0] if ws and ws[0]["id"] not in killed else None

        for k in range(kills):
            victim = wait_until(ready, timeout, "two members training", interval=0.2)
            kill_times.append(time.time())
            os.kill(victim["pid"], signal.SIGKILL)
            killed.append(victim["id"])
            log(f"tidal: SIGKILL worker {victim['id']} (kill {k + 1}/{kills})")
        wait_until(ready, timeout, "the last replacement training", interval=0.2)
        status = tidal_status(home, name)
    finally:
        procs.cleanup()
    recs = read_records(out)
    gens = sorted(status["generations"], key=lambda g: g["id"])
    pauses, lost = [], []
    for t_kill, wid in zip(kill_times, killed, strict=True):
        after = [g for g in gens if g["opened_at"] >= t_kill - 0.5 and wid not in g["members"]]
        if not after:
            continue
        g = after[0]
        pauses.append(g["pause_s"])
        begun = [r.index for r in recs if r.kind == "B" and r.time < t_kill]
        lost.append(max(begun) + 1 - g["start_step"] if begun else 0)
    # back at the same world size as torchrun's restart: the replacement's first step at 2
    same = [g for t in kill_times if (g := back_at_world(recs, t, 2)) is not None]
    step1 = median_step(recs, 1)  # the survivor's first step after a kill is alone
    excess = [p - step1 for p in pauses]
    return {
        "recovery_s": pauses,
        "back_at_2_s": [b - a for a, b in same],
        "excess_s": excess,
        "step_s": step1,
        "floor_s": median_to_sync(recs, 2) + step1,
        "steps_lost": lost,
        "kills": len(kill_times),
    }


def peer_recovery(kills: int, tmp: Path, timeout: float = 120) -> dict:
    out = tmp / "peer"
    procs = Procs()
    recs_s: list[float] = []
    try:
        proc = procs.start(
            torchrun_cmd(
                "--standalone",
                "--nproc-per-node=2",
                *torchrun_opts(),
                f"--max-restarts={kills + 2}",
                str(TRAIN),
                *("--mode", "ddp", "--steps", "10000000", "--out", str(out)),
            ),
            tmp / "peer-recovery.log",
            TORCHRUN_ENV,
        )
        t_last = 0.0
        for k in range(kills):

            def victim(since=t_last):
                if proc.poll() is not None:
                    raise RuntimeError(f"torchrun exited {proc.returncode}; see {tmp}")
                e = [r for r in ends(read_records(out)) if r.time > since]
                pids = {r.pid for r in e if r.rank == 1}
                live = [p for p in pids if Path(f"/proc/{p}").exists()]
                return live[0] if len(e) > 20 and live else None

            pid = wait_until(victim, timeout, "torchrun training", interval=0.2)
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)

            def resumed(t=t_kill, dead=pid):
                e = ends(read_records(out))
                after = [r for r in e if r.time > t and r.pid != dead]
                before = [r for r in e if r.time < t]
                # the first step of the restarted workers (new pids: not the pre-kill ones)
                old = {r.pid for r in before}
                new = [r for r in after if r.pid not in old]
                return (before[-1].time, new[0].time) if new and before else None

            gap = wait_until(resumed, timeout, "torchrun's restarted workers")
            recs_s.append(gap[1] - gap[0])
            t_last = gap[1]
            log(f"torchrun: kill {k + 1}/{kills}: next step after {gap[1] - gap[0]:.2f} s")
    finally:
        procs.cleanup()
    step2 = median_step(read_records(out), 2)
    excess = [p - step2 for p in recs_s]
    return {"recovery_s": recs_s, "excess_s": excess, "step_s": step2, "kills": len(recs_s)}


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        which = sys.argv[1] if len(sys.argv) > 1 else "tidal"
        print((tidal_recovery if which == "tidal" else peer_recovery)(2, Path(t)))
