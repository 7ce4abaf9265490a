"""Write the example capacity traces of this folder (deterministic: same files every run).

``spot.csv``: one week, a row every 10 minutes, of a synthetic spot market for V100 GPUs
sold by the 8-GPU node (AWS p3.16xlarge): at most 128 GPUs (16 nodes), the price per
GPU-hour between the usual spot level of about 30% of on-demand ($0.92) and the on-demand
price ($3.06, p3.2xlarge, us-east-1). Demand follows the US working day (higher on
weekdays from 14:00 to 23:00 UTC) plus slow random noise; high demand raises the price and
takes capacity away, and now and then a burst of preemptions halves the capacity for up
to an hour. It is a model, not a recording: see docs/policies.md.

``drop.csv``: 3 workers, down to 1 at 15 s, back to 3 at 45 s (a local acceptance test).

    python examples/traces/make_traces.py
"""

from __future__ import annotations

import math
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADER = "time_s,capacity,price_per_worker_hour"
WEEK_S = 7 * 86400
ROW_S = 600
NODE = 8  # GPUs per p3.16xlarge
MAX_GPUS = 128
SPOT, ON_DEMAND = 0.92, 3.06


def _working_day(t: float) -> float:
    """0..1: the US working day's share of demand at ``t`` (the trace starts on a Monday)."""
    day, hour = divmod(t / 3600.0, 24.0)
    if day >= 5:  # weekend
        return 0.15
    if 14 <= hour < 23:
        return 0.3 + 0.7 * math.sin(math.pi * (hour - 14) / 9)
    return 0.0


def spot_rows(seed: int = 7) -> list[tuple[int, int, float]]:
    rng = random.Random(seed)
    noise, burst = 0.0, 0
    rows = []
    for t in range(0, WEEK_S + 1, ROW_S):
        noise = 0.93 * noise + rng.gauss(0.0, 0.06)  # about an hour of memory
        demand = min(1.0, max(0.0, 0.1 + 0.6 * _working_day(t) + noise))
        if burst == 0 and rng.random() < 0.012:
            burst = rng.randint(1, 6)  # a preemption wave: 10 to 60 minutes
        nodes = round(MAX_GPUS / NODE * (1.0 - 0.75 * demand))
        if burst:
            nodes //= 2
            burst -= 1
        capacity = max(1, min(MAX_GPUS // NODE, nodes)) * NODE
        price = round(SPOT + (ON_DEMAND - SPOT) * demand**2, 2)
        rows.append((t, capacity, price))
    return rows


def write(name: str, rows: list[tuple[int, int, float]]) -> None:
    lines = [HEADER] + [f"{t},{c},{p:.2f}" for t, c, p in rows]
    (HERE / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write("spot.csv", spot_rows())
    write("drop.csv", [(0, 3, 0.92), (15, 1, 0.92), (45, 3, 0.92)])
