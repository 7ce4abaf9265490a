"""A real Slurm cluster on this machine for the tests (``tests/test_slurm.py``): Debian's
``slurm-wlm`` (22.05) daemons, started and stopped by the test.

Each machine is a network namespace on one bridge, with its own address (``NET.x``): the
first (``ctl``) runs ``munged`` and ``slurmctld`` and is where a user types commands (the
login node: ``salloc``, ``tidal run``, ``scontrol``); each of the others runs one ``slurmd``
(``slurmd -N NAME``). Debian's build also runs several ``slurmd`` on localhost (distinct
``Port=``), but every node would then be 127.0.0.1: a node of its own address is what a
worker binds on a real cluster, and what the test checks. Everything lives in a temporary folder:
``slurm.conf`` (its ports chosen at run time), the munge key and socket, the daemons' state,
spool and logs. ``stop`` ends every process in the namespaces (the daemons, their
``slurmstepd``, any job's tasks) and removes them.

``unavailable()`` says why no cluster can be made here (not root, no ``ip``, no Slurm).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NET = "10.214.0"
DAEMONS = ("munged", "slurmctld", "slurmd")
MUNGED = "/usr/sbin/munged"


def unavailable() -> str | None:
    """Why a cluster cannot be made on this machine, or None."""
    if os.geteuid() != 0:
        return "the Slurm cluster's network namespaces need root (`ip netns add`); CI runs as root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make the cluster's network namespaces with"
    missing = [d for d in ("slurmctld", "slurmd", "srun") if shutil.which(d) is None]
    if missing or not (shutil.which("munged") or Path(MUNGED).exists()):
        return (
            "Slurm is not installed (no slurmctld, slurmd or munged): apt-get install "
            "slurm-wlm munge (.ci/run does)"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """``nodes`` compute nodes of ``cpus`` CPUs each (``n1``...), their namespaces named
    after this process (two runs never share one)."""

    def __init__(self, root: Path, *, nodes: int = 3, cpus: int = 2) -> None:
        self.root = root
        tag = os.getpid()
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.ns = {"ctl": f"slurm{tag}ctl", **{n: f"slurm{tag}{n}" for n in self.nodes}}
        self.address = {"ctl": f"{NET}.1"}
        self.address.update({n: f"{NET}.{i + 2}" for i, n in enumerate(self.nodes)})
        self.cpus = cpus
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    # -- machines ------------------------------------------------------------------------
    def _ip(self, *args: str) -> None:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise OSError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")

    def _network(self) -> None:
        ctl = self.ns["ctl"]
        for ns in self.ns.values():
            self._ip("netns", "add", ns)
            self._made.append(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
        self._ip("-n", ctl, "link", "add", "br0", "type", "bridge")
        self._ip("-n", ctl, "addr", "add", f"{self.address['ctl']}/24", "dev", "br0")
        self._ip("-n", ctl, "link", "set", "br0", "up")
        for n in self.nodes:
            self._ip(
                "link", "add", f"to-{n}", "netns", ctl, "type", "veth", "peer", "eth0", "netns",
                self.ns[n],
            )  # fmt: skip
            self._ip("-n", ctl, "link", "set", f"to-{n}", "master", "br0", "up")
            self._ip("-n", self.ns[n], "addr", "add", f"{self.address[n]}/24", "dev", "eth0")
            self._ip("-n", self.ns[n], "link", "set", "eth0", "up")

    def run(self, machine: str, *argv: str) -> list[str]:
        """``argv`` as a command run on ``machine`` (``ctl`` or a node's name)."""
        return ["ip", "netns", "exec", self.ns[machine], *argv]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose Slurm commands reach this cluster."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def command(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm command (``scontrol``, ``scancel``, ``squeue``...) run on ``ctl``."""
        return subprocess.run(
            self.run("ctl", *argv), env=self.env(), capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    # -- the daemons ---------------------------------------------------------------------
    def _config(self) -> None:
        r = self.root
        for sub in ("ctld", "spool", "log", "munge", *(f"spool/{n}" for n in self.nodes)):
            (r / sub).mkdir(mode=0o700)
        # slurmd loads a cgroup plugin whatever else it uses (22.05 has no "disabled"), and
        # its autodetection misses a container's tmpfs of v1 hierarchies: name it.
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        (r / "cgroup.conf").write_text(f"CgroupPlugin=cgroup/{'v2' if v2 else 'v1'}\n")
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={self.address[n]} CPUs={self.cpus} State=UNKNOWN"
            for n in self.nodes
        )
        self.conf.write_text(
            f"""\
ClusterName=tidaltest
SlurmctldHost={socket.gethostname()}({self.address["ctl"]})
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r / "munge" / "munge.socket"}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r / "ctld"}
SlurmdSpoolDir={r / "spool"}/%n
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "spool"}/slurmd-%n.pid
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log"}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=1
KillWait=5
MessageTimeout=10
SlurmdTimeout=300
InactiveLimit=0
MinJobAge=300
{nodes}
PartitionName=main Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _daemon(self, machine: str, *argv: str) -> None:
        log = open(self.root / "log" / f"{argv[0].rsplit('/', 1)[-1]}-{machine}.out", "ab")
        with log:
            self.procs.append(
                subprocess.Popen(
                    self.run(machine, *argv),
                    env=self.env(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )  # fmt: skip
            )

    def start(self, timeout: float = 60) -> None:
        self._network()
        self._config()
        m = self.root / "munge"
        munged = shutil.which("munged") or MUNGED
        self._daemon(
            "ctl", munged, "--foreground", "--force", f"--socket={m / 'munge.socket'}",
            f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
            f"--seed-file={m / 'munged.seed'}", f"--log-file={m / 'munged.log'}",
        )  # fmt: skip
        self._wait(lambda: (m / "munge.socket").exists(), 20, "munged's socket")
        self._daemon("ctl", "slurmctld", "-D", "-i", "-f", str(self.conf))
        for n in self.nodes:
            self._daemon(n, "slurmd", "-D", "-N", n, "-f", str(self.conf))
        self._wait(self._idle, timeout, "every node idle")

    def _idle(self) -> bool:
        out = self.command("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
        states = dict(zip(out[::2], out[1::2], strict=False))
        return sorted(states) == sorted(self.nodes) and set(states.values()) == {"idle"}

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = "a daemon exited" if dead else f"timed out after {timeout:.0f} s"
                raise RuntimeError(
                    f"the Slurm cluster did not start ({why}: {what})\n{self.logs()}"
                )
            time.sleep(0.1)

    def logs(self, lines: int = 15) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if path.is_file():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name} ---\n" + "\n".join(text))
        return "\n".join(parts)

    # -- the end -------------------------------------------------------------------------
    def pids(self) -> set[int]:
        """Every process in the cluster's namespaces (daemons, steps, tasks)."""
        found: set[int] = set()
        for ns in self._made:
            out = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
            ).stdout
            found |= {int(p) for p in out.split()}
        return found

    def stop(self) -> None:
        for proc in self.procs:  # our own children: the daemons
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for _ in range(50):  # whatever ran in the namespaces: only ours run there
            left = self.pids()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()
