"""Per-step values of the metrics a script logs (``tidal.log``): the coordinator's rules.

Workers send ``protocol.StepMetrics`` records with their heartbeats: the step (the one in
flight, or after the loop the final step count), the generation and the values. The
coordinator keeps one value per (step, name):

- the newest generation that reported the step wins: a step redone after a failed
  collective, a rollback to a checkpoint or a resume is redone in a newer generation, so its
  values replace the first attempt's, and a late report from an older generation is ignored;
- within that generation each member's last value counts, and the value is the mean over
  the members that reported it. Only rank 0 reports unless the script asked
  ``reduce="mean"``, so by default it is rank 0's value.

The latest-value gauge (``Coordinator.metrics``: ``tidal status``'s ``metrics``) moves to
each value of the newest generation's newest step (a redone step moves it back). Changed values wait in ``take()``
for the recorder (``tidal.dashboard.history.Recorder``), which writes them to SQLite and to
TensorBoard. Everything here runs under the coordinator's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tidal.protocol import StepMetrics

# (step, name) entries whose members' values are kept for the mean: the newest ones. A late
# report for an entry evicted long ago starts a new one (its SQLite row still refuses an
# older generation).
MAX_OPEN = 50_000
# Changed values not yet taken by the recorder (it takes them every 0.2 s; this bounds a
# coordinator whose recorder stopped).
MAX_PENDING = 200_000


@dataclass(frozen=True)
class StepValue:
    """The value of ``name`` at ``step``, as reported in ``generation``."""

    step: int
    name: str
    value: float
    generation: int


class StepLog:
    def __init__(self, *, max_open: int = MAX_OPEN, max_pending: int = MAX_PENDING) -> None:
        self._max_open, self._max_pending = max_open, max_pending
        # (step, name) -> (generation, {worker: value})
        self._open: OrderedDict[tuple[int, str], tuple[int, dict[int, float]]] = OrderedDict()
        self._pending: OrderedDict[tuple[int, str], StepValue] = OrderedDict()
        self._gauge: dict[str, tuple[int, int]] = {}  # name -> (generation, step) it shows
        self.dropped = 0  # changed values dropped because nobody took them

    def add(self, worker: int, record: StepMetrics) -> dict[str, float]:
        """Take one worker's record; return the gauge values it moves (name -> value)."""
        step, gen = record.step, record.generation
        gauges: dict[str, float] = {}
        for name, raw in record.values.items():
            key = (step, name)
            entry = self._open.get(key)
            if entry is not None and gen < entry[0]:
                continue  # superseded: the step was redone in a newer generation
            if entry is None or gen > entry[0]:
                entry = (gen, {})
                self._open[key] = entry
            members = entry[1]
            members[worker] = float(raw)
            self._open.move_to_end(key)
            while len(self._open) > self._max_open:
                self._open.popitem(last=False)
            value = sum(members.values()) / len(members)
            self._pending[key] = StepValue(step=step, name=name, value=value, generation=gen)
            self._pending.move_to_end(key)
            while len(self._pending) > self._max_pending:
                self._pending.popitem(last=False)
                self.dropped += 1
            shown = self._gauge.get(name)
            if shown is None or (gen, step) >= shown:
                self._gauge[name] = (gen, step)
                gauges[name] = value
        return gauges

    def take(self) -> list[StepValue]:
        """The values changed since the last call, oldest change first."""
        rows = list(self._pending.values())
        self._pending.clear()
        return rows
