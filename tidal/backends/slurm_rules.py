"""What Slurm's answers mean and what the Slurm backend does next: pure rules.

The backend (``tidal.backends.slurm``) runs Slurm's commands and carries the verdicts out;
these functions only read text and decide, so their tables are tested in milliseconds
(``tests/test_slurm_rules.py``). The formats read are the ones the backend asks for:

- ``SLURM_TASKS_PER_NODE`` (``2(x3),1``): the allocation's slots, node by node;
- ``sinfo -h -N -n NODES -o NODE_FORMAT``: ``NAME|ADDRESS|STATE|REASON`` per node;
- ``squeue -h -o JOB_FORMAT`` (jobs) and ``squeue -h -s -o STEP_FORMAT`` (steps):
  ``ID|NAME|STATE|NODES`` per job or step;
- ``scontrol show config``: the controllers' names and addresses (``SlurmctldHost[i]``).

Contracts: a node is lost when Slurm says it is down or failed (``DOWN``, ``FAIL``, with
any suffix), and stays lost for the job's life (an allocation excises it, ``--no-kill``);
a worker's end is read from ``srun``'s exit code (a shell's ``128 + N`` is signal ``N``),
unless its node was lost (then it is lost with the node, as a killed worker) or it was
cancelled before Slurm placed it (an exit with code 0).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tidal.backends.placement import Room, place

NODE_FORMAT = "%N|%o|%t|%E"  # name, NodeAddr, compact state, reason (last: it may hold "|")
JOB_FORMAT = "%i|%j|%T|%N"  # job id, name, state (PENDING, RUNNING...), nodes
STEP_FORMAT = "%i|%j|%N"  # step id (JOB.STEP), name, nodes: a listed step runs
#: Node states (``sinfo``'s compact form, without its suffix) whose workers are lost.
LOST_STATES = frozenset({"down", "fail"})
#: Job states of a worker's own job (outside an allocation) in which it runs.
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING"})
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) as one count per node, in node order.
    ``ValueError`` for text Slurm never writes."""
    counts: list[int] = []
    for part in text.strip().split(","):
        m = _TASKS.match(part.strip())
        if m is None:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE={text!r} (e.g. 2(x3),1)")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """The Slurm job this process runs in (``salloc``, ``sbatch``): its id, its nodes in
    order and how many workers each holds (its tasks on that node)."""

    job_id: str
    nodes: tuple[str, ...]
    slots: tuple[int, ...]

    @property
    def capacity(self) -> int:
        return sum(self.slots)


def allocation(job_id: str, nodes: Sequence[str], tasks: str | None) -> Allocation:
    """The allocation ``job_id`` of ``nodes`` (its node list expanded); ``tasks``: its
    ``SLURM_TASKS_PER_NODE`` (None: one task per node). ``ValueError`` when they disagree."""
    counts = tasks_per_node(tasks) if tasks else [1] * len(nodes)
    if len(counts) != len(nodes) or not nodes:
        raise ValueError(
            f"SLURM_TASKS_PER_NODE={tasks!r} does not match the job's {len(nodes)} nodes"
        )
    return Allocation(job_id=job_id, nodes=tuple(nodes), slots=tuple(counts))


# -- what sinfo and squeue say ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Node:
    name: str
    address: str
    state: str  # compact, with its suffix: idle, mix, alloc, down*, drain...
    reason: str = ""

    @property
    def lost(self) -> bool:
        return self.state.rstrip("*~#%!$@^-+") in LOST_STATES

    def why_lost(self) -> str:
        said = f" ({self.reason})" if self.reason else ""
        return f"Slurm set node {self.name} {self.state.rstrip('*~#%!$@^-+').upper()}{said}"

    def describe(self) -> str:
        """What ``Backend.node`` says of a worker on it: ``NAME (ADDRESS)``."""
        return f"{self.name} ({self.address})" if self.address else self.name


def parse_nodes(text: str) -> dict[str, Node]:
    """``sinfo -h -N -o NODE_FORMAT``'s lines, by node name (a node in two partitions is
    listed twice: once is enough)."""
    nodes: dict[str, Node] = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 3)
        if len(parts) < 3 or not parts[0]:
            continue
        reason = parts[3].strip() if len(parts) > 3 else ""
        nodes.setdefault(
            parts[0],
            Node(
                name=parts[0],
                address=parts[1].strip(),
                state=parts[2].strip().lower(),
                reason="" if reason.lower() == "none" else reason,
            ),
        )
    return nodes


@dataclass(frozen=True, kw_only=True)
class Queued:
    """A job or step of ``squeue``: ``id`` (``JOB`` or ``JOB.STEP``), ``name``, ``state``
    (a listed step runs: ``RUNNING``), ``nodes`` (a node list; empty while pending)."""

    id: str
    name: str
    state: str
    nodes: str

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES


def parse_queue(text: str, *, steps: bool = False) -> dict[str, Queued]:
    """``squeue -h -o JOB_FORMAT`` (or, ``steps``, ``squeue -h -s -o STEP_FORMAT``) by
    name; the newest id where a name is listed twice."""
    found: dict[str, Queued] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if steps and len(parts) == 3:
            q = Queued(id=parts[0], name=parts[1], state="RUNNING", nodes=parts[2])
        elif not steps and len(parts) == 4:
            q = Queued(id=parts[0], name=parts[1], state=parts[2].upper(), nodes=parts[3])
        else:
            continue
        old = found.get(q.name)
        if old is None or _id_key(q.id) > _id_key(old.id):
            found[q.name] = q
    return found


def _id_key(ident: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else -1 for p in re.split(r"[._]", ident))


def controllers(show_config: str) -> list[str]:
    """The controllers' addresses from ``scontrol show config`` (``SlurmctldHost[0] =
    NAME(ADDRESS)``, or ``NAME`` alone when its address is its name), primary first."""
    found = []
    for line in show_config.splitlines():
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"\s*(SlurmctldHost|ControlMachine)(\[\d+\])?\s*", key):
            continue
        value = value.strip()
        m = re.fullmatch(r"([^()\s]+)\(([^()\s]+)\)", value)
        address = m[2] if m else value
        if address and address not in found:
            found.append(address)
    return found


# -- decisions ---------------------------------------------------------------------------------
def worker_name(job: str, worker_id: int, credential: str) -> str:
    """The Slurm name of a worker's step or job: readable (``tidal-JOB-wID``) and unique to
    the job's run (a digest of the worker's credential, which only a coordinator holding the
    job's token derives), so two jobs of one name never take each other's steps."""
    digest = hashlib.sha256(credential.encode()).hexdigest()[:10]
    return f"tidal-{job}-w{worker_id}-{digest}"


def choose_node(
    alloc: Allocation, taken: Mapping[str, set[int]], lost: Iterable[str]
) -> tuple[str, int] | None:
    """The node of the allocation a new worker goes to and its slot there (the lowest free:
    which of the node's GPUs it takes), or None when no node has a free slot (the worker
    waits). ``taken``: the slots of each node's live workers. Spread, as on joined hosts
    (``placement.place``); a lost node takes nothing."""
    gone = set(lost)
    rooms = [
        Room(
            host_id=i,
            slots=alloc.slots[i],
            used=len(taken.get(n, ())),
            leaving=n in gone,
        )
        for i, n in enumerate(alloc.nodes)
    ]
    chosen = place(rooms)
    if chosen is None:
        return None
    node = alloc.nodes[chosen]
    used = taken.get(node, set())
    return node, next(s for s in range(alloc.slots[chosen]) if s not in used)


def reachable_address(sources: Sequence[str]) -> str | None:
    """The address this machine is reached at from Slurm's nodes: the first of ``sources``
    (the addresses this machine's routes to the controllers, then to the job's nodes, leave
    from) that is not loopback; None if every one is."""
    for source in sources:
        try:
            if not ipaddress.ip_address(source.strip("[]")).is_loopback:
                return source
        except ValueError:
            continue
    return None


def step_argv(
    *, job_id: str, node: str, name: str, command: Sequence[str], extra: Sequence[str] = ()
) -> list[str]:
    """``srun`` starting one worker as a job step of allocation ``job_id`` on ``node``.

    ``--overlap``: the step shares the node's CPUs (and memory, GPUs) with the allocation's
    other steps, the batch script's included: Tidal counts the slots itself (``choose_node``)
    and a step never waits for another to end. ``--input none``: nothing reads its stdin."""
    return [
        "srun",
        f"--jobid={job_id}",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--overlap",
        f"--job-name={name}",
        "--input=none",
        *extra,
        *command,
    ]


def job_argv(*, name: str, command: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """``srun`` submitting one worker as a job of its own (one task on one node), outside an
    allocation: it waits in the queue (``pending``) until Slurm places it. Its partition,
    time limit and resources are ``srun``'s own settings (``SLURM_PARTITION``,
    ``SLURM_TIMELIMIT``, ``SLURM_GPUS_PER_TASK``... in the environment)."""
    return [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--job-name={name}",
        "--input=none",
        *extra,
        *command,
    ]


@dataclass(frozen=True, kw_only=True)
class End:
    """How a worker's ``srun`` ended, as an ``Exit`` says it."""

    returncode: int
    reason: str = ""


