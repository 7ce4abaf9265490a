"""Where a worker computes and what its process groups talk over: pure decisions, and the
few helpers that move tensors and random state to and from a device.

Contracts:

- **Device.** ``Trainer(device=None)`` trains on the worker's GPU where CUDA exists (under
  ``tidal run`` each local worker sees one GPU, ``CUDA_VISIBLE_DEVICES``, so that is
  ``cuda:0``; a plain script uses the current CUDA device) and on the CPU elsewhere. Asking
  for ``cuda`` where none exists is refused, never silently run on the CPU.
- **Communication backend** (``--comm``): ``auto`` is NCCL on a CUDA device and gloo on the
  CPU; ``nccl`` on a CPU device is refused (NCCL moves CUDA tensors only); ``gloo`` works on
  both (CUDA tensors are reduced through host memory by gloo itself).
- **Wire device**: the device a backend's point-to-point messages and small collectives
  (heal, the step all-gather) use. NCCL sends device tensors; gloo's send/recv take host
  tensors, so with gloo a CUDA tensor travels through a host copy.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Mapping
from typing import Any

import torch

#: The values of ``tidal run --comm``.
COMMS = ("auto", "nccl", "gloo")


def resolve_device(requested: str | torch.device | None, *, cuda_available: bool) -> torch.device:
    """The device a Trainer trains on (see the module contract). ``cuda_available`` is
    ``torch.cuda.is_available()``, a parameter so the rule is tested without a GPU."""
    if requested is None:
        if not cuda_available:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={requested!r} is not a torch device: {exc}") from None
    if device.type == "cuda" and not cuda_available:
        raise ValueError(
            f"device={requested!r} but this worker sees no CUDA device: pass device='cpu', "
            "or run where CUDA is available"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={requested!r}: Tidal trains on 'cpu' or 'cuda' devices")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_comm(comm: str, device: torch.device) -> str:
    """The process-group backend of a worker on ``device`` asked for ``comm``."""
    if comm not in COMMS:
        raise ValueError(f"--comm must be one of {', '.join(COMMS)}, got {comm!r}")
    if comm == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if comm == "nccl" and device.type != "cuda":
        raise ValueError(
            f"--comm nccl needs a CUDA device, and this worker trains on {device.type}: "
            "use --comm gloo or auto"
        )
    return comm


def wire_device(backend: str, device: torch.device) -> torch.device:
    """Where a backend's point-to-point messages live (module contract)."""
    return device if backend == "nccl" else torch.device("cpu")


def to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor in it on ``device``: tensors, and tensors inside dicts,
    lists, tuples and named tuples (their types kept); an object with a ``to`` method
    (e.g. a tokenizer's batch) is asked to move itself; anything else is returned as is."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device, non_blocking=non_blocking) for k, v in batch.items()}
        try:
            return moved if type(batch) is dict else type(batch)(moved)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(v, device, non_blocking=non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking=non_blocking) for v in batch)
    move = getattr(batch, "to", None)
    if callable(move):
        return move(device)
    return batch


def place_module(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> None:
    """Move ``module`` to ``device`` in place. Refuses when the move replaced parameters the
    optimizer holds (it would then step tensors the model no longer uses: a silent no-op
    training), or when the optimizer already holds state on another device."""
    before = [id(p) for p in module.parameters()]
    module.to(device)
    if [id(p) for p in module.parameters()] != before:
        raise ValueError(
            f"moving the model to {device} replaced its parameters, so the optimizer no "
            "longer holds them: move the model to the device before building the optimizer"
        )
    for entries in optimizer.state.values():
        for value in entries.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
                raise ValueError(
                    f"the optimizer already holds state on {value.device}, not {device}: "
                    "build it (and take no step) after moving the model"
                )


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_tracked_devices(objects: dict[str, Any], device: torch.device) -> None:
    """Refuse a tracked module (an EMA model) with tensors on another device than the one
    the model trains on: its update from the model's parameters would fail at the first
    step on a GPU, or silently copy across devices every step. The fix is the user's: the
    EMA is usually built before the Trainer moved the model."""
    for name, obj in objects.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        for t in itertools.chain(obj.parameters(), obj.buffers()):
            if not _same_device(t.device, device):
                raise ValueError(
                    f"tracked state {name!r} ({type(obj).__name__}) is on {t.device} but the "
                    f"model trains on {device}: build it from trainer.model after making the "
                    f"Trainer, or call .to({str(device)!r}) on it first"
                )


# -- random state beyond the CPU generator ------------------------------------------------
def cuda_rng_state() -> torch.Tensor | None:
    """The current CUDA device's generator state, or None where CUDA was never used."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state()
    return None


def set_cuda_rng_state(state: torch.Tensor | None) -> None:
    """Restore what ``cuda_rng_state`` returned (no-op for None or without CUDA)."""
    if state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state)


def cuda_rng_text() -> str | None:
    """``cuda_rng_state`` as text for a checkpoint's JSON meta."""
    state = cuda_rng_state()
    return None if state is None else base64.b64encode(state.numpy().tobytes()).decode()


def set_cuda_rng_text(text: str | None) -> None:
    if text is not None:
        raw = base64.b64decode(text)
        set_cuda_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
