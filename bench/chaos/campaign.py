"""The campaign: trials until the fault budget is spent, their tally, the JSON report."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from bench.chaos.kinds import FINAL, KINDS, WEIGHTS, bounds
from bench.chaos.records import OVERLAPPED, JobEnded, Settings, TrialFailure, TrialResult
from bench.chaos.trial import ROOT, TRAIN, Trial

EVENTS_PER_TRIAL = (3, 5)
# How often the next fault comes as soon as the job trains again (its replacement may still
# be starting), for the kinds whose fault opens a generation.
OVERLAP = 0.3
OPENS_GENERATION = ("kill", "stop", "term", "point", "joiner", "double")
TRIAL_SEED_STRIDE = 100_000


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def commit() -> str:
    """The checkout's commit (and ``+dirty`` with uncommitted changes), or ``unknown``."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def trial_seed(seed: int, index: int) -> int:
    return seed * TRIAL_SEED_STRIDE + index


def reference(settings: Settings, cache: Path) -> Path:
    """The 1-worker reference: the script alone (``Trainer.run`` outside ``tidal run``
    trains with the same mathematics), once per (seed, steps)."""
    out = cache / f"reference-seed{settings.train_seed}-steps{settings.max_steps}"
    found = sorted(out.glob("worker-*.safetensors"))
    if found:
        return found[0]
    cmd = [sys.executable, str(TRAIN), "--max-steps", str(settings.max_steps)]
    cmd += ["--seed", str(settings.train_seed), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"the reference run failed:\n{proc.stderr[-3000:]}")
    (found,) = out.glob("worker-*.safetensors")
    return found


def _choose(tr: Trial, kinds: Sequence[str], budget: int, planned_left: int) -> str:
    """A kind by weight: ``double`` only if two faults are left in the budget, the kinds
    that end a trial (``FINAL``) only as its last event unless nothing else is allowed."""
    fits = [k for k in kinds if not (k == "double" and budget < 2)] or list(kinds)
    allowed = [k for k in fits if not (k in FINAL and planned_left > 1)] or fits
    return tr.rng.choices(allowed, weights=[WEIGHTS[k] for k in allowed])[0]


def _inject(
    tr: Trial, result: TrialResult, kinds: Sequence[str], budget: int, planned: int
) -> None:
    """Up to ``planned`` events (and ``budget`` faults), each recovered from before the next."""
    limit = tr.settings.max_steps
    attempts = 0
    while result.faults < budget and len(result.events) < planned and attempts < 3 * planned:
        attempts += 1
        if tr.watch.last["step"] > 0.75 * limit:
            result.notes.append(f"job near its end at step {tr.watch.last['step']}")
            return
        kind = _choose(tr, kinds, budget - result.faults, planned - len(result.events))
        tr.watch.idle(tr.rng.uniform(0, 1.0))  # a random moment
        step = tr.watch.last["step"]
        generations = len(tr.watch.last["generations"])
        overlap = tr.rng.random() < OVERLAP  # the next fault comes before full recovery
        event = KINDS[kind](tr)
        if event is None:
            result.notes.append(f"{kind}: not applicable or did not fire")
            tr.settle(step, f"recovery after a {kind} that did not apply")
            continue
        result.events.append(event)
        if event.final:
            return
        what = f"recovery from {kind} ({'; '.join(event.faults)})"
        last = len(result.events) == planned or result.faults >= budget
        if overlap and kind in OPENS_GENERATION and not last:
            event.notes.append(OVERLAPPED)
            tr.training_again(event.time, generations, what)
        else:
            tr.settle_after(event.time, what)
        now = time.time()
        event.recovered_s = round(now - event.time, 2)
        event.stall_s = round(tr.stall(event.time, now), 2)


