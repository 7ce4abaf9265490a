"""Shared helpers of the bench suite: ports, processes, step records, statistics.

Every process a measurement starts carries ``TIDAL_BENCH_OWNER=<uuid>`` in its environment
(torchrun's and Tidal's workers inherit it), so ``Procs.cleanup`` can find and SIGKILL
whatever survives a measurement without touching anybody else's processes.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# pytorch issue 135712: restarted workers otherwise reuse the agent's store with stale gloo
# addresses and recover badly (or deadlock) on one host (bench.peers).
from bench.peers import TORCHRUN_ENV  # noqa: F401 - re-exported
from bench.rows import percentile, row  # noqa: F401 - re-exported

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "bench" / "train_mlp.py"
MARKER_VAR = "TIDAL_BENCH_OWNER"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(values: Sequence[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- processes ------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def pid_alive(pid: int | None) -> bool:
    return bool(pid) and _alive(int(pid))


class Procs:
    """Processes of one measurement, all marked; ``cleanup`` kills every one left."""

    def __init__(self) -> None:
        self.marker = uuid.uuid4().hex
        self.popens: list[subprocess.Popen] = []

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
        env.update({"PYTHONUNBUFFERED": "1", MARKER_VAR: self.marker, "OMP_NUM_THREADS": "1"})
        env.update(extra or {})
        return env

    def start(self, cmd: list[str], log_path: Path, extra_env: dict | None = None):
        fh = open(log_path, "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=self.env(extra_env),
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed as one
        )
        fh.close()
        self.popens.append(proc)
        return proc

    def marked(self) -> list[int]:
        needle = f"{MARKER_VAR}={self.marker}".encode() + b"\0"
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                env = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in env and _alive(int(entry.name)):
                found.append(int(entry.name))
        return found

    @staticmethod
    def signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def cleanup(self, grace_s: float = 3.0) -> None:
        """SIGTERM every process group we started, then SIGKILL everything still marked."""
        for proc in self.popens:
            if proc.poll() is None:
                self.signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.popens):
            time.sleep(0.05)
        for _ in range(3):
            for proc in self.popens:
                if proc.poll() is None:
                    self.signal_group(proc, signal.SIGKILL)
            for pid in self.marked():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.2)
            if not self.marked():
                break
        for proc in self.popens:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


# -- step records written by train_mlp.py ---------------------------------------------------
@dataclass(frozen=True)
class Rec:
    kind: str  # "B" (a step begins) or "E" (its gradients are synchronised)
    time: float  # time.time()
    index: int  # global step index (torchrun restarts count from 0 again)
    world: int
    rank: int
    pid: int


def read_records(directory: Path) -> list[Rec]:
    recs = []
    for path in directory.glob("steps-*.txt"):
        pid = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 5:
                continue  # a line cut by a kill
            kind, t, index, world, rank = parts
            recs.append(Rec(kind, float(t), int(index), int(world), int(rank), pid))
    recs.sort(key=lambda r: r.time)
    return recs


def ends(recs: list[Rec]) -> list[Rec]:
    return [r for r in recs if r.kind == "E"]


def wait_until(pred, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def tidal_cmd(home: Path, name: str, *opts: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tidal.cli",
        "run",
        "--home",
        str(home),
        "--name",
        name,
        "--quiet",
        *opts,
    ]


def torchrun_cmd(*opts: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *opts]


def median_to_sync(recs: list[Rec], world: int) -> float:
    """Median time from a step's begin to its gradients' synchronisation (``B`` to ``E`` of
    the same step and process) at ``world`` members: the compute before the all-reduce."""
    begun = {(r.pid, r.index, r.world): r.time for r in recs if r.kind == "B"}
    return median(
        r.time - begun[key]
        for r in ends(recs)
        if r.world == world and (key := (r.pid, r.index, r.world)) in begun
    )


def median_step(recs: list[Rec], world: int) -> float:
    """Median time between consecutive step ends of one process at ``world`` members."""
    by_pid: dict[int, list[Rec]] = {}
    for r in ends(recs):
        by_pid.setdefault(r.pid, []).append(r)
    diffs = []
    for rs in by_pid.values():
        for a, b in zip(rs, rs[1:], strict=False):
            if a.world == b.world == world and b.index == a.index + 1:
                diffs.append(b.time - a.time)
    return median(diffs)
