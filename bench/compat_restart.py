"""The pause of a restart-based membership change on an unmodified torchrun script
(``examples/ddp_torchrun.py``: its own snapshot, ``DistributedSampler``, ``env://``),
Tidal's ``--torchrun`` against torchrun's own (issue 55, ``compat_restart``).

Tidal: ``tidal run --torchrun --workers 1 --max-workers 2 SCRIPT``, then ``scale 2`` and
``scale 1`` in turn (through the job's API from this process: no CLI interpreter beside the
workers), ``changes`` changes. Peer: torchrun elastic, one agent per node (``--nnodes=1:2
--nproc-per-node=1``, the c10d rendezvous tuned as ``bench.peers``): a second agent joins
(1 -> 2) and leaves (SIGTERM to it: 2 -> 1). Both restart every worker at each change, and
every new worker loads the script's snapshot.

The pause has one definition for both: from rank 0's last step before the change to the
first step at the new size, from the script's own step records (``--record``); so it holds
the stop, the fresh processes' start, the script's imports, its snapshot's load, the
process group's forming and the first step.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from bench.common import (
    ROOT,
    TORCHRUN_ENV,
    Procs,
    free_port,
    log,
    median,
    tidal_cmd,
    torchrun_cmd,
    wait_until,
)
from bench.peers import torchrun_opts

SCRIPT = ROOT / "examples" / "ddp_torchrun.py"
#: The script's settings in both runs: steps of a few ms, a snapshot every 20 steps.
SCRIPT_ARGS = ("--max-steps", "10000000", "--sleep", "0.005", "--save-every", "20")


def steps(log_path: Path) -> list[tuple[float, int]]:
    """(time, world) of each step rank 0 logged, in order."""
    out = []
    try:
        lines = log_path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line being written, or cut by a kill
        if "step" in r:
            out.append((r["t"], r["world"]))
    return out


def gap(log_path: Path, since: float, world: int) -> tuple[float, float] | None:
    """(the last step at another size, the first step at ``world`` after ``since``)."""
    recs = steps(log_path)
    after = [t for t, w in recs if t > since and w == world]
    if not after:
        return None
    before = [t for t, w in recs if t < after[0] and w != world]
    return (before[-1], after[0]) if before else None


def steps_after(log_path: Path, t0: float) -> int:
    return sum(1 for t, _ in steps(log_path) if t > t0)


def tidal_pauses(changes: int, tmp: Path, timeout: float = 120) -> dict:
    from tidal.lookup import running_client

    home, name, out = tmp / "home", "compat", tmp / "tidal.jsonl"
    args = ["--snapshot", str(tmp / "tidal.pt"), "--record", str(out), *SCRIPT_ARGS]
    cmd = tidal_cmd(home, name, "--torchrun", "--workers", "1", "--max-workers", "2")
    procs = Procs()
    pauses: dict[int, list[float]] = {1: [], 2: []}
    try:
        procs.start([*cmd, str(SCRIPT), *args], tmp / "tidal-run.log")
        wait_until(lambda: len(steps(out)) > 30, timeout, "tidal's first steps")
        for i in range(changes):
            world = 2 if i % 2 == 0 else 1
            client = running_client(home, name)
            t0 = time.time()
            try:
                client.scale(world)
            finally:
                client.close()
            last, first = wait_until(lambda t=t0, w=world: gap(out, t, w), timeout, f"at {world}")
            pauses[world].append(first - last)
            log(f"tidal --torchrun to {world}: pause {first - last:.2f} s")
            wait_until(lambda f=first: steps_after(out, f) > 30, timeout, "steps after it")
    finally:
        procs.cleanup()
    return {"up_s": pauses[2], "down_s": pauses[1], "pauses_s": pauses[2] + pauses[1]}


def peer_pauses(changes: int, tmp: Path, timeout: float = 120) -> dict:
    out, port = tmp / "peer.jsonl", free_port()
    args = ["--snapshot", str(tmp / "peer.pt"), "--record", str(out), *SCRIPT_ARGS]

    def agent(tag: str, procs: Procs):
        opts = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench-compat",
                *torchrun_opts(), "--max-restarts=100"]  # fmt: skip
        return procs.start(
            torchrun_cmd(*opts, str(SCRIPT), *args), tmp / f"agent-{tag}.log", TORCHRUN_ENV
        )

    pauses: dict[int, list[float]] = {1: [], 2: []}
    procs = Procs()
    try:
        agent("a", procs)
        wait_until(lambda: len(steps(out)) > 30, timeout, "torchrun's first steps")
        b = None
        for i in range(changes):
            world = 2 if i % 2 == 0 else 1
            t0 = time.time()
            if world == 2:
                extra = Procs()
                extra.marker = procs.marker  # cleaned up with the others
                b = agent(f"b{i}", extra)
                procs.popens.append(b)
            else:
                Procs.signal_group(b, signal.SIGTERM)
            last, first = wait_until(lambda t=t0, w=world: gap(out, t, w), timeout, f"at {world}")
            pauses[world].append(first - last)
            log(f"torchrun to {world}: pause {first - last:.2f} s")
            wait_until(lambda f=first: steps_after(out, f) > 30, timeout, "steps after it")
    finally:
        procs.cleanup()
    return {"up_s": pauses[2], "down_s": pauses[1], "pauses_s": pauses[2] + pauses[1]}


def main() -> None:
    """``python -m bench.compat_restart [CHANGES]``: both, printed."""
    import sys
    import tempfile

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with tempfile.TemporaryDirectory() as t:
        (Path(t) / "tidal").mkdir()
        (Path(t) / "peer").mkdir()
        a = tidal_pauses(n, Path(t) / "tidal")
        b = peer_pauses(n, Path(t) / "peer")
    print(f"tidal --torchrun p50 {median(a['pauses_s']):.3f} s: {a}")
    print(f"torchrun        p50 {median(b['pauses_s']):.3f} s: {b}")


if __name__ == "__main__":
    main()
