"""``python -m bench.chaos --faults N --seed S --json FILE``: a chaos campaign.

Runs trials (real jobs of ``bench/chaos/train.py`` under ``tidal run --detach``, each in a
fresh ``--home``) and injects seeded random faults (``kinds.py``) until ``N`` faults were
injected; after every trial it checks the outcome, the processes, the parameters against a
1-worker reference and the pauses (``trial.py``). ``--replay SEED`` runs the one trial of
that seed again (a failed trial's record gives the exact command). The JSON has
``faults_injected``, ``clean_recoveries`` (faults of trials that passed every check),
``trials``, ``failed_trials`` (one record each: seed, faults, the check that failed and
why, the replay command, the job's status and log tails), the bounds, a tally by kind and
a line per trial, and the commit it measured; it is rewritten after every trial.
``--resume`` continues a campaign from its JSON (a long campaign spans sessions: it must be
the same command on the same commit). Exit 0 when every trial passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.chaos.campaign import commit, log, reference, report, run_trial, trial_seed
from bench.chaos.kinds import KINDS
from bench.chaos.records import Settings, TrialResult
from bench.chaos.trial import ROOT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=40, help="faults to inject (default 40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay", type=int, metavar="SEED", help="run the one trial of this seed")
    p.add_argument("--json", metavar="FILE", help="write the report here")
    p.add_argument(
        "--kinds",
        help=f"comma-separated subset of {','.join(KINDS)} (default: all)",
    )
    p.add_argument("--max-steps", type=int, default=Settings.max_steps)
    p.add_argument("--heartbeat-timeout", type=float, default=Settings.heartbeat_timeout_s)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the campaign whose --json FILE exists (same checkout, same arguments)",
    )
    p.add_argument("--workdir", help="where trials run (default: a temporary folder)")
    p.add_argument("--keep-failed", metavar="DIR", help="copy each failed trial's folder here")
    p.add_argument(
        "--debug", action="store_true", help="TIDAL_DEBUG=1 in the jobs (a membership trace)"
    )
    args = p.parse_args(argv)
    argv = [a for a in argv if a != "--resume"]  # the campaign's command, resumed or not
    version = commit()
    kinds = None
    if args.kinds:
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            p.error(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    if args.faults < 1:
        p.error("--faults must be at least 1")
    earlier = _earlier(p, args, argv, version)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )  # the training script imports tidal from this checkout
    settings = Settings(
        max_steps=args.max_steps, heartbeat_timeout_s=args.heartbeat_timeout, debug=args.debug
    )
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tidal-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    keep = Path(args.keep_failed) if args.keep_failed else None
    results = [TrialResult.from_record(rec) for rec in earlier.get("trial_log", [])]
    started = time.monotonic() - earlier.get("elapsed_s", 0.0)
    ref = reference(settings, workdir)
    log(f"reference: {ref}")
    index = len(results)
    if results:
        log(f"resumed after {index} trials, {sum(r.faults for r in results)} faults")
    seed = None if args.replay is not None else args.seed
    done = report(results, seed=seed, settings=settings, started=started, argv=argv)
    done |= {"commit": version}
    while sum(r.faults for r in results) < args.faults:
        trial = args.replay if args.replay is not None else trial_seed(args.seed, index)
        budget = args.faults - sum(r.faults for r in results)
        r = run_trial(trial, settings, kinds, budget, workdir, ref, keep)
        results.append(r)
        index += 1
        done = report(results, seed=seed, settings=settings, started=started, argv=argv)
        done |= {"commit": version}
        why = "ok" if r.ok else f"FAILED {r.failure.check}: {r.failure.detail[:300]}"
        log(
            f"trial {index} (seed {trial}): {r.faults} faults "
            f"({', '.join(e.kind for e in r.events) or 'none'}) in {r.seconds:.0f} s, "
            f"{r.leaver_skips} leavers before their update: {why}; "
            f"total {done['faults_injected']}/{args.faults} faults, "
            f"{done['clean_recoveries']} clean, {len(done['failed_trials'])} failed trials"
        )
        if args.json:
            tmp = Path(args.json + ".tmp")
            tmp.write_text(json.dumps(done, indent=1))
            os.replace(tmp, args.json)
        if args.replay is not None or (r.faults == 0 and index > 3 * max(1, args.faults)):
            break
    print(
        json.dumps({k: done[k] for k in ("faults_injected", "clean_recoveries", "trials")}),
        flush=True,
    )
    return 0 if not done["failed_trials"] else 1


def _earlier(
    p: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str], version: str
) -> dict:
    """With ``--resume``: the report to continue, once it is known to be this campaign's
    (the same arguments and the same commit: a campaign measures one version)."""
    if not args.resume:
        return {}
    if not args.json or args.replay is not None:
        p.error("--resume needs --json FILE (the report to continue) and no --replay")
    try:
        done = json.loads(Path(args.json).read_text())
    except (OSError, ValueError) as exc:
        p.error(f"--resume: cannot read {args.json}: {exc}")
    if done.get("commit") != version:
        p.error(f"--resume: {args.json} is of commit {done.get('commit')}, this is {version}")
    if done.get("command") != "python -m bench.chaos " + " ".join(argv):
        p.error(f"--resume: {args.json} was made by another command: {done.get('command')}")
    failed = {r["seed"]: r for r in done.get("failed_trials", [])}
    done["trial_log"] = [failed.get(r["seed"], r) for r in done.get("trial_log", [])]
    return done


if __name__ == "__main__":
    sys.exit(main())
