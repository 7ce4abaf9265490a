"""Named points of a worker's protocol where a test harness may act.

The training loop and the membership protocol call ``point(phase, step, generation)`` at
the moments a test must reach deterministically (``PHASES``; their meaning is in
``tidal.testing.faults``). In production no hook is installed and a point returns at once:
nothing here reads a setting or the environment. A test harness installs hooks from outside
the worker's code: ``tidal.testing.faults`` does, in the worker processes a test starts,
through a ``sitecustomize`` on their ``PYTHONPATH`` (``tidal.testing.fault_env``).
"""

from __future__ import annotations

from collections.abc import Callable

PHASES = (
    "step",
    "allreduce",
    "join",
    "rendezvous",
    "connect",
    "heal",
    "first",
    "checkpoint",
    "copy",
    "evaluate",
)

Hook = Callable[[str, int, "int | None"], None]
_hooks: list[Hook] = []


def install(hook: Hook) -> None:
    """Call ``hook(phase, step, generation)`` at every point from now on."""
    _hooks.append(hook)


def point(phase: str, step: int, generation: int | None = None) -> None:
    """This worker reached ``phase`` at ``step`` (in ``generation``, when it has one)."""
    for hook in _hooks:
        hook(phase, step, generation)