_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (\S+)\s*$", re.MULTILINE)
_STEP_REFUSED = re.compile(r"^srun: error: (Unable to create step for job .*)$", re.MULTILINE)


def node_failure(said: str) -> str | None:
    """The node ``srun`` reported failed in its output (``srun: error: Node failure on N``:
    Slurm killed the step because the node went down; srun then exits 0), if any."""
    found = _NODE_FAILURE.findall(said)
    return found[-1] if found else None


@dataclass(frozen=True, kw_only=True)
class NodeFacts:
    """What is known of a worker's node: ``state``, ``sinfo``'s line (None: not listed);
    ``in_job``, whether the allocation still holds it (None: outside an allocation);
    ``srun_failure``, the worker's srun reported the node's failure."""

    name: str
    state: Node | None = None
    in_job: bool | None = None
    srun_failure: bool = False


def node_lost(f: NodeFacts) -> str | None:
    """Why the node is lost, or None. Slurm kills a failed node's steps before ``sinfo``
    shows the node down, but after it removed the node from the allocation (``--no-kill``):
    any of the three signs is enough."""
    if f.state is not None and f.state.lost:
        return f.state.why_lost()
    if f.in_job is False:
        return f"Slurm removed node {f.name} from the job (a node failure)"
    if f.srun_failure:
        return f"Slurm reported a failure of node {f.name}"
    return None


