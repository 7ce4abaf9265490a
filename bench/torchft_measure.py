"""TorchFT against Tidal: recovery, join and steady throughput, each measured the same way
for both in the same run (``bench.torchft_peer.run_torchft`` calls ``measure``).

TorchFT: a lighthouse process and one process per replica group
(``bench/torchft_replica.py``, the settings of ``bench.peers.TORCHFT_*``); each replica
appends ``TIME STEP PARTICIPANTS`` per committed step, and every number below comes from
those lines (``parse_steps``), as Tidal's come from ``bench/train_mlp.py``'s records.

- recovery (``torchft_recovery``, against Tidal's ``recovery_p50``): two replicas train, the
  bench SIGKILLs replica 1's process and at once launches a replacement (as Tidal's
  ``--max-restarts`` does); the recovery is the last committed step before the kill to the
  survivor's first committed step in a quorum without the dead replica (Tidal: the
  ``pause_s`` of the generation that dropped the dead worker, the same two moments). The time until the replacement's first
  step at two replicas (``back_at_2_s``, Tidal's ``recovery_same_world_p50`` definition)
  and from the kill itself are kept in the details.
- join (``torchft_join``, against Tidal's ``time_to_capacity_cold``): from one replica, the
  launch of a new replica process to the first step committed at two replicas (Tidal:
  ``tidal scale JOB 2`` to the first step at 2, the joiner a process started by it).
- throughput (``torchft_throughput``, against Tidal's ``throughput_ws2``): two replicas for
  ``tput_steps`` steps; wall-clock samples/s of replica 0's commits at two replicas past the
  first fifth (``bench.rows.wall_clock_rate``), runs alternating with Tidal's.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from pathlib import Path

from bench.common import Procs, Rec, log, wait_until
from bench.peers import torchft_config
from bench.rows import back_at_world, percentile, row, wall_clock_rate

GLOBAL_BATCH = 64


# -- the replicas' step logs (pure) ---------------------------------------------------------
def parse_steps(name: str, text: str) -> list[Rec]:
    """The commits in one replica's log ``steps-REPLICA-PID.txt``: ``TIME STEP PARTICIPANTS``
    lines as ``Rec("E", time, step, participants, replica, pid)`` (a line cut by a kill or
    anything else malformed is skipped)."""
    stem = name.rsplit("/", 1)[-1].removesuffix(".txt")
    _, replica, pid = stem.split("-")
    recs = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 3:
            continue
        try:
            t, step, n = float(parts[0]), int(parts[1]), int(parts[2])
        except ValueError:
            continue
        recs.append(Rec("E", t, step, n, int(replica), int(pid)))
    return recs


def read_steps(directory: Path) -> list[Rec]:
    recs = [r for p in directory.glob("steps-*-*.txt") for r in parse_steps(p.name, p.read_text())]
    recs.sort(key=lambda r: r.time)
    return recs


def ready_time(directory: Path, pid: int) -> float | None:
    """When process ``pid``'s replica made its ``Manager`` (``ready-REPLICA-PID.txt``)."""
    for p in directory.glob(f"ready-*-{pid}.txt"):
        try:
            return float(p.read_text().split()[0])
        except (IndexError, ValueError):
            return None
    return None


def recovery_times(recs: list[Rec], t_kill: float, victim: int) -> dict | None:
    """After SIGKILL of process ``victim`` at ``t_kill``: ``recovery_s`` (the last commit
    before the kill to a survivor's first commit in a quorum without the victim: a process
    that committed before the kill and is not the victim, at fewer replicas than the last
    commit before the kill; a step whose all-reduce ended before the kill may still commit
    after it at the old size, as Tidal's interrupted step, and does not end the recovery),
    ``kill_to_commit_s`` (the kill to that commit) and ``back_at_2_s`` (the last commit
    before the kill to a new process's first commit at two replicas, None until then). None
    until the survivor's commit."""
    before = [r for r in recs if r.time < t_kill]
    if not before:
        return None
    old = {r.pid for r in before} - {victim}
    size = max(before, key=lambda r: r.time).world
    after = [r for r in recs if r.time > t_kill and r.pid in old and r.world < size]
    if not after:
        return None
    last, first = max(r.time for r in before), min(r.time for r in after)
    back = back_at_world(recs, t_kill, 2)
    return {
        "recovery_s": first - last,
        "kill_to_commit_s": first - t_kill,
        "back_at_2_s": None if back is None else back[1] - back[0],
    }


