"""The pause clock: what a member measures of its own steps and reports, as one part of a
``Trainer``. Where a pause between generations went (``protocol.PAUSE_PHASES``), each step's
compute and exposed communication, the samples per second rank 0 posts twice a second, and
the generation's first step's report. Timing only: nothing here changes training state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tidal.protocol import PAUSE_PHASES, StepReport

if TYPE_CHECKING:
    from tidal.worker.agent.client import Agent
    from tidal.worker.membership.ddp import ControlWord

#: How often rank 0 posts its rate, at most.
RATE_EVERY_S = 0.5


class PauseClock:
    """The marks of one member's pauses and steps."""

    def __init__(self) -> None:
        # When this worker began joining, met its peers, formed the group, and healed: the
        # phases of its pause, reported with its first step in the generation.
        self.joined = self.met = self.formed = self.healed = 0.0
        self.last_step_time: float | None = None  # when the last committed step ended
        self.last_step_gen: int | None = None  # in which generation
        self.prev_time: float | None = None  # the last step before this generation's
        self.prev_gen: int | None = None
        #: A recent step's time (the abort watch's grace); None before two steps of one
        #: generation.
        self.step_s: float | None = None
        self.first_pending = False  # the generation's first step is still to be reported
        self.report_pending = False  # its report waits in the agent's outbox
        self.rate_mark = (time.monotonic(), 0)
        self.split = [0.0, 0.0]  # compute and communication seconds since the last rate

    def formed_generation(self, step: int) -> None:
        """A generation formed, healed at committed step ``step``: its pause ends with its
        first step."""
        self.healed = time.time()
        self.prev_time, self.prev_gen = self.last_step_time, self.last_step_gen
        self.first_pending = True
        self.rate_mark = (time.monotonic(), step)
        self.split = [0.0, 0.0]

    def committed(self, generation: int) -> float:
        """A step of ``generation`` was committed: its time, noted (``step_s``)."""
        now = time.time()
        if self.last_step_gen == generation and self.last_step_time is not None:
            self.step_s = now - self.last_step_time
        return now

    def ended(self, now: float, generation: int) -> None:
        """The committed step's duties are done: the next step is timed from ``now``."""
        self.last_step_time, self.last_step_gen = now, generation

    def pause_phases(self, first_step_time: float) -> dict[str, float]:
        """Where this member's pause went (``protocol.PAUSE_PHASES``); empty for a joiner,
        which had no step before."""
        if self.prev_time is None:
            return {}
        marks = [self.prev_time, self.joined, self.met, self.formed, self.healed]
        marks.append(first_step_time)
        return {name: marks[i + 1] - marks[i] for i, name in enumerate(PAUSE_PHASES)}

    def first_report(
        self, *, generation: int, step: int, now: float, recovery: tuple[str | None, int]
    ) -> StepReport:
        """The report of the generation's first step, committed step ``step`` (its index
        ``step - 1``); it then waits in the outbox (``send_report``)."""
        self.first_pending = False
        self.report_pending = True
        return StepReport(
            generation=generation,
            start_step=step - 1,
            prev_generation=self.prev_gen,
            prev_last_step_time=self.prev_time,
            first_step_time=now,
            phases=self.pause_phases(now),
            recovery=recovery[0],
            redone_steps=recovery[1],
        )

    def send_report(self, agent: Agent | None) -> None:
        """Send the generation's first step's report (``StepReport``), if it waits.

        It waits in the outbox from that step's commit until the next commit, or until this
        member holds or joins again, whichever comes first: sent at once, the coordinator
        applied it (a thread hop and a pass under its lock) while the other members were
        still finishing the same first step, on cores they need, at the end of every
        change's pause. Nothing waits on it for that step: the coordinator admits joiners
        and opens the next generation only once the report says the generation formed, so a
        member about to hold or join sends it first (``Membership.hold``, ``join``)."""
        if self.report_pending and agent is not None:
            self.report_pending = False
            agent.send_soon()

    def time_split(self, started: float, control: ControlWord) -> None:
        """Accumulate a step's compute time and exposed communication wait (``started``:
        when the step began, ``time.perf_counter``)."""
        c = control
        total = time.perf_counter() - started
        comm = max(0.0, min(total, c.comm_done - c.comm_started)) if c.comm_done else 0.0
        self.split[0] += total - comm
        self.split[1] += comm

    def rate(
        self, *, step: int, rank: int, world_size: int, global_batch_size: int
    ) -> dict[str, float] | None:
        """On rank 0, every ``RATE_EVERY_S``: the samples per second and the split since the
        last time, to post; None otherwise."""
        t0, s0 = self.rate_mark
        now = time.monotonic()
        if now - t0 < RATE_EVERY_S or rank != 0:
            return None
        steps = step - s0
        metrics = {
            "samples_per_s": steps * global_batch_size / (now - t0),
            "world_size": world_size,
        }
        if steps:
            metrics.update(compute_s=self.split[0] / steps, comm_s=self.split[1] / steps)
        self.rate_mark = (now, step)
        self.split = [0.0, 0.0]
        return metrics