def srun_end(
    returncode: int, *, lost: str | None = None, cancelled: bool = False, said: str = ""
) -> End:
    """A worker's end from its ``srun``'s exit code and last words (``said``): cancelled
    before Slurm placed it, code 0 (the coordinator asked); on a lost node (``lost``: why),
    lost with it (as SIGKILL: a lost machine to recover from, whatever ``srun`` said); a step
    Slurm would not create (the script never ran), lost as well; ``128 + N``, killed by
    signal ``N`` (``srun`` reports a task's signal as a shell does); else the script's own
    code."""
    if cancelled:
        return End(returncode=0, reason="cancelled before Slurm placed it")
    if lost is not None:
        return End(returncode=-signal.SIGKILL, reason=f"lost with its node: {lost}")
    refused = _STEP_REFUSED.findall(said)
    if refused and returncode != 0:
        return End(returncode=-signal.SIGKILL, reason=f"Slurm did not start it: {refused[-1]}")
    if 128 < returncode < 128 + 65:
        return End(returncode=-(returncode - 128))
    return End(returncode=returncode)


def gpu_entry(visible: str | None, slot: int) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` of the worker in ``slot`` of its node, given the step's
    (``visible``: what Slurm gave the step): one device each, round robin; None to leave it
    as it is (no GPU, or one only)."""
    entries = [e for e in (visible or "").split(",") if e.strip()]
    if len(entries) <= 1:
        return None
    return entries[slot % len(entries)].strip()