def join_time(recs: list[Rec], t_launch: float) -> float | None:
    """Seconds from a replica's launch at ``t_launch`` to the first step committed at two
    replicas after it; None until then."""
    at2 = [r.time for r in recs if r.time > t_launch and r.world == 2]
    return min(at2) - t_launch if at2 else None


def commits_since(recs: list[Rec], t: float, world: int) -> int:
    """Commits of distinct steps at ``world`` replicas after ``t``."""
    return len({r.index for r in recs if r.time > t and r.world == world})


# -- the processes --------------------------------------------------------------------------
class TorchFTJob:
    """A lighthouse and the replicas of one measurement, all under one ``Procs``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.out = tmp, tmp / "steps"
        self.out.mkdir(parents=True, exist_ok=True)
        self.procs = Procs()
        self.replicas: dict[int, object] = {}
        self.addr = ""

    def __enter__(self) -> TorchFTJob:
        log_path = self.tmp / "lighthouse.log"
        lh = self.procs.start([sys.executable, "-m", "bench.torchft_replica", "--lighthouse"],
                              log_path)  # fmt: skip

        def address():
            if lh.poll() is not None:
                raise RuntimeError(f"the lighthouse exited {lh.returncode}; see {log_path}")
            for line in log_path.read_text(errors="replace").splitlines():
                if line.startswith("LIGHTHOUSE "):
                    return line.split()[1]
            return None

        self.addr = wait_until(address, 60, "the lighthouse's address")
        return self

    def __exit__(self, *exc: object) -> None:
        self.procs.cleanup()

    def launch(self, replica: int, steps: int | None = None) -> int:
        """Start replica ``replica``; its pid."""
        cmd = [sys.executable, "-m", "bench.torchft_replica", "--replica", str(replica),
               "--out", str(self.out)] + (["--steps", str(steps)] if steps else [])  # fmt: skip
        proc = self.procs.start(cmd, self.tmp / f"replica-{replica}.log",
                                {"TORCHFT_LIGHTHOUSE": self.addr})  # fmt: skip
        self.replicas[replica] = proc
        return proc.pid

    def check(self) -> None:
        for replica, proc in self.replicas.items():
            if proc.poll() not in (None, 0, -signal.SIGKILL):
                raise RuntimeError(f"torchft replica {replica} exited {proc.returncode}; "
                                   f"see {self.tmp}")  # fmt: skip

    def steps(self) -> list[Rec]:
        self.check()
        return read_steps(self.out)


def torchft_recovery(kills: int, joins: int, tmp: Path, timeout: float = 120) -> dict:
    """``kills`` SIGKILLs of replica 1 (a replacement launched at each), then ``joins``
    joins to one replica (a replica ended, ten steps alone, a new one launched)."""
    res: dict = {"recovery_s": [], "kill_to_commit_s": [], "back_at_2_s": [], "join_s": [],
                 "join_ready_to_step_s": []}  # fmt: skip
    with TorchFTJob(tmp) as job:
        job.launch(0)
        victim = job.launch(1)
        next_id, since = 2, 0.0
        for k in range(kills):
            wait_until(lambda s=since: commits_since(job.steps(), s, 2) >= 20, timeout,
                       "torchft training at two replicas", interval=0.2)  # fmt: skip
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            replacement = job.launch(next_id)
            next_id += 1
            got = wait_until(
                lambda t=t_kill, v=victim: (
                    (g := recovery_times(job.steps(), t, v)) and g["back_at_2_s"] is not None and g
                ),
                timeout,
                "the survivor's commit and the replacement's first step at two",
                interval=0.2,
            )
            for key in ("recovery_s", "kill_to_commit_s", "back_at_2_s"):
                res[key].append(got[key])
            log(f"torchft kill {k + 1}/{kills}: survivor {got['recovery_s']:.3f} s, back at 2 "
                f"{got['back_at_2_s']:.3f} s")  # fmt: skip
            victim, since = replacement, time.time()
        for j in range(joins):
            wait_until(lambda s=since: commits_since(job.steps(), s, 2) >= 10, timeout,
                       "torchft training at two replicas", interval=0.2)  # fmt: skip
            os.kill(victim, signal.SIGKILL)  # down to one replica
            t = time.time()
            wait_until(lambda t=t: commits_since(job.steps(), t, 1) >= 10, timeout,
                       "torchft training at one replica", interval=0.2)  # fmt: skip
            t_launch = time.time()
            victim = job.launch(next_id)
            next_id += 1
            got = wait_until(lambda t=t_launch: join_time(job.steps(), t), timeout,
                             "the joiner's first step at two", interval=0.1)  # fmt: skip
            res["join_s"].append(got)
            ready = ready_time(job.out, victim)
            if ready is not None:  # the joiner's own start left out: its Manager made to the step
                res["join_ready_to_step_s"].append(t_launch + got - ready)
            log(f"torchft join {j + 1}/{joins}: launch to first step at 2 {got:.3f} s")
            since = time.time()
    return res


def torchft_throughput(steps: int, tmp: Path, timeout: float = 300) -> dict:
    """Two replicas for ``steps`` steps; ``wall_clock_rate`` of replica 0's commits."""
    with TorchFTJob(tmp) as job:
        for i in (0, 1):
            job.launch(i, steps)
        deadline = time.monotonic() + timeout
        for proc in job.replicas.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        job.check()
        recs = read_steps(job.out)
    try:
        return wall_clock_rate(recs, 2, GLOBAL_BATCH)
    except ValueError as exc:
        raise RuntimeError(f"torchft: {exc} in {tmp}") from None


