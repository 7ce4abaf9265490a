"""``tidal run --tensorboard DIR``: the job's reported metrics and world size as TensorBoard
event files, written by the coordinator (one writer per job, however many workers).

Events go to ``DIR/JOB`` (TensorBoard shows each sub-folder as a run, so several jobs can
share ``DIR``), through ``torch.utils.tensorboard.SummaryWriter``. Tags:

- ``tidal/world_size``, ``tidal/target_workers``: at every recorded step;
- ``metrics/NAME``: each metric the script reported with ``tidal.log`` (and the runtime's
  ``samples_per_s``, ``checkpoint_stall_s``), at the step it was seen, whenever it changes.
"""

from __future__ import annotations

import math
from pathlib import Path

FLUSH_SECS = 2  # TensorBoard reads the files while the job trains

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
            if key in SKIP or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            if self._last.get(key) != value:
                self._last[key] = value
                w.add_scalar(f"metrics/{key}", value, step, walltime=time)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
