"""Workers on a Slurm cluster (``tidal run --backend slurm``): job steps, or jobs.

- **Inside an allocation** (``SLURM_JOB_ID`` set: under ``salloc`` or in an ``sbatch``
  script) each worker is a job step on one node of the allocation: ``srun --jobid J
  --nodes 1 --ntasks 1 --nodelist NODE --overlap`` (``slurm_rules.step_argv``). Tidal
  chooses the node (``slurm_rules.choose_node``: spread, at most the node's tasks of
  ``SLURM_TASKS_PER_NODE``); a worker with no free slot waits (``pending``) until one frees.
- **Outside one** each worker is a job of its own, one task on one node
  (``slurm_rules.job_argv``): it waits in Slurm's queue, ``pending`` (capacity not there
  yet: no member), until Slurm runs it (``squeue`` says ``RUNNING``).

Either way the worker is an ``srun`` child of the coordinator: its exit code is the worker's
(``slurm_rules.srun_end``), its output goes to the worker's log here, and it runs
``tidal.backends.slurm_task`` on the node, which binds gloo and NCCL to the node's address and
replaces itself with the script. One monitor thread reaps the ``srun`` processes and, each
``QUERY_S``, asks ``squeue`` for the steps' (or jobs') ids and states and ``sinfo`` for the
nodes' states: a node Slurm sets DOWN or FAIL is lost, and every worker on it is an ``Exit``
at once (as a killed worker), even while its ``srun`` lingers; in an allocation a lost node
takes no worker again. ``signal`` goes through ``scancel --signal`` to the worker's step (or
job), so ``SIGTERM`` reaches the script: a planned leave. Decisions are in
``slurm_rules``; this module only runs Slurm's commands and records what they say.

The coordinator binds the address this machine's route to Slurm's controller (else to a node
of the allocation) leaves from, unless ``--listen HOST:PORT`` names one
(``slurm_commands.coordinator_address``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tidal.backends.base import Backend, Exit
from tidal.backends.slurm_commands import (
    COMMAND_TIMEOUT_S,
    SlurmError,
    check_commands,
    coordinator_address,
    current_allocation,
    job_nodes,
    last_line,
    node_states,
    queue,
    scancel,
    tail,
)
from tidal.backends.slurm_rules import (
    Node,
    NodeFacts,
    choose_node,
    job_argv,
    node_failure,
    node_lost,
    srun_end,
    step_argv,
    worker_name,
)
from tidal.backends.slurm_task import ENV_SLOT
from tidal.config import JobSpec
from tidal.protocol import ENV_TOKEN

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the monitor reaps ``srun`` processes
QUERY_S = 1.0  # how often it asks ``squeue`` and ``sinfo``
_CANCEL_SIGNALS = (signal.SIGTERM, signal.SIGKILL, signal.SIGINT)


@dataclass(kw_only=True)
class _Worker:
    wid: int
    name: str  # its step's (or job's) name: ``slurm_rules.worker_name``
    env: dict[str, str]
    proc: subprocess.Popen | None = None  # its srun; None: waiting for a slot, or adopted
    node: str | None = None
    slot: int | None = None
    step: str | None = None  # its step id (JOB.STEP) or, outside an allocation, its job id
    running: bool = False  # Slurm runs it
    cancelled: bool = False
    adopted: bool = False


class SlurmBackend(Backend):
    @classmethod
    def check_capacity(cls, spec: JobSpec) -> None:
        """Refuse a job whose ``--max-workers`` the allocation cannot hold (outside one the
        queue holds any number: they wait)."""
        check_commands()
        alloc = current_allocation()
        wanted = spec.max_workers + spec.spares
        if alloc is not None and wanted > alloc.capacity:
            raise ValueError(
                f"{wanted} workers is more than Slurm job {alloc.job_id} holds: "
                f"{alloc.capacity} tasks on {len(alloc.nodes)} nodes (ask salloc or sbatch for "
                "more with --nodes and --ntasks-per-node, or lower --max-workers)"
            )

    def __init__(self, *, spec: JobSpec, log_dir: Path, cwd: Path | None = None) -> None:
        self.check_capacity(spec)
        self.alloc = current_allocation()
        self.host = coordinator_address(spec)
        self.job = spec.name
        self.command = [spec.python, "-m", "tidal.backends.slurm_task", *spec.worker_argv]
        self.log_dir = log_dir
        self.cwd = str(cwd) if cwd is not None else None
        log_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._workers: dict[int, _Worker] = {}
        self._exits: list[Exit] = []
        self._ended: list[subprocess.Popen] = []  # sruns of workers counted lost, to reap
        self._nodes: dict[str, Node] = {}  # what sinfo said last
        self._lost: set[str] = set()
        self._news: list[str] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        if self.alloc is not None:
            self._nodes = node_states(list(self.alloc.nodes))
        self._closing = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="tidal-slurm", daemon=True)
        self._monitor.start()

    # -- the Backend interface -----------------------------------------------------------
    def start(self, worker_id: int, env: dict[str, str]) -> int | None:
        """Ask for the worker: placed on a node of the allocation with a free slot now (or
        when one frees), or submitted to the queue. Its pid comes when it registers."""
        w = _Worker(wid=worker_id, name=worker_name(self.job, worker_id, env[ENV_TOKEN]), env=env)
        with self._lock:
            self._workers[worker_id] = w
        if self.alloc is None:
            self._launch(w, job_argv(name=w.name, command=self.command))
        else:
            self._place_waiting()
        return None

    def poll(self) -> list[Exit]:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        if self.alloc is not None:
            self._place_waiting()
        with self._lock:
            exits, self._exits = self._exits, []
        return exits

    def signal(self, worker_id: int, sig: int) -> None:
        """``scancel --signal`` to the worker's step (or job); a worker Slurm does not run
        yet is cancelled by SIGTERM, SIGKILL or SIGINT (an exit with code 0)."""
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None:
                return
            if w.proc is None and not w.adopted:  # waiting for a slot of the allocation
                if sig in _CANCEL_SIGNALS:
                    del self._workers[worker_id]
                    self._exit(w, 0, "cancelled before a slot of the allocation freed")
                return
            cancel = not w.running and sig in _CANCEL_SIGNALS
            w.cancelled = w.cancelled or cancel
        if w.step is None:
            self._find_steps()  # just started: its id may be known now
        if cancel:  # still in the queue: its job (and srun's wait) cancelled
            if w.step is not None:
                scancel(w.step)
            if w.proc is not None and w.proc.poll() is None:
                w.proc.terminate()
            return
        if w.step is not None:  # not srun as well, whatever scancel says: a second SIGTERM
            scancel(w.step, sig)  # is a kill
        elif w.proc is not None and w.proc.poll() is None:  # srun forwards it to the task
            w.proc.send_signal(sig)

    def alive(self) -> list[int]:
        with self._lock:
            return sorted({*self._workers, *(e.worker_id for e in self._exits)})

    def waiting(self) -> set[int]:
        with self._lock:
            return {wid for wid, w in self._workers.items() if not w.running and not w.adopted}

    def node(self, worker_id: int) -> str | None:
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None or w.node is None:
                return None
            known = self._nodes.get(w.node)
            return known.describe() if known is not None else w.node

    def adopt(self, worker_id: int, pid: int, env: dict[str, str]) -> bool:
        """A worker a previous coordinator of the job started: watched through ``squeue``
        (its ``srun`` is not this process's child: its exit status is unknown) if its step
        (or job) runs; else whatever Slurm still holds of it is cancelled."""
        name = worker_name(self.job, worker_id, env[ENV_TOKEN])
        found = queue(self.alloc.job_id if self.alloc is not None else None).get(name)
        if not pid or found is None or not found.running:
            if found is not None:
                scancel(found.id)
            return False
        w = _Worker(wid=worker_id, name=name, env=env, adopted=True, running=True)
        w.step, w.node = found.id, found.nodes or None
        with self._lock:
            if self.alloc is not None and w.node is not None:  # it holds a slot there
                taken = {x.slot for x in self._workers.values() if x.node == w.node}
                w.slot = next(i for i in range(len(taken) + 1) if i not in taken)
            self._workers[worker_id] = w
        return True

    def describe_exit(self, worker_id: int) -> str:
        return last_line(self.log_dir / f"worker-{worker_id}.log")

    def wake_fds(self) -> list[int]:
        return [self._wake_r]

    def news(self) -> list[str]:
        with self._lock:
            news, self._news = self._news, []
            return news

    def close(self) -> None:
        """End every worker left (``scancel --signal=KILL``) and reap its ``srun``."""
        self._stop_monitor()
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for w in workers:
            if w.step is not None:
                scancel(w.step, signal.SIGKILL)
        for proc in [*(w.proc for w in workers if w.proc is not None), *self._ended]:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._close_pipe()

    def leave(self) -> None:
        """Forget the workers; their steps (and sruns) go on for the next coordinator."""
        self._stop_monitor()
        self._close_pipe()

    # -- starting ------------------------------------------------------------------------
    def _place_waiting(self) -> None:
        """Start the workers waiting for a slot of the allocation that has one now."""
        assert self.alloc is not None
        while True:
            with self._lock:
                queued = sorted(
                    wid for wid, w in self._workers.items() if w.proc is None and not w.adopted
                )
                taken: dict[str, set[int]] = {}
                for w in self._workers.values():
                    if w.node is not None and w.slot is not None:
                        taken.setdefault(w.node, set()).add(w.slot)
                choice = choose_node(self.alloc, taken, self._lost) if queued else None
                if choice is None:
                    return
                w = self._workers[queued[0]]
                w.node, w.slot = choice
                w.running = True  # the allocation's node is there: it starts now
            argv = step_argv(
                job_id=self.alloc.job_id, node=w.node, name=w.name, command=self.command
            )
            self._launch(w, argv)

    def _launch(self, w: _Worker, argv: list[str]) -> None:
        from tidal.backends.local import worker_base_env

        env = {**worker_base_env(), **w.env}
        if w.slot is not None:
            env[ENV_SLOT] = str(w.slot)
        try:
            with open(self.log_dir / f"worker-{w.wid}.log", "ab") as out:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=self.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # the terminal's Ctrl-C is the coordinator's
                )
        except OSError as exc:
            with self._lock:
                self._workers.pop(w.wid, None)
                self._exit(w, 127, f"srun did not start: {exc}")
            return
        with self._lock:
            w.proc = proc

    # -- what happened -------------------------------------------------------------------
    def _exit(self, w: _Worker, code: int, reason: str = "", known: bool = True) -> None:
        """Record worker ``w``'s end (under the lock) and wake the control loop."""
        self._exits.append(Exit(worker_id=w.wid, returncode=code, reason=reason, known=known))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _watch(self) -> None:
        last = 0.0
        while not self._closing.wait(POLL_S):
            try:
                self._reap()
                if time.monotonic() - last >= QUERY_S:
                    last = time.monotonic()
                    self._query()
            except Exception as exc:  # noqa: BLE001 - Slurm not answering: keep watching
                log.warning("asking Slurm failed: %s", exc)

    def _reap(self) -> None:
        """Each ``srun`` that ended is its worker's exit (``slurm_rules.srun_end``); one on a
        lost node (``slurm_rules.node_lost``) loses the node."""
        with self._lock:
            done = [
                w
                for w in self._workers.values()
                if w.proc is not None and w.proc.poll() is not None
            ]
            self._ended = [p for p in self._ended if p.poll() is None]
        if not done:
            return
        nodes = sorted({w.node for w in done if w.node is not None and not w.cancelled})
        states: dict[str, Node] = {}
        held: set[str] | None = None
        try:  # once for all that ended (at the job's end, every worker at once)
            states = node_states(nodes)
            held = job_nodes(self.alloc.job_id) if self.alloc is not None and nodes else None
        except SlurmError as exc:
            log.warning("asking Slurm about nodes %s failed: %s", nodes, exc)
        for w in done:
            code = w.proc.returncode if w.proc is not None else 0
            said = tail(self.log_dir / f"worker-{w.wid}.log")
            why = None
            if w.node is not None and not w.cancelled:
                why = node_lost(
                    NodeFacts(
                        name=w.node,
                        state=states.get(w.node),
                        in_job=None if held is None else w.node in held,
                        srun_failure=node_failure(said) == w.node,
                    )
                )
            end = srun_end(code, lost=why, cancelled=w.cancelled and not w.running, said=said)
            steps: list[str] = []
            with self._lock:
                if self._workers.pop(w.wid, None) is not None:
                    self._exit(w, end.returncode, end.reason)
                if why is not None and w.node not in self._lost:
                    steps = self._node_lost(w.node, why)
            for step in steps:
                scancel(step, signal.SIGKILL)

    def _find_steps(self) -> dict:
        """Each worker's step (or job) id and state from ``squeue``: a worker Slurm started
        outside an allocation is placed (its node's address asked first, for ``node``); an
        adopted worker whose step is gone has ended. What ``squeue`` said, by name."""
        listed = queue(self.alloc.job_id if self.alloc is not None else None)
        placed: dict[int, str] = {}
        with self._lock:
            for w in list(self._workers.values()):
                found = listed.get(w.name)
                if found is None:
                    if w.adopted:  # its srun is not ours: its end is only seen here
                        del self._workers[w.wid]
                        self._exit(w, -signal.SIGKILL, "its step ended", known=False)
                    continue
                w.step = found.id
                if found.running and not w.running and not w.cancelled and found.nodes:
                    placed[w.wid] = found.nodes
            new = sorted(set(placed.values()) - set(self._nodes))
        nodes = node_states(new) if new else {}
        with self._lock:
            self._nodes.update(nodes)
            for wid, node in placed.items():
                w = self._workers.get(wid)
                if w is not None and not w.cancelled:
                    w.running, w.node = True, node
                    self._wake()
        return listed

    def _query(self) -> None:
        """``squeue`` (``_find_steps``), then the nodes' states from ``sinfo``: the workers of
        a lost node are lost."""
        with self._lock:
            if not self._workers:
                return
        self._find_steps()
        with self._lock:
            names = {w.node for w in self._workers.values() if w.node is not None}
            if self.alloc is not None:
                names |= set(self.alloc.nodes)
        nodes = node_states(sorted(names - self._lost))
        with self._lock:
            self._nodes.update(nodes)
            lost = [n for n in nodes.values() if n.lost and n.name not in self._lost]
            steps = [s for n in lost for s in self._node_lost(n.name, n.why_lost())]
        for step in steps:  # Slurm ends them; this makes sure
            scancel(step, signal.SIGKILL)

    def _node_lost(self, name: str, why: str) -> list[str]:
        """(Under the lock.) Node ``name`` is lost (``why``): each worker on it is lost with
        it now, however long its ``srun`` takes to notice, and it takes no worker again. The
        steps of those workers."""
        self._lost.add(name)
        known = self._nodes.get(name)
        gone = sorted(w.wid for w in self._workers.values() if w.node == name)
        self._news.append(
            f"node {known.describe() if known else name} lost: {why}"
            + (f"; its workers {gone} with it" if gone else "")
        )
        end = srun_end(1, lost=why)
        steps = []
        for wid in gone:
            w = self._workers.pop(wid)
            if w.proc is not None:
                self._ended.append(w.proc)  # reaped when it ends, killed at close
            if w.step is not None:
                steps.append(w.step)
            self._exit(w, end.returncode, end.reason)
        return steps

    # -- closing -------------------------------------------------------------------------
    def _stop_monitor(self) -> None:
        self._closing.set()
        if self._monitor.is_alive() and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=COMMAND_TIMEOUT_S)

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
