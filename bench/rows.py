"""The bench's rows and the pure decisions behind them.

A row is ``{name, tidal, peer, ratio, unit, peer_name, peer_config}`` (the JSON contract,
DESIGN.md section 4): ``ratio`` above 1 when Tidal is better (Tidal / peer for rates,
peer / Tidal for times), ``peer_name`` who the peer is (``torchrun``, ``torchft``, ``ddp``,
``dcp.async_save``, ``floor``, ...; ``none`` where nothing is compared, with the reason in
``peer_config``), ``peer_config`` how it was configured. A row may carry the raw samples
behind its two numbers under ``_samples`` (kept for the results file, dropped from the
``--json`` rows by ``public``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

FIELDS = ("name", "tidal", "peer", "ratio", "unit", "peer_name", "peer_config")


def _num(v: float | None) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def row(
    name: str,
    tidal: float | None,
    peer: float | None,
    unit: str,
    *,
    higher_is_better: bool,
    peer_name: str,
    peer_config: str | dict,
    tidal_samples: Sequence[float] | None = None,
    peer_samples: Sequence[float] | None = None,
) -> dict:
    """One result; ``ratio`` above 1 always means Tidal is better, None when either side
    is missing (a peer named ``none`` has no number)."""
    ratio = None
    if _num(tidal) and _num(peer):
        if higher_is_better:
            ratio = tidal / peer if peer > 0 else float("nan")
        else:
            ratio = peer / tidal if tidal > 0 else float("nan")
    r = {"name": name, "tidal": tidal, "peer": peer, "ratio": ratio, "unit": unit,
         "peer_name": peer_name, "peer_config": peer_config}  # fmt: skip
    if tidal_samples is not None or peer_samples is not None:
        r["_samples"] = {"tidal": list(tidal_samples or []), "peer": list(peer_samples or [])}
    return r


def failed(name: str, unit: str, peer_name: str = "-", reason: str = "") -> dict:
    """The row of a measurement that could not be taken: no numbers, the reason."""
    return row(name, None, None, unit, higher_is_better=False, peer_name=peer_name,
               peer_config=reason or "not measured")  # fmt: skip


def public(r: dict) -> dict:
    """The row as the ``--json`` contract has it (no raw samples)."""
    return {k: r.get(k) for k in FIELDS}


def summary(samples: Sequence[float]) -> dict:
    """n, min, p50, p90, max of raw samples (empty: just n = 0)."""
    xs = sorted(x for x in samples if _num(x))
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "min": xs[0], "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "max": xs[-1]}  # fmt: skip


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# -- decisions -------------------------------------------------------------------------------
def split_by_direction(generations: Sequence[dict]) -> tuple[list[float], list[float]]:
    """(joins, leaves): the ``pause_s`` of each generation larger than the one before it
    (a join) and of each smaller one (a leave), in id order; the first generation, equal
    sizes and generations without a pause are neither."""
    gens = sorted(generations, key=lambda g: g["id"])
    joins, leaves = [], []
    for prev, g in zip(gens, gens[1:], strict=False):
        if g.get("pause_s") is None:
            continue
        if g["world_size"] > prev["world_size"]:
            joins.append(g["pause_s"])
        elif g["world_size"] < prev["world_size"]:
            leaves.append(g["pause_s"])
    return joins, leaves


def back_at_world(recs: Sequence, t_kill: float, world: int) -> tuple[float, float] | None:
    """After a kill at ``t_kill``: (the last step end before it, the first step end at
    ``world`` members by a process that did not exist before it) from step records
    (``bench.common.Rec``). A replacement's first step is the group's first at full size
    again: Tidal's replacement joining the survivor, torchrun's restarted workers. None
    until that step."""
    e = [r for r in recs if r.kind == "E"]
    before = [r for r in e if r.time < t_kill]
    if not before:
        return None
    old = {r.pid for r in before}
    after = [r for r in e if r.time > t_kill and r.world == world and r.pid not in old]
    if not after:
        return None
    return max(r.time for r in before), min(r.time for r in after)


def wall_clock_rate(recs: Sequence, world: int, batch: int, skip: float = 0.2) -> dict:
    """Rank 0's steps at ``world`` members past the first ``skip`` of them: samples/s over
    the wall-clock window from the first counted step end to the last, every step in it
    counted (``steps`` intervals of ``batch`` samples), and the median step beside it.
    Raises ValueError with fewer than 3 steps."""
    e = sorted((r for r in recs if r.kind == "E" and r.rank == 0 and r.world == world),
               key=lambda r: r.time)  # fmt: skip
    e = e[int(len(e) * skip) :]
    if len(e) < 3:
        raise ValueError(f"too few steps at {world} members ({len(e)})")
    span = e[-1].time - e[0].time
    steps = len(e) - 1
    diffs = [b.time - a.time for a, b in zip(e, e[1:], strict=False)]
    return {"samples_per_s": steps * batch / span, "steps": steps, "span_s": span,
            "median_step_s": statistics.median(diffs)}  # fmt: skip
