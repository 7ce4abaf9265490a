"""The checks after a trial's job ended (the order and meaning: ``trial.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from e2e_helpers import relative_l2

from bench.chaos.records import OVERLAPPED, Event, TrialFailure

EXACT = 1e-12
JOIN_BOUND_S = 2.0  # a join with no fault before it (``kinds.LOST_S``)


def params(s: dict, out: Path, reference: Path, max_steps: int) -> None:
    """Every member of the last generation that exited normally wrote its parameters
    (one killed at the very end is excused), and every file written equals the
    reference."""
    last = set(s["generations"][-1]["members"])
    exited = sorted(w["id"] for w in s["workers"] if w["id"] in last and w["exit_code"] == 0)
    files = sorted(out.glob("worker-*.safetensors"))
    wrote = sorted(int(f.stem.split("-")[1]) for f in files)
    if not files or not set(exited) <= set(wrote):
        raise TrialFailure(
            "params", f"members {exited} exited normally, parameters written by {wrote}"
        )
    for f in files:
        facts = json.loads(f.with_suffix(".json").read_text())
        if facts["step"] != max_steps:
            raise TrialFailure("params", f"{f.name}: final step {facts['step']}")
        rel = relative_l2(f, reference)
        if not rel <= EXACT:
            raise TrialFailure("params", f"{f.name} differs from the 1-worker run: {rel:.3e}")


def cause(g: dict, events: list[Event]) -> Event | None:
    """The fault a generation is charged to: among those injected before it opened and that
    hit the worker its reason names, the one with the largest bound ("worker 0 failed
    (missed heartbeats)": the SIGSTOP of worker 0, even if a later fault overlapped it or
    hit the stopped worker again), else the newest."""
    before = [e for e in events if e.time <= g["opened_at"] + 0.05]
    named = re.match(r"worker (\d+) ", g["reason"])
    if named:
        hit = re.compile(rf"\bworker[ =]{named[1]}\b")
        mine = [e for e in before if any(hit.search(f) for f in e.faults)]
        if mine:
            return max(reversed(mine), key=lambda e: e.bound_s)  # ties: the newest
    return before[-1] if before else None


def overlap_since(events: list[Event]) -> dict[int, float]:
    """For each event (by position), when the stall it may extend began: its own time, or,
    if the fault before it came before full recovery, that fault's stall's beginning."""
    since: dict[int, float] = {}
    for i, e in enumerate(events):
        chained = i > 0 and OVERLAPPED in events[i - 1].notes
        since[i] = since[i - 1] if chained else e.time
    return since


def stall_bounds(events: list[Event]) -> list[float]:
    """Each event's bound on the stall measured after it: its own, or the largest of the
    faults it overlapped, if larger (a fault that came before full recovery from one before
    it finds that one's stall still going on). Seeds 320000038 and 320000080: a member
    SIGSTOPped (5 s), then a coordinator's (2 s) or another worker's SIGKILL (2 s); the
    stopped member is found by its missed heartbeats 3.3 s and 2.0 s into the later fault's
    window (a restarted coordinator starts every heartbeat clock afresh)."""
    bounds: list[float] = []
    for i, e in enumerate(events):
        chained = i > 0 and OVERLAPPED in events[i - 1].notes
        bounds.append(max(e.bound_s, bounds[-1]) if chained else e.bound_s)
    return bounds


def pauses(s: dict, events: list[Event]) -> list[dict]:
    """Each generation's pause against the bound of the fault it is charged to (``cause``;
    a join with no fault before it: ``JOIN_BOUND_S``). A pause is measured from the job's
    last step before it, so when that fault came before an earlier one was recovered from,
    its bound counts from its own injection: the bound plus the time the stall had already
    lasted (seed 100000103: a member SIGSTOPped, then 2 s later another one)."""
    pauses, worst = [], None
    since = overlap_since(events)
    for g in s["generations"]:
        if g["pause_s"] is None:
            continue
        event = cause(g, events)
        bound = max(event.bound_s, JOIN_BOUND_S) if event else JOIN_BOUND_S
        if event is not None:
            bound = round(bound + event.time - since[events.index(event)], 3)
        rec = {
            "gen": g["id"],
            "reason": g["reason"],
            "pause_s": round(g["pause_s"], 3),
            "bound_s": bound,
            "fault": event.kind if event else None,
        }
        pauses.append(rec)
        if g["pause_s"] > bound and worst is None:
            worst = rec
    for e, bound in zip(events, stall_bounds(events), strict=True):
        if e.stall_s is not None and e.stall_s > bound and worst is None:
            worst = {"fault": e.kind, "stall_s": round(e.stall_s, 2), "bound_s": bound}
    if worst is not None:
        raise TrialFailure("pause", json.dumps(worst))
    return pauses
