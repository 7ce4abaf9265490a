"""The coordinator's sender of per-step values to the job's tracker (``--track``): a thread
of its own, so that a slow or unreachable tracker never holds up the control loop.

Every ``INTERVAL_S`` it reads the job's ``step_metrics`` rows above the high-water mark from
the home's SQLite (written by the recorder, ``tidal.dashboard.history``), asks the rules
(``plan``) which steps are ready and sends them, the mark written down before (the intent,
``sending_through``) and after (``sent_through``) each batch, in the ``trackers`` table. The
first time it runs in a coordinator it opens the job's run (``plan.Record``: the same run for
every coordinator of the job) and, if the previous coordinator died during a send, sends only
what the tracker does not hold of that batch. A failure (the tracker unreachable, a refusal)
is said once per distinct error, in the job's events and as a warning of the ``tidal`` logger
(the coordinator's stderr), and retried with a
capped backoff; the job trains on meanwhile and the rows wait in SQLite.

At the job's end (``close`` with its outcome) the rest goes (``plan.next_batch``: a job that
did not succeed keeps the values logged after its last committed step for its resume), then
the run ends as the job did; for at most ``CLOSE_TIMEOUT_S``, after which ``close`` returns the line saying what was
not sent. A coordinator that stops without ending the job (it crashed) leaves the run open.
"""

from __future__ import annotations

import logging
import random
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tidal.backoff import capped
from tidal.config import Track
from tidal.protocol import JobState
from tidal.tracking.plan import (
    COMMIT_LAG_S,
    Point,
    Record,
    committed_before,
    next_batch,
    observe,
    record_for,
    unsent,
)
from tidal.tracking.table import TrackerTable
from tidal.tracking.trackers import make_sink

log = logging.getLogger(__name__)
INTERVAL_S = 0.5
READ_LIMIT = 20_000  # rows read at once
CLOSE_TIMEOUT_S = 30.0
RETRY_BASE_S, RETRY_CAP_S = 1.0, 30.0
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


