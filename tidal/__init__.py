"""Tidal: elastic distributed training for PyTorch.

The public surface is what a training script needs: ``Trainer`` (hands the model, optimizer
and dataset to Tidal), the ``Step`` it yields, ``prepare`` (the script's own loop instead:
``tidal.worker.compat.prepare``), and ``log`` (report metrics to the job). Everything else is
importable but internal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal import logconfig

if TYPE_CHECKING:
    from tidal.worker.batches.sources import IndexDataset, sample_seed, sample_seeds
    from tidal.worker.compat.prepare import prepare
    from tidal.worker.trainer.runtime import Step, Trainer, log

__all__ = ["Step", "Trainer", "log", "prepare", "IndexDataset", "sample_seed", "sample_seeds"]
_SOURCES = {"IndexDataset", "sample_seed", "sample_seeds"}
__version__ = "0.1.0"
logconfig.install()  # the ``tidal`` logger's one handler (its own logger only)


def __getattr__(name: str) -> object:
    # Lazy: the CLI imports tidal.* modules that must not pull in torch (1.6 s a call).
    if name == "data":  # tidal.data.TokenShards after a plain `import tidal`
        import importlib

        return importlib.import_module("tidal.data")
    if name == "prepare":
        from tidal.worker.compat.prepare import prepare

        return prepare
    if name in _SOURCES:
        from tidal.worker.batches import sources

        return getattr(sources, name)
    if name in __all__:
        from tidal.worker.trainer import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'tidal' has no attribute {name!r}")
