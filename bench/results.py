"""Results as data: a run's rows with the facts needed to compare runs.

``write(folder, rows, ...)`` writes ``<folder>/<date>-<commit>.json`` (``-2``, ``-3`` ... for
a later run of the same commit on the same day: ``free_name``; ``record``'s
fields: ``date``, ``commit``, ``dirty``, ``run``, ``measurements``, ``machine`` {``cpus``,
``model``, ``platform``}, ``python``, ``torch``, ``peers`` {peer_name: [configs]},
``rows`` (the contract's rows, each with ``samples`` {tidal, peer}: a summary of its raw
samples, ``bench.rows.summary``), ``errors``) and, when matplotlib is installed, a PNG of
the same name: each row with raw samples (pauses, recoveries, stalls), Tidal's against its
peer's."""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

from bench.rows import public, summary

LOG = logging.getLogger(__name__)
RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROOT = RESULTS_DIR.parents[1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit(root: Path = ROOT) -> tuple[str, bool]:
    """(short commit, whether the tree has uncommitted changes); ("unknown", False)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                capture_output=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, text=True, capture_output=True).stdout.strip()  # fmt: skip
        return commit, bool(dirty)
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def record(rows: list[dict], *, run: str, measurements: list[str], errors: list[str],
           commit: str, dirty: bool, date: str, torch_version: str) -> dict:  # fmt: skip
    """The results file's content (pure: everything variable is passed in)."""
    out_rows, peers = [], {}
    for r in rows:
        pr = public(r)
        raw = r.get("_samples", {})
        pr["samples"] = {k: summary(raw.get(k, [])) for k in ("tidal", "peer")}
        out_rows.append(pr)
        known = peers.setdefault(pr["peer_name"], [])
        if pr["peer_config"] not in known:
            known.append(pr["peer_config"])
    return {
        "date": date,
        "commit": commit,
        "dirty": dirty,
        "run": run,
        "measurements": measurements,
        "machine": {"cpus": os.cpu_count(), "model": cpu_model(), "platform": platform.platform()},
        "python": sys.version.split()[0],
        "torch": torch_version,
        "peers": peers,
        "rows": out_rows,
        "errors": errors,
    }


def write(folder: Path, rows: list[dict], *, run: str, measurements: list[str],
          errors: list[str]) -> Path:  # fmt: skip
    import torch

    commit, dirty = git_commit()
    date = datetime.date.today().isoformat()
    data = record(rows, run=run, measurements=measurements, errors=errors, commit=commit,
                  dirty=dirty, date=date, torch_version=torch.__version__)  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    path = free_name(folder, f"{date}-{commit}")
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    plot(rows, path.with_suffix(".png"))
    return path


def free_name(folder: Path, stem: str) -> Path:
    """``folder/stem.json``, or ``stem-2.json``, ``stem-3.json``, ... for the second and
    later runs of one commit on one day: a run never overwrites another."""
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    return path


def plot(rows: list[dict], path: Path) -> Path | None:
    """Each row with raw samples on both sides: Tidal's and its peer's as two strips of
    points on a log axis. None (and nothing written) without matplotlib or samples."""
    with_samples = [r for r in rows if r.get("_samples", {}).get("tidal")
                    and r["_samples"].get("peer")]  # fmt: skip
    if not with_samples:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        LOG.info("matplotlib not installed: no plot")
        return None
    fig, axes = plt.subplots(len(with_samples), 1, figsize=(7, 1.1 * len(with_samples) + 0.6),
                             squeeze=False)  # fmt: skip
    for ax, r in zip(axes[:, 0], with_samples, strict=True):
        for y, (who, xs) in enumerate((("tidal", r["_samples"]["tidal"]),
                                       (r["peer_name"], r["_samples"]["peer"]))):  # fmt: skip
            xs = [x for x in xs if x and x > 0]
            ax.scatter(xs, [y] * len(xs), s=12, label=who)
        ax.set_yticks([0, 1], ["tidal", r["peer_name"]])
        ax.set_xscale("log")
        ax.set_title(f"{r['name']} ({r['unit']})", fontsize=8, loc="left")
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
