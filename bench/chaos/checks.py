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
    reference: the parameters, momentum and EMA weights within ``EXACT``, the scheduler's
    and the scaler's state and the EMA's count exactly."""
    last = set(s["generations"][-1]["members"])
    exited = sorted(w["id"] for w in s["workers"] if w["id"] in last and w["exit_code"] == 0)
    files = sorted(out.glob("worker-*.safetensors"))
    wrote = sorted(int(f.stem.split("-")[1]) for f in files)
    if not files or not set(exited) <= set(wrote):
        raise TrialFailure(
            "params", f"members {exited} exited normally, parameters written by {wrote}"
        )
    expected = json.loads(reference.with_suffix(".json").read_text())
    for f in files:
        facts = json.loads(f.with_suffix(".json").read_text())
        if facts["step"] != max_steps:
            raise TrialFailure("params", f"{f.name}: final step {facts['step']}")
        for key in ("scheduler", "scaler", "ema_averaged"):
            if facts[key] != expected[key]:
                raise TrialFailure(
                    "params", f"{f.name}: {key} {facts[key]}, the 1-worker run's {expected[key]}"
                )
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


def consumed(lines: list[str]) -> dict[int, list[int]]:
    """Each step's sample ids from members' ``STEP GENERATION ID ...`` lines
    (``train.py``), taken from the step's newest generation (an attempt that failed is
    redone in a later one; a resumed job redoes steps after its checkpoint in a later one
    too) and, within it, each member's last line. ``lines`` are ``(member, line)`` pairs
    joined as ``"MEMBER:line"``."""
    newest: dict[int, tuple[int, dict[str, list[int]]]] = {}
    for entry in lines:
        member, line = entry.split(":", 1)
        step, gen, *ids = line.split()
        key, g = int(step), int(gen)
        held = newest.get(key)
        if held is None or g > held[0]:
            newest[key] = held = (g, {})
        if g == held[0]:
            held[1][member] = [int(i) for i in ids]
    return {k: [i for ids in by.values() for i in ids] for k, (_, by) in newest.items()}


def samples(out: Path, reference: Path, max_steps: int) -> None:
    """Exactly-once consumption across the job's history: every step from 0 to the last
    consumed the same sample ids as the 1-worker run's step (its members' shares disjoint),
    and each epoch's window of ``dataset_size`` consumed ids holds each id once."""
    size = json.loads(reference.with_suffix(".json").read_text())["dataset_size"]
    mine = consumed(
        [f"{f.stem}:{line}" for f in out.glob("samples-worker-*.txt") for line in _lines(f)]
    )
    (ref_file,) = reference.parent.glob("samples-worker-*.txt")
    ref = consumed([f"alone:{line}" for line in _lines(ref_file)])
    history: list[int] = []
    for step in range(max_steps):
        got, want = mine.get(step), ref[step]
        if got is None:
            raise TrialFailure("samples", f"no member recorded the samples of step {step}")
        if len(got) != len(set(got)):
            raise TrialFailure("samples", f"step {step}: a sample consumed twice: {sorted(got)}")
        if sorted(got) != sorted(want):
            raise TrialFailure(
                "samples", f"step {step}: consumed {sorted(got)}, the 1-worker run {sorted(want)}"
            )
        history += got
    for start in range(0, len(history), size):
        window = history[start : start + size]
        if len(window) != len(set(window)):
            raise TrialFailure("samples", f"epoch {start // size}: a sample consumed twice")


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]
