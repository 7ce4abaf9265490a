"""Write the capacity traces of this folder (deterministic: the same bytes every run).

    python examples/traces/make_traces.py

Every trace is a model, not a recording (see docs/policies.md). Prices are dollars per
worker-hour of a V100 GPU: about $0.92 is a usual spot level (70% off), $3.06 the
on-demand price (AWS p3.2xlarge, us-east-1); capacities are whole 8-GPU nodes.

The development set (``MARKETS``), one week each (a row every 5 minutes unless said),
one market shape per trace:

- ``spot.csv`` (10-minute rows): a synthetic spot market; demand follows the US working day
  plus slow noise, raises the price and takes nodes away; bursts of preemptions.
- ``diurnal.csv``: a clean daily cycle: $0.92 at 08:00 UTC up to $2.75 at 20:00, capacity
  128 down to 48 at the peak; quieter weekends.
- ``price-steps.csv``: 32 workers throughout; the price jumps between $0.92, $1.38 and
  $2.53 every 1 to 10 hours.
- ``cheap-then-dear.csv``: 16 workers; $0.92 for 8 hours, then $2.53 (2.75x) for good.
- ``spikes.csv``: 96 workers at about $0.95; every few hours a 10-40 minute spike to the
  on-demand price ($3.06) that also halves the capacity.
- ``scarcity.csv``: long scarcity: only 16 workers (at $1.60) for the first 30 hours and
  again for 20 hours from day 4; 128 at $0.95 otherwise.
- ``flat.csv`` (hourly rows): plentiful and flat, 256 workers at $1.20.
- ``outage.csv``: 128 workers at about $1.00, none at all from 10 minutes to 100 minutes.

``drop.csv`` (not in the set): 3 workers, 1 from 15 s, 3 again from 45 s (a local test).

``python examples/traces/make_traces.py --scale FILE`` writes (not in the repository) the
scale test of docs/policies.md: one week of one-minute rows of ``spot.csv``'s market for
up to 10,000 workers.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADER = "time_s,capacity,price_per_worker_hour"
HOUR = 3600
WEEK_S = 7 * 24 * HOUR
ROW_S = 600
FINE_S = 300
NODE = 8  # GPUs per p3.16xlarge
MAX_GPUS = 128
SPOT, ON_DEMAND = 0.92, 3.06
DEAR = 2.53  # 2.75 x SPOT

Rows = list[tuple[int, int, float]]


def _working_day(t: float) -> float:
    """0..1: the US working day's share of demand at ``t`` (the trace starts on a Monday)."""
    day, hour = divmod(t / 3600.0, 24.0)
    if day >= 5:  # weekend
        return 0.15
    if 14 <= hour < 23:
        return 0.3 + 0.7 * math.sin(math.pi * (hour - 14) / 9)
    return 0.0


def spot_rows(seed: int = 7) -> Rows:
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


def _nodes(gpus: float) -> int:
    return max(0, round(gpus / NODE)) * NODE


def diurnal_rows(seed: int = 11) -> Rows:
    rng = random.Random(seed)
    rows = []
    for t in range(0, WEEK_S + 1, FINE_S):
        day, hour = divmod(t / HOUR, 24.0)
        demand = 0.5 - 0.5 * math.cos(2 * math.pi * (hour - 8) / 24)  # 0 at 08:00, 1 at 20:00
        if day >= 5:
            demand *= 0.4
        demand = min(1.0, max(0.0, demand + rng.gauss(0.0, 0.02)))
        price = round(SPOT + (2.75 - SPOT) * demand, 2)
        rows.append((t, _nodes(MAX_GPUS * (1 - 0.625 * demand)), price))
    return rows


def price_steps_rows(seed: int = 5) -> Rows:
    rng = random.Random(seed)
    levels = (SPOT, 1.38, DEAR)
    rows, t, level = [], 0, 0
    while t <= WEEK_S:
        rows.append((t, 32, levels[level]))
        t += rng.randint(2, 20) * 1800  # 1 to 10 hours
        level = rng.choice([k for k in range(3) if k != level])
    return rows


