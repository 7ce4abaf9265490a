"""What a resize costs with DataLoader workers prefetching: ``bench/train_loader.py`` (the bench
MLP, ~2 ms of CPU per sample) under ``tidal run --workers 2 --max-workers 3 --schedule``
with resizes 2 -> 3 -> 2 ..., once per loading setting (``num_workers`` 0, 1, and 1 with
``persistent_workers``). A resize drops what the workers had prefetched for the old
membership; the first step after it waits for a fresh fetch (and, without persistent
workers, for new worker processes).

For each setting: the median ``pause_s`` of the resizes (``tidal status --json``: from the
last step before the change to the end of the first step after it), the median of its
``first_step_s`` phase, and the median ordinary step at 2 and 3 workers. Not part of
``python -m bench``; run it alone: ``python -m bench.dataloader_rescale [EVENTS]``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import Procs, log, median_step, read_records, tidal_cmd
from bench.dataloader import SCRIPT
from bench.rescale import tidal_status

SETTINGS = {
    "num_workers=0": ["--num-workers", "0"],
    "num_workers=1": ["--num-workers", "1"],
    "num_workers=1, persistent": ["--num-workers", "1", "--persistent-workers"],
}


def pauses(setting: str, events: int, tmp: Path, *, first: int = 80, spacing: int = 12) -> dict:
    schedule = ",".join(f"{first + i * spacing}:{3 if i % 2 == 0 else 2}" for i in range(events))
    steps = first + events * spacing + 10
    home, name, out = tmp / "home", "loader-rescale", tmp / "records"
    procs = Procs()
    try:
        proc = procs.start(
            tidal_cmd(home, name, "--workers", "2", "--max-workers", "3", "--schedule", schedule)
            + [str(SCRIPT), "--mode", "tidal", "--steps", str(steps), "--out", str(out)]
            + SETTINGS[setting],
            tmp / "tidal.log",
        )
        rc = proc.wait(timeout=120 + steps * 1.0)
    finally:
        procs.cleanup()
    if rc != 0:
        raise RuntimeError(f"tidal run exited {rc}; see {tmp}")
    gens = sorted(tidal_status(home, name)["generations"], key=lambda g: g["id"])[1:]
    gens = [g for g in gens if g["pause_s"] is not None]
    recs = read_records(out)
    step = {w: median_step(recs, w) for w in (2, 3)}
    first_steps = [g["pause_phases"]["first_step_s"] for g in gens if g.get("pause_phases")]
    return {
        "pause_p50_s": statistics.median(g["pause_s"] for g in gens),
        "up_p50_s": statistics.median(g["pause_s"] for g in gens if g["world_size"] == 3),
        "down_p50_s": statistics.median(g["pause_s"] for g in gens if g["world_size"] == 2),
        "first_step_p50_s": statistics.median(first_steps) if first_steps else None,
        "step_s": step,
        "pauses_s": [g["pause_s"] for g in gens],
    }


def main() -> None:
    events = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    results = {}
    with tempfile.TemporaryDirectory(prefix="tidal-bench-") as t:
        for setting in SETTINGS:
            d = Path(t) / setting.replace(", ", "-").replace("=", "")
            d.mkdir()
            results[setting] = r = pauses(setting, events, d)
            log(
                f"{setting}: pause p50 {r['pause_p50_s'] * 1e3:.0f} ms (up "
                f"{r['up_p50_s'] * 1e3:.0f}, down {r['down_p50_s'] * 1e3:.0f}), first step "
                f"{(r['first_step_p50_s'] or float('nan')) * 1e3:.0f} ms, ordinary step "
                f"{r['step_s'][2] * 1e3:.0f} ms at 2, {r['step_s'][3] * 1e3:.0f} ms at 3"
            )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
