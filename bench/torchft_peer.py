"""TorchFT as a peer: recovery, join and steady throughput of the bench MLP under
``torchft`` (a ``LighthouseServer`` and one ``Manager`` per replica group over gloo, as
TorchFT's ``train_ddp`` example runs them), on the same machine.

When TorchFT cannot run here (not installed, or its import fails on this torch), the rows
are there without numbers and ``peer_config`` says exactly why; the suite does not fail.
"""

from __future__ import annotations

from pathlib import Path

from bench.rows import failed

ROWS = (("torchft_recovery", "s"), ("torchft_join", "s"), ("torchft_throughput", "samples/s"))


def unavailable() -> str | None:
    """Why TorchFT cannot run here, or None when it imports."""
    try:
        import torchft  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason to report
        return f"torchft not usable: {type(exc).__name__}: {exc}"
    return None


def skipped(reason: str) -> list[dict]:
    return [failed(name, unit, peer_name="torchft", reason=reason) for name, unit in ROWS]


def run_torchft(size: dict, tmp: Path) -> tuple[list[dict], dict]:
    reason = unavailable()
    if reason is not None:
        return skipped(reason), {"skipped": reason}
    try:
        from bench.torchft_measure import measure
    except ImportError:
        reason = "torchft imports, but the bench's TorchFT measurement is not written yet"
        return skipped(reason), {"skipped": reason}
    return measure(size, tmp)
