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

Each worker's newest record applied, by (generation, step) (``applied``), goes with the values
taken: once the recorder has written those, the job's records hold every record of that
worker below it (``saved_step_metrics``), which a restarted coordinator tells the worker
when it registers again (``protocol.RegisterResponse``), so that it sends again what the dead
one had taken but not written down.

The latest-value gauge (``Coordinator.metrics``: ``tidal status``'s ``metrics``) moves to
each value of the newest generation's newest step (a redone step moves it back). Changed values wait in ``take()``
for the recorder (``tidal.dashboard.history.Recorder``), which writes them to SQLite and to
TensorBoard. Everything here runs under the coordinator's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class _Entry:
    """The values of one (step, name) in ``generation``: each member's, and their sum."""

    generation: int
    members: dict[int, float] = field(default_factory=dict)
    total: float = 0.0


class StepLog:
    def __init__(self, *, max_open: int = MAX_OPEN, max_pending: int = MAX_PENDING) -> None:
        self._max_open, self._max_pending = max_open, max_pending
        self._open: OrderedDict[tuple[int, str], _Entry] = OrderedDict()  # (step, name) ->
        # (step, name) -> (value, generation): built into StepValues when taken, so that the
        # many members' reports of one key between two takes build one
        self._pending: OrderedDict[tuple[int, str], tuple[float, int]] = OrderedDict()
        self._gauge: dict[str, tuple[int, int]] = {}  # name -> (generation, step) it shows
        self.dropped = 0  # changed values dropped because nobody took them
        # worker -> the (generation, step) of its newest record applied (a worker's records
        # come in that order: its generation and then its step only grow)
        self._applied: dict[int, tuple[int, int]] = {}

    def add(self, worker: int, record: StepMetrics) -> dict[str, float]:
        """Take one worker's record; return the gauge values it moves (name -> value)."""
        step, gen = record.step, record.generation
        gauges: dict[str, float] = {}
        self._applied[worker] = max(self._applied.get(worker, (gen, step)), (gen, step))
        opened, pending = self._open, self._pending
        for name, raw in record.values.items():
            key = (step, name)
            entry = opened.get(key)
            if entry is not None and gen < entry.generation:
                continue  # superseded: the step was redone in a newer generation
            if entry is None or gen > entry.generation:
                entry = opened[key] = _Entry(gen)
            members, value = entry.members, float(raw)
            # The mean in O(1) a value (every member of a large job may report each step):
            # a new member's value is added to the sum, in the order sum() would add it; a
            # value that replaces one is summed anew, so the mean is always sum() / count.
            if worker in members:
                members[worker] = value
                entry.total = sum(members.values())
            else:
                members[worker] = value
                entry.total += value
            opened.move_to_end(key)
            while len(opened) > self._max_open:
                opened.popitem(last=False)
            value = entry.total / len(members)
            pending[key] = (value, gen)
            pending.move_to_end(key)
            while len(pending) > self._max_pending:
                pending.popitem(last=False)
                self.dropped += 1
            shown = self._gauge.get(name)
            if shown is None or (gen, step) >= shown:
                self._gauge[name] = (gen, step)
                gauges[name] = value
        return gauges

    def applied(self) -> dict[int, tuple[int, int]]:
        """Each worker's newest record applied: (generation, step), a copy."""
        return dict(self._applied)

    def take(self) -> list[StepValue]:
        """The values changed since the last call, oldest change first."""
        rows = [
            StepValue(step=step, name=name, value=value, generation=gen)
            for (step, name), (value, gen) in self._pending.items()
        ]
        self._pending.clear()
        return rows