# -- Tidal's side and the rows --------------------------------------------------------------
def measure(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    from bench import capacity, recovery, throughput

    kills, joins = size["kills"], size["cap_joins"]
    steps, reps = size["tput_steps"], size["tput_reps"]
    for d in ("tidal-recovery", "tidal-join", "torchft-recovery"):
        (tmp / d).mkdir(parents=True)
    t_rec = recovery.tidal_recovery(kills, tmp / "tidal-recovery")
    log(f"tidal recovery (s): {[round(p, 3) for p in t_rec['recovery_s']]}")
    t_join = capacity.tidal_capacity(joins, tmp / "tidal-join", spares=0)
    p_rec = torchft_recovery(kills, joins, tmp / "torchft-recovery")
    t_rate, p_rate = [], []
    for rep in range(reps):
        d = tmp / f"tput-{rep}"
        d.mkdir()
        for which in ("tidal", "torchft") if rep % 2 == 0 else ("torchft", "tidal"):
            if which == "tidal":
                t_rate.append(throughput.run_tidal(2, steps, d, 300))
            else:
                p_rate.append(torchft_throughput(steps, d / "torchft"))
        log(f"throughput rep {rep}: tidal {t_rate[-1]['samples_per_s']:.0f}, torchft "
            f"{p_rate[-1]['samples_per_s']:.0f} samples/s")  # fmt: skip

    a, b = t_rec["recovery_s"], p_rec["recovery_s"]
    c, d = t_join["join_to_step_s"], p_rec["join_s"]
    e, f = [r["samples_per_s"] for r in t_rate], [r["samples_per_s"] for r in p_rate]
    cfg = torchft_config
    rows = [
        row("torchft_recovery", percentile(a, 50), percentile(b, 50), "s",
            higher_is_better=False, peer_name="torchft", tidal_samples=a, peer_samples=b,
            peer_config=cfg("SIGKILL of one of 2 replicas (a replacement launched at once, as "
                            "Tidal's restart): the last committed step before the kill to the "
                            "survivor's first committed step in a quorum without it (world 1); Tidal: recovery_p50's "
                            "pause_s, the same moments")),
        row("torchft_join", percentile(c, 50), percentile(d, 50), "s",
            higher_is_better=False, peer_name="torchft", tidal_samples=c, peer_samples=d,
            peer_config=cfg("1 -> 2 replicas: a new replica's launch to the first step "
                            "committed at 2; Tidal: time_to_capacity_cold (tidal scale to the "
                            "first step at 2, a cold joiner process)")),
        row("torchft_throughput", statistics.median(e), statistics.median(f), "samples/s",
            higher_is_better=True, peer_name="torchft", tidal_samples=e, peer_samples=f,
            peer_config=cfg(f"2 replicas, {steps} steps, global batch {GLOBAL_BATCH}: "
                            "wall-clock samples/s of replica 0's commits at 2 past the first "
                            "fifth, runs alternating with Tidal's; Tidal: throughput_ws2")),
    ]  # fmt: skip
    raw = {
        "tidal": {"recovery": t_rec, "join": t_join, "throughput": t_rate},
        "torchft": {**p_rec, "throughput": p_rate},
        "recovery_same_world": {
            "tidal_back_at_2_s": t_rec["back_at_2_s"],
            "torchft_back_at_2_s": p_rec["back_at_2_s"],
        },  # fmt: skip
    }
    return rows, raw
