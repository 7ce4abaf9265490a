"""Deterministic fault injection for tests and benchmarks, on the worker's probe points
(``tidal.worker.probes``).

Faults are named in ``TIDAL_FAULTS``, which the launcher passes through to every worker;
``tidal.testing.fault_env`` sets it together with the ``PYTHONPATH`` whose ``sitecustomize``
calls ``install_from_environ`` in each worker. The library never reads it. The format is a ``;``-separated
list of ``KIND@worker=W[,step=S][,phase=P][,gen=G][,id=X]`` where KIND is ``sigkill``,
``sigstop``, ``sigterm`` (a preemption notice to itself), ``raise`` or ``hold`` (the
worker waits there until the test lets it go on: see below), ``step`` is the
0-based global step (omitted: any), ``gen`` the generation being joined or trained in
(omitted: any), ``id`` any token that tells two otherwise equal faults apart, and ``phase``
one of:

- ``step``: before the step's first micro-batch (the default);
- ``allreduce``: inside the gradient all-reduce, before this worker's part of it (its peers
  are already waiting in the collective);
- ``join``: a member of a new generation, before it arrives at the rendezvous;
- ``rendezvous``: every member arrived, before this one connects to the process group;
- ``connect``: this worker published its address for the group and its peers may be
  connecting to it (gloo's ``connectFullMesh``), before it connects to them;
- ``heal``: the group formed, before the state transfer;
- ``first``: right after this worker's first step in a generation is committed;
- ``checkpoint``: inside a checkpoint write (rank 0's writer thread, the model file written
  into the temporary folder, before the manifest and the rename); ``step`` is the
  checkpoint's step;
- ``copy``: ``sharding="fsdp"``, a member about to exchange its neighbour copy after
  committing step ``step``;
- ``evaluate``: inside ``trainer.evaluate`` during step ``step``, right after this member
  published one of its batches (the others may still be computing theirs).

For the membership phases ``step`` is the worker's committed step count (0 for a joiner that
holds no state yet): ``gen=2,step=0`` picks the worker that joins generation 2 without state,
whichever worker id that turns out to be. Each fault fires once, the first time it matches.

``TIDAL_FAULTS=@PATH`` reads the list from the file ``PATH`` instead (``;`` or newlines
between faults), again whenever the file changes: a campaign arms a fault while the job
runs (``bench.chaos``). Every fault that fires first prints one line to stderr (the
worker's log): ``tidal-fault: SPEC fired at step S phase P gen G time T``; with ``@PATH``
it also appends one JSON record to ``PATH.fired`` (``fired_records``), what a harness
reads instead of the logs.

``hold`` needs ``@PATH``: the worker writes the file ``PATH.held`` (its spec) and waits,
without timing out before ``HOLD_S``, until the file ``PATH.release`` exists. A test acts on
the job meanwhile, at a moment it does not race for (an outsider's write to the store
between a member's publishing of its address and its reading of its peers', at
``phase=connect``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass

from tidal.worker import probes
from tidal.worker.probes import PHASES

KINDS = ("sigkill", "sigstop", "sigterm", "raise", "hold")
FIRED_PREFIX = "tidal-fault:"
HOLD_S = 120.0  # the most a ``hold`` waits for its release


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    worker: int
    step: int | None = None  # None: any
    phase: str = "step"
    gen: int | None = None  # None: any
    id: str = ""

    @property
    def spec(self) -> str:
        fields = [f"worker={self.worker}", f"phase={self.phase}"]
        fields += [f"{k}={v}" for k, v in (("step", self.step), ("gen", self.gen)) if v is not None]
        fields += [f"id={self.id}"] if self.id else []
        return f"{self.kind}@{','.join(fields)}"


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in spec.replace("\n", ";").split(";"))):
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
            Fault(
                kind=kind,
                worker=int(fields["worker"]),
                step=step,
                phase=phase,
                gen=gen,
                id=fields.get("id", ""),
            )
        )
    return faults


class FaultInjector:
    """Fires this worker's faults at their step and phase."""

    def __init__(self, worker_id: int, faults: list[Fault], path: str | None = None) -> None:
        self._worker_id = worker_id
        self._pending = [f for f in faults if f.worker == worker_id]
        self._path = path  # re-read when it changes (``@PATH``)
        self._seen: tuple[int, int] | None = None
        self._fired: set[Fault] = set()

    def _record(self, fault: Fault, *, step: int, phase: str, gen: int | None, now: float) -> None:
        """With ``@PATH``: one JSON line in ``PATH.fired`` for what a harness reads
        (``fired_records``), appended in one write (the members share the file)."""
        if self._path is None:
            return
        line = json.dumps(
            {
                "spec": fault.spec,
                "worker": self._worker_id,
                "step": step,
                "phase": phase,
                "gen": gen,
                "time": now,
            }
        )
        fd = os.open(f"{self._path}.fired", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    @classmethod
    def from_environ(cls, worker_id: int) -> FaultInjector:
        spec = os.environ.get("TIDAL_FAULTS", "")
        if spec.startswith("@"):
            return cls(worker_id, [], path=spec[1:])
        return cls(worker_id, parse_faults(spec))

    def _reload(self) -> None:
        try:
            st = os.stat(self._path)
            seen = (st.st_mtime_ns, st.st_size)
            if seen == self._seen:
                return
            with open(self._path) as f:
                text = f.read()
        except OSError:
            return
        self._seen = seen
        try:
            faults = parse_faults(text)
        except ValueError:  # caught mid-write: the next call reads it whole
            self._seen = None
            return
        self._pending = [f for f in faults if f.worker == self._worker_id and f not in self._fired]

    def maybe_fire(self, step: int, phase: str, gen: int | None = None) -> None:
        if self._path is not None:
            self._reload()
        for fault in self._pending:
            if fault.phase == phase and fault.step in (None, step) and fault.gen in (None, gen):
                self._pending.remove(fault)
                self._fired.add(fault)
                now = time.time()
                print(  # for the reader of the worker's log
                    f"{FIRED_PREFIX} {fault.spec} fired at step {step} phase {phase} "
                    f"gen {gen} time {now:.3f}",
                    file=sys.stderr,
                    flush=True,
                )
                self._record(fault, step=step, phase=phase, gen=gen, now=now)
                if fault.kind == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif fault.kind == "sigstop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif fault.kind == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
                elif fault.kind == "hold":
                    self._hold(fault)
                else:
                    raise RuntimeError(f"injected fault at step {step} ({phase})")
                return

    def _hold(self, fault: Fault) -> None:
        if self._path is None:
            raise RuntimeError("a hold fault needs TIDAL_FAULTS=@PATH (its release file)")
        with open(f"{self._path}.held", "w") as f:
            f.write(fault.spec)
        deadline = time.monotonic() + HOLD_S
        while not os.path.exists(f"{self._path}.release") and time.monotonic() < deadline:
            time.sleep(0.01)


def install_from_environ() -> FaultInjector | None:
    """In a worker launched with ``TIDAL_FAULTS``: fire its faults at its probe points."""
    spec, wid = os.environ.get("TIDAL_FAULTS"), os.environ.get("TIDAL_WORKER_ID")
    if not spec or wid is None:
        return None
    injector = FaultInjector.from_environ(int(wid))
    probes.install(lambda phase, step, gen: injector.maybe_fire(step, phase, gen))
    return injector


def fired_records(path: str | os.PathLike) -> list[dict]:
    """The faults that fired under ``TIDAL_FAULTS=@PATH``, as the workers recorded them
    (``spec``, ``worker``, ``step``, ``phase``, ``gen``, ``time``), oldest first; a line
    cut short by a worker killed while writing it is skipped."""
    try:
        text = open(f"{os.fspath(path)}.fired").read()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