def run_trial(
    seed: int,
    settings: Settings,
    kinds: Sequence[str] | None,
    budget: int,
    workdir: Path,
    ref: Path,
    keep: Path | None = None,
) -> TrialResult:
    """One trial with at most ``budget`` faults; ``kinds`` None: the defaults."""
    root = workdir / f"trial-{seed}"
    # A trial cut short by a stop of the campaign left its folder (its job's records): the
    # rerun of ``--resume`` starts it anew, not "a job named ... already exists".
    shutil.rmtree(root, ignore_errors=True)
    tr = Trial(seed, settings, root, ref)
    result = TrialResult(seed=seed, setup=tr.setup | {"budget": budget}, events=[])
    # The machine's 1-minute load at the start and the end: a pause bound missed on a
    # machine at load 7 is told apart from one missed on an idle machine.
    result.setup["load"] = [round(os.getloadavg()[0], 1)]
    t0 = time.monotonic()
    planned = tr.rng.randint(*EVENTS_PER_TRIAL)
    try:
        try:
            tr.start()
            result.setup["start_s"] = round(time.monotonic() - t0, 1)
            if kinds is None:
                kinds = list(KINDS)
            result.setup["kinds"] = list(kinds)
            _inject(tr, result, kinds, budget, planned)
        except JobEnded:  # the outcome check says whether that was right
            pass
        status, result.pauses = tr.finish(result.events, result.notes)
        result.state = status["state"]
    except TrialFailure as exc:
        result.failure = exc
    except Exception as exc:  # noqa: BLE001 - the trial's own failure, reported as such
        tb = traceback.format_exception(exc)
        result.failure = TrialFailure("error", "".join(tb[-3:]).strip())
    finally:
        if result.failure is not None:
            result.status_summary, result.logs, result.stacks = tr.describe()
        result.leaver_skips = tr.leaver_skips()
        try:
            tr.close(keep / f"trial-{seed}" if keep is not None and not result.ok else None)
        except Exception as exc:  # noqa: BLE001 - cleanup that failed is a failed check
            if result.failure is None:
                result.failure = TrialFailure("processes", f"cleanup: {exc}")
        result.seconds = time.monotonic() - t0
        result.setup["load"].append(round(os.getloadavg()[0], 1))
    return result


def _tally(results: list[TrialResult]) -> dict:
    by_kind: dict[str, dict] = {}
    for r in results:
        for e in r.events:
            k = by_kind.setdefault(e.kind, {"injected": 0, "clean": 0, "max_stall_s": 0.0})
            k["injected"] += e.count
            k["clean"] += e.count if r.ok else 0
            k["max_stall_s"] = max(k["max_stall_s"], e.stall_s or 0.0)
    pauses = [p for r in results for p in r.pauses]
    for p in pauses:
        k = by_kind.setdefault(p["fault"] or "join", {"injected": 0, "clean": 0})
        k["max_pause_s"] = max(k.get("max_pause_s", 0.0), p["pause_s"])
    return by_kind


def report(
    results: list[TrialResult], *, seed: int | None, settings: Settings, started: float, argv: list
) -> dict:
    failed = [r for r in results if not r.ok]
    return {
        "faults_injected": sum(r.faults for r in results),
        "clean_recoveries": sum(r.faults for r in results if r.ok),
        "trials": len(results),
        "failed_trials": [r.record() for r in failed],
        # Members that left a scale-down before their last update (``tidal/worker/membership/leaving.py``):
        # the campaign exercised that rule this many times.
        "leaver_skips": sum(r.leaver_skips for r in results),
        "expected_failures": sum(1 for r in results if r.ok and r.state == "failed"),
        "trials_with_temporary_checkpoint_folders_left": sum(
            1 for r in results if any(n.startswith("temporary checkpoint") for n in r.notes)
        ),
        "seed": seed,
        "command": "python -m bench.chaos " + " ".join(argv),
        "elapsed_s": round(time.monotonic() - started, 1),
        "settings": settings.__dict__,
        "bounds_s": bounds(settings.heartbeat_timeout_s),
        "by_kind": _tally(results),
        "trial_log": [
            {k: v for k, v in r.record().items() if k not in ("status", "logs", "stacks")}
            for r in results
        ],
    }
