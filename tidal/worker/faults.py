"""Deterministic fault injection for tests and benchmarks.

Faults are named in ``TIDAL_FAULTS``, which the launcher passes through to every worker; it
is a test hook, not a setting, and no argument reads it. The format is a ``;``-separated
list of ``KIND@worker=W[,step=S][,phase=P][,gen=G]`` where KIND is ``sigkill``, ``sigstop``
or ``raise``, ``step`` is the 0-based global step (omitted: any), ``gen`` the generation being
joined or trained in (omitted: any), and ``phase`` one of:

- ``step``: before the step's first micro-batch (the default);
- ``allreduce``: inside the gradient all-reduce, before this worker's part of it (its peers
  are already waiting in the collective);
- ``join``: a member of a new generation, before it arrives at the rendezvous;
- ``rendezvous``: every member arrived, before this one connects to the process group;
- ``heal``: the group formed, before the state transfer;
- ``first``: right after this worker's first step in a generation is committed.

For the membership phases ``step`` is the worker's committed step count (0 for a joiner that
holds no state yet): ``gen=2,step=0`` picks the worker that joins generation 2 without state,
whichever worker id that turns out to be. Each fault fires once, the first time it matches.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

KINDS = ("sigkill", "sigstop", "raise")
PHASES = ("step", "allreduce", "join", "rendezvous", "heal", "first")


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    worker: int
    step: int | None = None  # None: any
    phase: str = "step"
    gen: int | None = None  # None: any


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, _, args = part.partition("@")
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r} in TIDAL_FAULTS; known: {KINDS}")
        fields = dict(a.split("=", 1) for a in args.split(",") if a)
        phase = fields.get("phase", "step")
        if phase not in PHASES:
            raise ValueError(f"unknown fault phase {phase!r} in TIDAL_FAULTS; known: {PHASES}")
        step = int(fields["step"]) if "step" in fields else None
        gen = int(fields["gen"]) if "gen" in fields else None
        faults.append(
            Fault(kind=kind, worker=int(fields["worker"]), step=step, phase=phase, gen=gen)
        )
    return faults


class FaultInjector:
    """Fires this worker's faults at their step and phase."""

    def __init__(self, worker_id: int, faults: list[Fault]) -> None:
        self._pending = [f for f in faults if f.worker == worker_id]

    @classmethod
    def from_environ(cls, worker_id: int) -> FaultInjector:
        return cls(worker_id, parse_faults(os.environ.get("TIDAL_FAULTS", "")))

    def maybe_fire(self, step: int, phase: str, gen: int | None = None) -> None:
        for fault in self._pending:
            if fault.phase == phase and fault.step in (None, step) and fault.gen in (None, gen):
                self._pending.remove(fault)
                if fault.kind == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif fault.kind == "sigstop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    raise RuntimeError(f"injected fault at step {step} ({phase})")
                return
