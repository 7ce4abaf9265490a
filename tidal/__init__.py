"""Tidal: elastic distributed training for PyTorch.

The public surface is what a training script needs: ``Trainer`` (hands the model, optimizer
and dataset to Tidal), the ``Step`` it yields, and ``log`` (report metrics to the job).
Everything else is importable but internal.
"""

from tidal.worker.runtime import Step, Trainer, log

__all__ = ["Step", "Trainer", "log"]
__version__ = "0.1.0"
