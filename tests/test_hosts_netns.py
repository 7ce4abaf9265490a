"""One job across three machines without Ray: three network namespaces joined by a bridge,
made by the test (as root), each its own address; the coordinator in the first (``tidal run
--listen``, no local slots), a host agent in each of the others (``tidal worker --join``, the
line ``tidal run`` printed). Digits in float64 goes 2 -> 3 -> 2 workers by ``tidal scale``
(run in the coordinator's namespace, as a user would there), spread over both hosts; then one
host's agent and its workers are SIGKILLed: its host is counted lost, the survivor goes on
and a replacement starts on the other host. The job succeeds with the parameters of a
one-worker run (relative 1e-12).

Traffic goes only to the namespaces' own addresses: the namespaces have no route anywhere
else (their only link is the bridge), every process of the job runs inside one of them
(checked by its network namespace), and every TCP connection the hosts' namespaces hold
while three workers train is between 10.213.0.x addresses (or loopback inside one
namespace). The test reads the job's records from SQLite files only, never over the network.

Where namespaces cannot be made (not root, no ``ip``), it skips saying why; under CI (which
runs as root) it fails instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import DIGITS, ROOT, Home, relative_l2, summarize
from job_records import JobRecords, formed, members
from pacing import arm_pacing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NET = "10.213.0"
ADDRESS = {"a": f"{NET}.1", "b": f"{NET}.2", "c": f"{NET}.3"}
STEPS = 1500  # the reference the Ray and coordinator-crash tests share (one run a session)
NAME = "spread"
JOB = JobRecords(NAME)
records, wait = JOB.read, JOB.wait
#: Seconds a worker sleeps in each loss it computes, while the test waits for a worker to
#: start (exec and ``import torch``: seconds, more on a loaded machine): the job keeps
#: training, slowly, and does not run out of steps before every change is done; then 0.
SLOW_S = 0.05


class Machines:
    """Three network namespaces on one bridge (in the first), addresses ``ADDRESS``; names
    carry the test's pid, so two runs never share one."""

    def __init__(self) -> None:
        tag = os.getpid()
        self.ns = {m: f"tidal{tag}{m}" for m in ADDRESS}

    def ip(self, *args: str) -> None:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise OSError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")

    def up(self) -> None:
        a = self.ns["a"]
        for ns in self.ns.values():
            self.ip("netns", "add", ns)
            self.ip("-n", ns, "link", "set", "lo", "up")
        self.ip("-n", a, "link", "add", "br0", "type", "bridge")
        self.ip("-n", a, "addr", "add", f"{ADDRESS['a']}/24", "dev", "br0")
        self.ip("-n", a, "link", "set", "br0", "up")
        for m in ("b", "c"):
            ns = self.ns[m]
            self.ip(
                "link", "add", f"to-{m}", "netns", a, "type", "veth", "peer", "eth0", "netns", ns
            )
            self.ip("-n", a, "link", "set", f"to-{m}", "master", "br0", "up")
            self.ip("-n", ns, "addr", "add", f"{ADDRESS[m]}/24", "dev", "eth0")
            self.ip("-n", ns, "link", "set", "eth0", "up")

    def down(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def run(self, m: str, *argv: str) -> list[str]:
        """``argv`` as a command run on machine ``m``."""
        return ["ip", "netns", "exec", self.ns[m], *argv]

    def tcp(self, m: str) -> list[tuple[str, str]]:
        """The (local, remote) addresses of machine ``m``'s established TCP connections."""
        out = subprocess.run(
            self.run(m, "cat", "/proc/net/tcp"), capture_output=True, text=True, timeout=30
        ).stdout
        pairs = []
        for line in out.splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01":  # ESTABLISHED
                pairs.append((_ipv4(fields[1]), _ipv4(fields[2])))
        return pairs


def _ipv4(hex_addr: str) -> str:
    packed = bytes.fromhex(hex_addr.split(":")[0])
    return ".".join(str(b) for b in reversed(packed))


@pytest.fixture
def machines() -> Iterator[Machines]:
    reason = None
    if os.geteuid() != 0:
        reason = "network namespaces need root (`ip netns add`); CI runs as root"
    elif shutil.which("ip") is None:
        reason = "no `ip` command (iproute2) to make network namespaces with"
    m = Machines()
    if reason is None:
        try:
            m.up()
        except OSError as exc:
            m.down()
            reason = f"network namespaces cannot be made here: {exc}"
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield m
    finally:
        m.down()


def host_of(worker: dict) -> str | None:
    found = re.search(r"\((10\.213\.0\.\d+)\)$", worker["node"] or "")
    return found[1] if found else None


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_a_job_spreads_over_joined_hosts_and_survives_losing_one(
    tidal_home: Home, machines: Machines, reference_params, tmp_path: Path
):
    out = tmp_path / "final.safetensors"
    env = tidal_home.env()
    # the job's workers paced, never the agents (no worker id in their environment)
    agent_env, pace = arm_pacing(tmp_path, env, "HOSTS_TEST_PACE", slow_s=SLOW_S)
    home = str(tidal_home.path)

    def cli(m: str, *args: str) -> list[str]:
        return machines.run(m, sys.executable, "-m", "tidal.cli", *args)

    coordinator = subprocess.Popen(
        cli("a", "run", "--home", home, "--name", NAME, "--quiet", "--listen", f"{ADDRESS['a']}:0",
            "--local-slots", "0", "--workers", "2", "--max-workers", "3",
            str(DIGITS), "--max-steps", str(STEPS), "--double", "--save", str(out)),
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    t0 = time.monotonic()
    timeline: list[str] = []  # when each phase ended: in a failure's message (and with -s)

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:6.1f} s  {what}")

    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(coordinator.stderr), daemon=True)
    reader.start()
    agents: dict[str, subprocess.Popen] = {}

    def logs() -> str:
        parts = ["--- timeline ---", *timeline, "--- tidal run ---", *said[-20:]]
        for m in agents:
            parts += [f"--- agent {m} ---", (tmp_path / f"agent-{m}.log").read_text()[-3000:]]
        for log in sorted(tmp_path.glob("host-*/jobs/*/logs/worker-*.log")):
            parts += [f"--- {log.parent.parent.parent.parent.name} {log.name} ---"]
            parts += log.read_text(errors="replace").splitlines()[-8:]
        return "\n".join(parts)

    try:
        deadline = time.monotonic() + 60
        join = None
        while join is None and time.monotonic() < deadline and coordinator.poll() is None:
            join = next(
                (m[1] for line in said if (m := re.search(r"(tidal worker .*)$", line))), None
            )
            time.sleep(0.05)
        assert join, f"no join line printed:\n{logs()}"
        url = re.search(r"--join (\S+)", join)[1]
        assert url.startswith(f"http://{ADDRESS['a']}:"), join  # the address it was told

        for m in ("b", "c"):  # the line as printed, run on each host
            with open(tmp_path / f"agent-{m}.log", "w") as log:
                argv = [*join.split()[1:], "--slots", "2", "--home", str(tmp_path / f"host-{m}")]
                agents[m] = subprocess.Popen(
                    cli(m, *argv), cwd=ROOT, env=agent_env, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=log,
                )  # fmt: skip

        wait(
            tidal_home, lambda s: formed(2)(s) and s["step"] >= 20, 120, "2 workers training", logs
        )
        mark("2 workers training")
        scaled = subprocess.run(cli("a", "scale", "--home", home, NAME, "3"), env=env,
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert scaled.returncode == 0, scaled.stderr
        three = wait(tidal_home, formed(3), 90, "3 workers training", logs)
        mark("3 workers training")
        assert {host_of(w) for w in members(three)} == {ADDRESS["b"], ADDRESS["c"]}, summarize(
            three
        )
        seen = machines.tcp("b") + machines.tcp("c")  # while three workers train
        assert seen, "no TCP connection in the hosts' namespaces"
        for local, remote in seen:
            for addr in (local, remote):
                assert addr.startswith(f"{NET}.") or addr.startswith("127."), (local, remote)

        scaled = subprocess.run(cli("a", "scale", "--home", home, NAME, "2"), env=env,
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert scaled.returncode == 0, scaled.stderr
        two = wait(tidal_home, formed(2), 60, "back to 2 workers", logs)
        mark("back to 2 workers")
        # The scale-down took from the host holding two: one worker on each host.
        assert sorted(host_of(w) for w in members(two)) == [ADDRESS["b"], ADDRESS["c"]]
        assert two["step"] < STEPS - 300, "the job ran out of steps before the host's loss"

        # Every process of the job runs in a namespace of the three, none in this one.
        here = os.stat("/proc/self/ns/net").st_ino
        job_pids = tidal_home.live_processes()
        assert len(job_pids) >= 5, job_pids  # supervisor, coordinator, 2 agents, 2 workers
        for pid in job_pids:
            assert os.stat(f"/proc/{pid}/ns/net").st_ino != here, pid

        # Host c is lost: its agent and its workers, SIGKILLed at once.
        victim = agents["c"]
        lost = [w["id"] for w in two["workers"] if host_of(w) == ADDRESS["c"]
                and w["state"] not in ("exited", "failed")]  # fmt: skip
        doomed = [victim.pid, *children_of(victim.pid)]
        assert len(doomed) >= 2, doomed  # the agent and its worker(s)
        for pid in doomed:
            os.kill(pid, signal.SIGKILL)
        killed_at, known = two["step"], max(w["id"] for w in two["workers"])
        wait(
            tidal_home,
            lambda s: formed(2)(s) and max(s["generations"][-1]["members"]) > known,
            120,
            "a replacement for the lost host's worker to join",
            logs,
        )
        mark("the replacement joined")
        pace.write_text("0")  # every change is done: the rest at full speed

        end = wait(
            tidal_home, lambda s: s["state"] in ("succeeded", "failed"), 150, "the end", logs
        )
        assert coordinator.wait(timeout=60) == 0, logs()
        assert agents["b"].wait(timeout=60) == 0, logs()  # it leaves when the job is gone
        mark("the job ended, its hosts left")
    finally:
        for proc in [coordinator, *agents.values()]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)

    final = subprocess.run(cli("a", "status", "--home", home, NAME, "--json"), env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert final.returncode == 0, final.stderr
    status = json.loads(final.stdout)
    assert status["state"] == "succeeded" == end["state"], summarize(status)
    events = [e["message"] for e in status["events"]]
    assert any(re.match(rf"host \d+ \(.*\({ADDRESS['c']}\)\) lost: ", e) for e in events), events
    by_id = {w["id"]: w for w in status["workers"]}
    for wid in lost:
        assert by_id[wid]["state"] == "failed", summarize(status)
    assert any("lost with its host" in e for e in events if e.startswith("worker")), events
    # Every worker ran on a joined host; the replacement on the host that survived.
    assert {host_of(w) for w in status["workers"]} <= {ADDRESS["b"], ADDRESS["c"]}
    replacements = [w for w in status["workers"] if w["id"] > known]
    assert replacements and {host_of(w) for w in replacements} == {ADDRESS["b"]}, summarize(status)
    last = status["generations"][-1]
    assert last["world_size"] == 2 and last["start_step"] >= killed_at, summarize(status)
    # One worker's mathematics, to float64 rounding, through 2 -> 3 -> 2 and a lost host.
    reference = reference_params(STEPS, 0, double=True)
    mark("the reference: a one-worker run (once a session)")
    print("\n".join(timeline))
    assert relative_l2(out, reference) < 1e-12
    tidal_home.assert_no_processes()
