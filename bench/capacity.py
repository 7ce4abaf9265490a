"""Time to capacity: from asking for workers to their first step.

``cold_start``: from launching a 2-worker job to its first step, ``tidal run`` against
``torchrun --standalone`` on the same script.

Tidal: ``tidal run --workers 1 --max-workers 2`` on ``bench/train_mlp.py``, then, ``joins``
times, ``tidal scale JOB 2`` and the time until the first step the job makes at world size
2 ends; then ``tidal scale JOB 1`` and some steps at 1 before the next. Cold: the joiner is
a process started by the scale-up (it imports torch and warms up meanwhile). Spare:
``--spares 1`` keeps a registered, warmed standby outside the group, and the scale-up
admits it at the next control-loop pass (a scale-down keeps the leaver as the spare).

Peer: torchrun elastic's join (``bench.rescale.peer_pauses``: a second agent launched to
the second node's first step), the only way torchrun adds capacity to a running job.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench.common import (
    TORCHRUN_ENV,
    TRAIN,
    Procs,
    ends,
    log,
    read_records,
    tidal_cmd,
    torchrun_cmd,
    wait_until,
)


def _cli(*args: str) -> None:
    import contextlib
    import io

    from tidal.cli import main as cli_main

    with contextlib.redirect_stdout(io.StringIO()):  # its one-line answers
        rc = cli_main(list(args))
    if rc != 0:
        raise RuntimeError(f"tidal {' '.join(args)} exited {rc}")


def _status(home: Path, name: str) -> dict:
    from tidal.lookup import get_status

    return json.loads(get_status(home, name).model_dump_json())


def _first_end_at(out: Path, world: int, after: float) -> float | None:
    found = [r.time for r in ends(read_records(out)) if r.world == world and r.time > after]
    return min(found) if found else None


def tidal_capacity(joins: int, tmp: Path, *, spares: int, timeout: float = 120) -> dict:
    """Seconds from ``tidal scale`` to the first step at the new size, per join."""
    home, name, out = tmp / "home", "capacity", tmp / "steps"
    opts = ["--workers", "1", "--max-workers", "2", "--spares", str(spares), "--detach"]
    procs = Procs()
    times: list[float] = []
    try:
        procs.start(
            tidal_cmd(home, name, *opts)
            + [str(TRAIN), "--mode", "tidal", "--steps", "10000000", "--out", str(out)],
            tmp / "tidal-capacity.log",
        ).wait(timeout=60)
        wait_until(lambda: len(ends(read_records(out))) > 20, timeout, "the first steps")
        for j in range(joins):
            if spares:
                wait_until(
                    lambda: _status(home, name)["standby_workers"] >= spares,
                    timeout,
                    "a warm spare",
                )
            t = time.time()
            _cli("scale", "--home", str(home), name, "2")
            first = wait_until(lambda t=t: _first_end_at(out, 2, t), timeout, "a step at 2")
            times.append(first - t)
            log(f"tidal {'spare' if spares else 'cold'} join {j}: {first - t:.3f} s")
            _cli("scale", "--home", str(home), name, "1")
            t = time.time()
            wait_until(
                lambda t=t: (
                    sum(1 for r in ends(read_records(out)) if r.world == 1 and r.time > t) > 10
                ),
                timeout,
                "steps back at 1",
            )
        _cli("stop", "--home", str(home), name)
        wait_until(
            lambda: _status(home, name)["state"] in ("stopped", "failed", "succeeded"),
            timeout,
            "the job's end",
        )
    finally:
        procs.cleanup()  # the detached job too: its processes carry the marker
    return {"join_to_step_s": times, "spares": spares}


def cold_start(tmp: Path, *, reps: int, timeout: float = 120) -> dict:
    """Seconds from launching a 2-worker job to the end of its first step at world size 2:
    ``tidal run --workers 2`` against ``torchrun --standalone --nproc-per-node 2`` on the same
    script, alternating, ``reps`` times each."""
    out: dict[str, list[float]] = {"tidal": [], "torchrun": []}
    for rep in range(reps):
        for tool in ("tidal", "torchrun"):
            steps = tmp / f"{tool}-{rep}"
            if tool == "tidal":
                cmd = tidal_cmd(tmp / f"home-{rep}", f"cold-{rep}", "--workers", "2")
                cmd += [str(TRAIN), "--mode", "tidal"]
            else:
                cmd = torchrun_cmd(
                    "--standalone", "--nproc-per-node=2", str(TRAIN), "--mode", "ddp"
                )
            cmd += ["--steps", "10000000", "--out", str(steps)]
            procs = Procs()
            try:
                t = time.time()
                procs.start(
                    cmd, tmp / f"{tool}-{rep}.log", TORCHRUN_ENV if tool != "tidal" else None
                )
                first = wait_until(
                    lambda s=steps, t=t: _first_end_at(s, 2, t), timeout, f"{tool}'s first step"
                )
            finally:
                procs.cleanup()
            out[tool].append(first - t)
            log(f"cold start {tool} {rep}: {first - t:.2f} s")
    return out


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        print(tidal_capacity(int(sys.argv[1]) if len(sys.argv) > 1 else 2, Path(t), spares=1))