def cheap_then_dear_rows() -> Rows:
    return [(t, 16, SPOT if t < 8 * HOUR else DEAR) for t in range(0, WEEK_S + 1, FINE_S)]


def spikes_rows(seed: int = 3) -> Rows:
    rng = random.Random(seed)
    rows, spike = [], 0
    for t in range(0, WEEK_S + 1, FINE_S):
        if spike == 0 and t > HOUR and rng.random() < FINE_S / (4 * HOUR):
            spike = rng.randint(2, 8)  # 10 to 40 minutes
        price = round(0.95 + rng.gauss(0.0, 0.02), 2)
        cap = 96
        if spike:
            price, cap, spike = ON_DEMAND, 48, spike - 1
        rows.append((t, cap, price))
    return rows


def scarcity_rows(seed: int = 13) -> Rows:
    rng = random.Random(seed)
    scarce = ((0, 30 * HOUR), (4 * 24 * HOUR, 4 * 24 * HOUR + 20 * HOUR))
    rows = []
    for t in range(0, WEEK_S + 1, FINE_S):
        if any(a <= t < b for a, b in scarce):
            rows.append((t, 16, round(1.60 + rng.gauss(0.0, 0.03), 2)))
        else:
            rows.append((t, 128, round(0.95 + rng.gauss(0.0, 0.02), 2)))
    return rows


def flat_rows() -> Rows:
    return [(t, 256, 1.20) for t in range(0, WEEK_S + 1, HOUR)]


def outage_rows(seed: int = 17) -> Rows:
    rng = random.Random(seed)
    rows = []
    for t in range(0, WEEK_S + 1, FINE_S):
        cap = 0 if 600 <= t < 6000 else 128
        rows.append((t, cap, round(1.00 + rng.gauss(0.0, 0.03), 2)))
    return rows


MARKETS = {
    "spot": spot_rows,
    "diurnal": diurnal_rows,
    "price-steps": price_steps_rows,
    "cheap-then-dear": cheap_then_dear_rows,
    "spikes": spikes_rows,
    "scarcity": scarcity_rows,
    "flat": flat_rows,
    "outage": outage_rows,
}


def scale_rows(seed: int = 23, workers: int = 10_000) -> Rows:
    """One week of one-minute rows, the spot market's shape for up to ``workers``."""
    rng = random.Random(seed)
    noise, burst = 0.0, 0
    rows = []
    for t in range(0, WEEK_S + 1, 60):
        noise = 0.993 * noise + rng.gauss(0.0, 0.02)  # about two hours of memory
        demand = min(1.0, max(0.0, 0.1 + 0.6 * _working_day(t) + noise))
        if burst == 0 and rng.random() < 0.0012:
            burst = rng.randint(10, 60)  # a preemption wave: 10 to 60 minutes
        capacity = round(workers * (1.0 - 0.75 * demand) / 250) * 250  # blocks of 250
        if burst:
            capacity //= 2
            burst -= 1
        price = round(SPOT + (ON_DEMAND - SPOT) * demand**2 + rng.gauss(0.0, 0.005), 3)
        rows.append((t, max(0, capacity), max(0.01, price)))
    return rows


def text(rows: Rows) -> str:
    return "\n".join([HEADER] + [f"{t},{c},{p:.2f}" for t, c, p in rows]) + "\n"


def write(name: str, rows: Rows) -> None:
    (HERE / name).write_text(text(rows), encoding="utf-8")


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--scale":
        Path(sys.argv[2]).write_text(
            "\n".join([HEADER] + [f"{t},{c},{p:.3f}" for t, c, p in scale_rows()]) + "\n",
            encoding="utf-8",
        )
        sys.exit(0)
    for market, make in MARKETS.items():
        write(f"{market}.csv", make())
    write("drop.csv", [(0, 3, 0.92), (15, 1, 0.92), (45, 3, 0.92)])