class Forwarder:
    """``committed()``: the job's committed step count (``Job.step``), read without a lock;
    ``note(line)``: an event of the job (warnings are logged too)."""

    def __init__(
        self,
        *,
        track: Track,
        job: str,
        db: Path,
        committed: Callable[[], int],
        note: Callable[[str], None],
        sink_factory: Callable[[Track, str], Any] = make_sink,
    ) -> None:
        self.track, self.job, self.db = track, job, db
        self._committed, self._note = committed, note
        self._sink_factory = sink_factory
        self._sink: Any = None
        self.record: Record | None = None
        self._seen: dict = {}
        self._counts: deque[tuple[float, int]] = deque()  # (monotonic, committed), oldest first
        self._wake = threading.Event()
        self._closing = False
        self._outcome: JobState | None = None
        self._deadline = float("inf")
        self._left: str | None = None
        self._last_error: str | None = None
        self.failures = 0  #: attempts that failed, over this forwarder's life
        self._thread = threading.Thread(target=self._run, name="tidal-tracker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, outcome: JobState | None, timeout_s: float = CLOSE_TIMEOUT_S) -> str | None:
        """Send the rest and end the run as ``outcome`` (None: this coordinator stops, the
        job goes on: nothing more is sent and the run stays open). Returns None, or the
        line saying what could not be sent within ``timeout_s``."""
        self._outcome, self._deadline = outcome, time.monotonic() + timeout_s
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s + 1.0)
        if self._thread.is_alive():  # still waiting on the tracker: it is abandoned
            return self._unsent_line(f"no answer within {timeout_s:.0f} s")
        return self._left

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        table: TrackerTable | None = None
        failures = 0
        try:
            while True:
                if self._closing and self._outcome is None:  # the job goes on without us
                    self._stop_quietly()
                    return
                ending = self._closing
                try:
                    if table is None:
                        table = TrackerTable(self.db)
                    if self._sink is None:
                        self._open(table)
                    self._recover(table)
                    while self._round(table, ending=ending):
                        pass
                    if ending:
                        self._sink.finish(self._outcome)
                        return
                    failures, delay = 0, INTERVAL_S
                    if self._last_error is not None:
                        self._last_error = None
                        self._tell(self._note, f"tracking: {self._describe()} takes steps again")
                except Exception as exc:  # noqa: BLE001 - a tracker must never stop the job
                    failures += 1
                    self.failures += 1
                    # one warning per error, not per object address in its text
                    text = _ADDRESS.sub("0x...", f"{type(exc).__name__}: {exc}")[:500]
                    if text != self._last_error:
                        self._last_error = text
                        line = f"tracking: {self._describe()}: {text} (retrying)"
                        log.warning("%s", line)
                        self._tell(self._note, line)
                    left_s = self._deadline - time.monotonic() - RETRY_BASE_S
                    if ending and left_s <= 0:
                        self._left = self._unsent_line(text)
                        return
                    delay = capped(
                        failures, base_s=RETRY_BASE_S, cap_s=RETRY_CAP_S, draw=random.random()
                    )
                    delay = min(delay, max(0.0, left_s))
                self._wake.wait(delay)
                self._wake.clear()
        finally:
            if table is not None:
                table.close()

    def _stop_quietly(self) -> None:
        """This coordinator stops while the job goes on: the run stays for the next one."""
        if self._sink is not None:
            try:
                self._sink.finish(None)
            except Exception:  # noqa: BLE001 - the next coordinator opens it again
                pass

    @staticmethod
    def _tell(say: Callable[[str], None], line: str) -> None:
        try:
            say(line)
        except Exception:  # noqa: BLE001 - no terminal to tell: the sending goes on
            pass

    def _save(self, table: TrackerTable, record: Record) -> None:
        table.save(self.job, record)
        self.record = record

    def _open(self, table: TrackerTable) -> None:
        """The job's run: its record's (the key written down before the run is asked for)."""
        t = self.track
        record = record_for(
            table.load(self.job), kind=t.kind, target=t.target, key=secrets.token_hex(8)
        )
        self._save(table, record)
        sink = self._sink_factory(t, self.job)
        run_id = sink.open(key=record.key, run_id=record.run_id)
        if run_id != record.run_id:
            self._save(table, replace(record, run_id=run_id))
        self._sink = sink
        after = self.record.sent_through
        self._note(
            f"tracking: {sink.describe()}" + (f", from step {after + 1} on" if after >= 0 else "")
        )

    def _recover(self, table: TrackerTable) -> None:
        """A batch whose sending was cut off (a coordinator died, the tracker failed): what
        the tracker does not hold of it goes now (``plan.unsent``)."""
        r = self.record
        if r.sending_through <= r.sent_through:
            return
        rows, _ = table.rows(self.job, after=r.sent_through, through=r.sending_through, limit=10**7)
        held = self._sink.held({row.name for row in rows}, r.sent_through + 1, r.sending_through)
        todo = unsent(rows, held)
        wall = time.time()
        if todo:
            self._sink.send(
                [Point(step=x.step, name=x.name, value=x.value, wall=wall) for x in todo]
            )
        self._save(table, replace(r, sent_through=r.sending_through))
        known = "" if held is None else f"{len(rows) - len(todo)} of their points had arrived, "
        self._tell(
            self._note,
            f"tracking: steps {r.sent_through + 1} to {r.sending_through} were being sent when "
            f"the sending was cut off (a coordinator's end, an error): {known}"
            f"{len(todo)} sent now",
        )

    def _round(self, table: TrackerTable, *, ending: bool) -> bool:
        """Send the next batch that is ready; True if one went."""
        r = self.record
        rows, cut = table.rows(self.job, after=r.sent_through, limit=READ_LIMIT)
        if cut and rows[0].step != rows[-1].step:  # the last step read may lack rows
            rows = [x for x in rows if x.step != rows[-1].step]
        now = time.monotonic()
        self._seen = observe(self._seen, rows, now=now, wall=time.time(), after=r.sent_through)
        counts = self._counts
        counts.append((now, self._committed()))
        while len(counts) > 1 and counts[1][0] <= now - COMMIT_LAG_S:
            counts.popleft()  # the newest sample old enough stays first
        points, through = next_batch(
            rows,
            self._seen,
            sent_through=r.sent_through,
            # at the end every record is in (the recorder's last write came first)
            committed=counts[-1][1] if ending else committed_before(counts, at=now - COMMIT_LAG_S),
            now=now,
            ending=ending,
            final=ending and self._outcome == JobState.SUCCEEDED,
        )
        if not points:
            return False
        self._save(table, replace(r, sending_through=through))  # the intent, first
        self._sink.send(points)
        self._save(table, replace(self.record, sent_through=through))
        return True

    def _describe(self) -> str:
        if self._sink is not None:
            return self._sink.describe()
        return self.track.kind + (f" ({self.track.target})" if self.track.target else "")

    def _unsent_line(self, error: str) -> str:
        r = self.record
        after = f"after step {r.sent_through} " if r is not None and r.sent_through >= 0 else ""
        return (
            f"tracking: the steps {after}of job {self.job} were not all sent to "
            f"{self._describe()} ({error}); they stay in the job's records "
            "(`tidal status --json --history`)"
        )
