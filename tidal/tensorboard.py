"""``tidal run --tensorboard DIR``: the job's reported metrics and world size as TensorBoard
event files, written by the coordinator (one writer per job, however many workers).

Events go to ``DIR/JOB`` (TensorBoard shows each sub-folder as a run, so several jobs can
share ``DIR``), through ``torch.utils.tensorboard.SummaryWriter``. Tags:

- ``tidal/world_size``, ``tidal/target_workers``: at every recorded step;
- ``metrics/NAME`` of each metric the script logs with ``tidal.log``: exactly one scalar per
  step it was logged at (the coordinator's per-step value, ``coordinator.step_metrics``),
  written once the step is settled: the job committed it and its value has not changed for
  ``SETTLE_S`` (the other members' values of a ``reduce="mean"`` arrive within a few
  heartbeats); the rest when the job ends. A step is written once and never again: a value
  that changes later (a step redone after a rollback to a checkpoint) stays in the status
  history only, and TensorBoard keeps the first. Non-finite values are not written;
- ``metrics/NAME`` of the runtime's own gauges (``samples_per_s``, ``compute_s``,
  ``checkpoint_stall_s``, the cost...), sampled: at the step it was seen, whenever it changes.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.coordinator.records.step_metrics import StepValue

FLUSH_SECS = 2  # TensorBoard reads the files while the job trains
SETTLE_S = 1.0  # a committed step's value unchanged this long is final (heartbeats: 0.1 s)

# The runtime's copy of what tidal/world_size records, and constants of the job.
SKIP = {"world_size", "global_batch_size", "max_steps"}


def check_available() -> None:
    """Raise ``ValueError`` (one line for the CLI) if the ``tensorboard`` package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError(
            "--tensorboard needs the tensorboard package: pip install tensorboard"
        ) from None


class TensorBoardSink:
    """Receives the coordinator's samples (see ``tidal.dashboard.history.Recorder``)."""

    def __init__(self, logdir: Path | str, job: str) -> None:
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(logdir) / job
        self.path.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.path), flush_secs=FLUSH_SECS)
        self._last_step: int | None = None
        self._last: dict[str, float] = {}
        self._per_step: set[str] = set()  # names the script logs: written per step only
        self._pending: dict[str, dict[int, tuple[float, float, float]]] = {}  # (value, t, wall)
        self._written: dict[str, int] = {}  # the last step written of each per-step name
        self._clock = time.monotonic

    def record_steps(self, values: list[StepValue], *, committed: int, force: bool = False) -> None:
        """Take per-step values; write, in step order, those of the steps before
        ``committed`` that no change touched for ``SETTLE_S`` (all of them: ``force``)."""
        now, wall = self._clock(), time.time()
        for v in values:
            self._per_step.add(v.name)
            if v.step > self._written.get(v.name, -1):
                self._pending.setdefault(v.name, {})[v.step] = (v.value, now, wall)
        for name, pending in self._pending.items():
            for step in sorted(pending):
                value, changed, seen = pending[step]
                if not force and (step >= committed or now - changed < SETTLE_S):
                    break  # in order: a later step waits for this one
                del pending[step]
                self._written[name] = step
                if math.isfinite(value):
                    self._writer.add_scalar(f"metrics/{name}", value, step, walltime=seen)

    def record(
        self,
        *,
        time: float,
        step: int,
        world_size: int,
        target: int,
        metrics: dict[str, float],
    ) -> None:
        w = self._writer
        if step != self._last_step:
            self._last_step = step
            w.add_scalar("tidal/world_size", world_size, step, walltime=time)
            w.add_scalar("tidal/target_workers", target, step, walltime=time)
        for key, value in metrics.items():
            if key in SKIP or key in self._per_step or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                continue
            if self._last.get(key) != value:
                self._last[key] = value
                w.add_scalar(f"metrics/{key}", value, step, walltime=time)

    def close(self) -> None:
        self.record_steps([], committed=0, force=True)
        self._writer.flush()
        self._writer.close()
