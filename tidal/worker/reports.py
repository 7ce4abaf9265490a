"""What a member measures of its own steps and reports (a mixin of ``Trainer``): where a
pause between generations went, each step's compute and exposed communication, and the
samples per second rank 0 posts twice a second. Timing only: nothing here changes state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tidal.protocol import PAUSE_PHASES

if TYPE_CHECKING:
    from tidal.worker.step import Step


class Reports:
    def _pause_phases(self, first_step_time: float) -> dict[str, float]:
        """Where this member's pause went (``protocol.PAUSE_PHASES``); empty for a joiner,
        which had no step before."""
        if self._gen_prev_time is None:
            return {}
        marks = [
            self._gen_prev_time,
            self._t_join,
            self._t_rendezvous,
            self._t_formed,
            self._t_healed,
            first_step_time,
        ]
        return {name: marks[i + 1] - marks[i] for i, name in enumerate(PAUSE_PHASES)}

    def _send_report(self) -> None:
        """Send the generation's first step's report (``StepReport``), if it waits.

        It waits in the outbox from that step's commit until the next commit, or until this
        member holds or joins again, whichever comes first: sent at once, the coordinator
        applied it (a thread hop and a pass under its lock) while the other members were
        still finishing the same first step, on cores they need, at the end of every
        change's pause. Nothing waits on it for that step: the coordinator admits joiners
        and opens the next generation only once the report says the generation formed, so a
        member about to hold or join sends it first (``_hold``, ``_join``)."""
        if self._report_pending and self._agent is not None:
            self._report_pending = False
            self._agent.send_soon()

    def _time_split(self, step: Step) -> None:
        """Accumulate this step's compute time and exposed communication wait."""
        c = self._control
        total = time.perf_counter() - step._started
        comm = max(0.0, min(total, c.comm_done - c.comm_started)) if c.comm_done else 0.0
        self._split[0] += total - comm
        self._split[1] += comm

    def _maybe_report_rate(self) -> None:
        t0, s0 = self._rate_mark
        now = time.monotonic()
        if now - t0 >= 0.5 and self.rank == 0:
            steps = self.step - s0
            rate = steps * self.sampler.global_batch_size / (now - t0)
            metrics = {"samples_per_s": rate, "world_size": self.world_size}
            if steps:
                metrics.update(compute_s=self._split[0] / steps, comm_s=self._split[1] / steps)
            self._agent.post_metrics(metrics)
            self._rate_mark = (now, self.step)
            self._split = [0.0, 0.0]
