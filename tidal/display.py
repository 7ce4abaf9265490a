"""Terminal output: progress lines while a job runs, tables for status and jobs (rich)."""

from __future__ import annotations

import errno
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tidal.coordinator.rules.checkpoint_rules import final_checkpoint_note, newest_line
from tidal.protocol import JobState, JobStatus, RecoveryPath

if TYPE_CHECKING:
    from tidal.coordinator.control.controller import Coordinator

PROGRESS_EVERY_S = 2.0


def _fmt_time(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%H:%M:%S")


def _since(t: float) -> str:
    """``12:03:44 (1h 02m ago)``: a job's start and its age (its uptime while it runs)."""
    age = max(0, int(time.time() - t))
    h, m, sec = age // 3600, age % 3600 // 60, age % 60
    ago = f"{h}h {m:02d}m" if h else f"{m}m {sec:02d}s" if m else f"{sec}s"
    return f"{_fmt_time(t)} ({ago} ago)"


class _PipeConsole(Console):
    """A console whose closed pipe is an error for its caller (rich's default ends the
    process with ``SystemExit(1)``: a coordinator whose output was piped into ``head`` ended
    its job's supervision, silently)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of stdout is gone")


class Progress:
    """Prints each new event as it happens and a progress line every few seconds.

    ``on_lost(cause)``: called once if the terminal is gone (a closed pipe, a hung-up
    terminal: ``tidal.terminal``); the lines stop then, and the job goes on."""

    def __init__(
        self,
        coord: Coordinator,
        *,
        enabled: bool,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.coord = coord
        self.enabled = enabled
        self.on_lost = on_lost
        self.console = _PipeConsole(highlight=False)
        self._events_seen = 0
        self._last = 0.0

    def update(self, *, final: bool = False) -> None:
        if not self.enabled:
            return
        try:
            self._update(final=final)
        except OSError as exc:
            from tidal.terminal import gone

            if not gone(exc):
                raise
            self.enabled = False  # as with --quiet from here on
            if self.on_lost is not None:
                self.on_lost(errno.errorcode.get(exc.errno or 0, "EPIPE"))

    def _update(self, *, final: bool) -> None:
        now = time.monotonic()
        if not final and now - self._last < 0.25:
            return
        # The state in memory, not the records': they may not take the end (a full disk).
        state = self.coord.job.state if final else None
        events = self._new_events()
        for e in events:
            self.console.print(f"[dim]{_fmt_time(e.time)}[/dim] {e.kind:<10} {escape(e.message)}")
        if final or now - self._last >= PROGRESS_EVERY_S:
            self._last = now
            c = self.coord.job
            m = c.metrics
            parts = [f"step {c.step}", f"world {c.world_size()}/{c.target}"]
            if "samples_per_s" in m:
                parts.append(f"{m['samples_per_s']:.0f} samples/s")
            for key in ("loss", "accuracy"):
                if key in m:
                    parts.append(f"{key} {m[key]:.4g}")
            if state is not None:
                parts.append(state.value)
            self.console.print(f"[bold]{escape(self.coord.spec.name)}[/bold] " + " | ".join(parts))

    def _new_events(self) -> list:
        events = self.coord.executor.db.load_events(self.coord.spec.name, after=self._events_seen)
        self._events_seen += len(events)
        return events


def print_outcome(coord: Coordinator) -> int:
    """How a job that ``tidal run`` hosted ended, in one line on stderr (``--quiet`` too: a
    failure is never silent); returns the exit code (0 only if it succeeded)."""
    name, state = coord.spec.name, coord.job.state
    if state == JobState.SUCCEEDED:
        failed = coord.job.checkpoint_failed
        if failed:
            steps = ", ".join(str(s) for s in sorted(failed))
            last = failed[max(failed)]
            print(
                f"tidal: warning: job {name} succeeded, but {len(failed)} checkpoint(s) could "
                f"not be written (steps {steps}; last: {last})",
                file=sys.stderr,
                flush=True,
            )
        return 0
    note = final_note(coord)
    if state == JobState.FAILED:
        why = coord.job.outcome_why or f"at step {coord.job.step}; see `tidal status {name}`"
        if note is not None and "newest checkpoint" not in why:
            why += f"; {newest_line(newest_on_disk(coord))}"
        line = f"tidal: error: job {name} failed: {why}"
    else:
        line = f"tidal: job {name} {state.value} at step {coord.job.step}"
        if note is not None:
            line += f"; {note}"
    print(line, file=sys.stderr, flush=True)
    return 1


def newest_on_disk(coord: Coordinator) -> int | None:
    """The newest checkpoint's step in the job's checkpoint folder (None: none there)."""
    from tidal.checkpoint.layout import found_on_disk

    if coord.checkpoint_dir is None:
        return None
    try:
        return max((step for step, _, _ in found_on_disk(coord.checkpoint_dir)), default=None)
    except OSError:
        return None


def final_note(coord: Coordinator) -> str | None:
    """What a job's end line adds when its final checkpoint failed (``checkpoint_rules``)."""
    return final_checkpoint_note(
        step=coord.job.step,
        failed=coord.job.checkpoint_failed,
        written=coord.job.checkpointed,
        newest_on_disk=newest_on_disk(coord),
    )


def print_status(s: JobStatus) -> None:
    console = Console(highlight=False)
    summary = Table.grid(padding=(0, 2))
    state = s.state.value
    if s.coordinator_unresponsive:
        state += " (its coordinator is alive but does not answer)"
    summary.add_row("job", f"[bold]{escape(s.name)}[/bold]", "state", escape(state))
    summary.add_row(
        "step",
        str(s.step),
        "workers",
        f"{s.world_size} (target {s.target_workers}, range {s.min_workers}-{s.max_workers}"
        + (f", {s.standby_workers} of {s.spares} spares warm" if s.spares else "")
        + (f", {s.pending_workers} pending: no room in the cluster)" if s.pending_workers else ")"),
    )
    per_1k = f", ${s.cost_per_1k_samples:.4g}/1k samples" if s.cost_per_1k_samples else ""
    projected = f", ~${s.projected_cost:.2f} at the end" if s.projected_cost else ""
    summary.add_row("cost", f"${s.cost:.2f}{per_1k}{projected}", "started", _since(s.created))
    if s.checkpoint_failures:
        summary.add_row(
            "checkpoints",
            f"{s.checkpoint_failures} could not be written; last: "
            + escape(str(s.last_checkpoint_error)),
            "",
            "",
        )
    if s.metrics:
        summary.add_row(
            "metrics", ", ".join(f"{k}={v:.4g}" for k, v in sorted(s.metrics.items())), "", ""
        )
    console.print(summary)
    # Paths and URLs get lines of their own, folded (never cut) when wider than the terminal.
    long = [("script", s.script), ("url", s.url or "-")]
    if s.dashboard_url:
        long += [("dashboard", s.dashboard_url), ("metrics url", s.metrics_url or "-")]
    for label, value in long:
        console.print(f"{label:<12}{escape(value)}", overflow="fold")
    workers = Table(title="workers")
    for col in ("id", "rank", "pid", "state", "node", "exit"):
        workers.add_column(col)
    for w in s.workers:
        workers.add_row(
            str(w.id),
            "-" if w.rank is None else str(w.rank),
            str(w.pid or "-"),
            w.state.value,
            (w.node or "-")[:12],  # Ray node ids are 56 hex digits; 12 tell them apart
            "-" if w.exit_code is None else str(w.exit_code),
        )
    console.print(workers)
    gens = Table(title="generations")
    cols = ("id", "size", "start step", "pause s", "pause phases (ms)", "recovery", "reason")
    for col in cols:
        gens.add_column(col)
    for g in s.generations[-10:]:
        gens.add_row(
            str(g.id),
            str(g.world_size),
            "-" if g.start_step is None else str(g.start_step),
            "-" if g.pause_s is None else f"{g.pause_s:.3f}",
            _phases(g.pause_phases),
            recovery_cell(g.recovery, g.redone_steps),
            escape(g.reason),
        )
    console.print(gens)
    for e in s.events[-8:]:
        console.print(f"[dim]{_fmt_time(e.time)}[/dim] {e.kind:<10} {escape(e.message)}")


def print_jobs(rows: list[JobStatus | str]) -> None:
    """A name alone: a job whose records cannot be read (a damaged ``tidal.db``)."""
    table = Table()
    for col in ("name", "state", "step", "workers", "created"):
        table.add_column(col)
    for s in rows:
        if isinstance(s, str):
            table.add_row(s, "damaged", "-", "-", "-")
            continue
        table.add_row(
            s.name,
            s.state.value,
            str(s.step),
            f"{s.world_size}/{s.target_workers}",
            _fmt_time(s.created),
        )
    Console(highlight=False).print(table)


def _phases(phases: dict[str, float] | None) -> str:
    """``leave 10 · rendezvous 3 · form 2 · heal 25 · first_step 49`` (milliseconds)."""
    if not phases:
        return "-"
    return " · ".join(f"{k.removesuffix('_s')} {v * 1000:.0f}" for k, v in phases.items())


def recovery_cell(path: RecoveryPath | None, redone: int | None) -> str:
    """``neighbour_copy (-3)``: the path a generation's recovery took and the steps it redid
    (blank when its members did not say)."""
    if path is None:
        return ""
    return path.value + (f" (-{redone})" if redone else "")
