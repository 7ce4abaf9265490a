"""The results table of docs/benchmarks.md, made from results files, never typed by hand.

``python -m bench.page A.json B.json`` prints, in Markdown, one row per measurement of the
runs ``A`` and ``B`` (``bench/results/<date>-<commit>.json``): Tidal's value, the peer's and
the ratio in each run (above 1 when Tidal is better), the peer's name, and the goal with
whether each run met it (``bench.__main__.met``; a goal that needs a run's details, such as
the steps a recovery lost, is judged on the row's values alone)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def table(runs: list[dict]) -> str:
    """The Markdown table of ``runs`` (each a results file's content), rows in the first
    run's order, then any row only a later run has."""
    from bench.__main__ import GOALS, met

    names: list[str] = []
    for run in runs:
        names += [r["name"] for r in run["rows"] if r["name"] not in names]
    labels = [run["commit"] for run in runs]
    if len(set(labels)) < len(labels):  # runs of one commit: numbered in the given order
        labels = [f"{label} ({i})" for i, label in enumerate(labels, 1)]
    head = ["row", "peer"]
    for label in labels:
        head += [f"{label}: Tidal", f"{label}: peer", f"{label}: ratio"]
    head += ["unit", "goal"]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * 2 + "---:|" * 3 * len(runs) + "---|---|",
    ]
    for name in names:
        cells, unit, peer, marks = [f"`{name}`"], "", "", []
        row_cells = []
        for run in runs:
            r = next((r for r in run["rows"] if r["name"] == name), None)
            if r is None:
                row_cells += ["", "", ""]
                continue
            unit, peer = r["unit"], r.get("peer_name", "")
            row_cells += [fmt(r["tidal"]), fmt(r["peer"]), fmt(r["ratio"])]
            ok = met(r, {}) if name in GOALS else None
            marks.append("" if ok is None else ("met" if ok else "NOT met"))
        goal = GOALS.get(name, "")
        said = " / ".join(m for m in marks if m)
        cells += [peer, *row_cells, unit, f"{goal} ({said})" if goal and said else goal]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results files, oldest first")
    args = parser.parse_args()
    print(table([json.loads(p.read_text()) for p in args.results]))


if __name__ == "__main__":
    main()
