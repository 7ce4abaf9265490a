"""A joined host's agent (``tidal worker --join``, the real CLI in a subprocess) against a real
coordinator's API on 127.0.0.1, whose hosts backend the test drives by hand (no control loop
runs): the agent registers, its held poll is answered as soon as a worker is placed on it,
the worker runs as its child with the environment a joined host gives (the interface of its
address for gloo, the URL it joined with), a signal order reaches it, its end is reported
with its code and its log's last line, SIGTERM takes the host out of the job after its
workers' planned leave, and a SIGKILLed agent takes its workers with it and its host is
counted lost within about a second (its poll's connection closed), not after the heartbeat
timeout, while a silent one (a cut network) is lost after the heartbeat timeout and, when
it comes back, ends the worker counted lost. Last, a real job (``tidal run --listen``) whose coordinator is SIGKILLed: its
supervisor restarts it and the host's workers are adopted. The whole job across three
machines is ``tests/test_hosts_netns.py``."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from e2e_helpers import ROOT, pid_alive, relative_l2

from tidal.backends import Exit
from tidal.config import JobSpec
from tidal.coordinator.control.controller import Coordinator
from tidal.host.runner import join_line
from tidal.host.server import ApiServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

WORKER = r"""
import json, os, signal, sys, time
wid = os.environ["TIDAL_WORKER_ID"]
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"worker-{wid}.json")
names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TIDAL_COORDINATOR_URL", "OMP_NUM_THREADS")
with open(out + ".tmp", "w") as f:
    json.dump({"env": {k: os.environ.get(k) for k in names}, "pid": os.getpid(),
               "ppid": os.getppid(), "own_session": os.getsid(0) == os.getpid()}, f)
os.replace(out + ".tmp", out)
if wid == "1":
    print("boom", flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(60)
"""


def until(pred: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Served:
    """A served job on the hosts backend and the agents the test started."""

    def __init__(self, tmp: Path, **spec: object) -> None:
        self.tmp = tmp
        script = tmp / "w.py"
        script.write_text(WORKER)
        spec = JobSpec(
            name="hosted",
            script=str(script),
            backend="hosts",
            listen="127.0.0.1:0",
            max_workers=4,
            **spec,
        )
        self.coord = Coordinator(spec, tmp / "home")
        self.server = ApiServer(self.coord)
        self.coord.url = self.server.url
        self.server.start()
        until(lambda: self.server.started, 30, "the server")
        self.line = join_line(self.coord, self.server.url)
        self.backend = self.coord.executor.backend
        self.agents: list[subprocess.Popen] = []
        self.exits: list[Exit] = []
        self.news: list[str] = []
        self.stopped = False

    def agent(self, *extra: str) -> subprocess.Popen:
        """The join line, as printed, run as another machine would (``--home`` its own)."""
        argv = shlex.split(self.line)[1:]  # "tidal worker --join URL --token-file FILE"
        proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.cli", *argv, "--home", str(self.tmp / "host"), *extra],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.agents.append(proc)
        return proc

    def joined(self, count: int) -> None:
        def seen() -> bool:
            self.exits += self.backend.poll()
            self.news += self.backend.news()
            return sum(" joined: " in n for n in self.news) >= count

        until(seen, 30, f"{count} hosts to join")

    def exit_of(self, wid: int, timeout: float) -> Exit:
        def found() -> Exit | None:
            self.exits += self.backend.poll()
            return next((e for e in self.exits if e.worker_id == wid), None)

        return until(found, timeout, f"worker {wid}'s exit")  # type: ignore[return-value]

    def started(self, wid: int) -> dict:
        path = self.tmp / f"worker-{wid}.json"
        until(path.exists, 30, f"worker {wid} to start")
        return json.loads(path.read_text())

    def env(self, wid: int) -> dict[str, str]:
        return self.coord.lifecycle.worker_env(wid)

    def stop_serving(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.server.stop()

    def close(self) -> None:
        for proc in self.agents:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        self.stop_serving()
        self.coord.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_an_agent_runs_its_orders_and_reports_each_end(served: Served):
    agent = served.agent("--slots", "2")
    served.joined(1)
    t0 = time.monotonic()
    assert served.backend.start(0, served.env(0)) is None  # its agent starts it
    w0 = served.started(0)
    placed_s = time.monotonic() - t0
    assert placed_s < 5, placed_s  # the held poll answered at once, not at its end
    assert w0["ppid"] == agent.pid and w0["own_session"]  # the agent's child, Ctrl-C apart
    env = w0["env"]
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["TIDAL_COORDINATOR_URL"] == served.server.url and env["OMP_NUM_THREADS"] == "1"
    assert served.backend.node(0).endswith("(127.0.0.1)")

    served.backend.start(1, served.env(1))  # prints "boom" and exits 3
    ex = served.exit_of(1, 30)
    assert (ex.returncode, served.backend.describe_exit(1)) == (3, "boom")
    served.backend.start(2, served.env(2))  # in the slot worker 1 freed
    assert served.backend.waiting() == set()
    served.started(2)
    assert served.backend.start(3, served.env(3)) is None and served.backend.waiting() == {3}

    served.backend.signal(0, signal.SIGTERM)  # an order through the agent
    assert served.exit_of(0, 30).returncode == 0
    assert [e.worker_id for e in served.exits].count(0) == 1  # reported once
    served.backend.poll()  # worker 0's slot went to the waiting worker 3
    served.started(3)

    agent.send_signal(signal.SIGTERM)  # the host leaves: its workers leave first
    assert agent.wait(timeout=30) == 0, agent.stderr.read()
    for wid in (2, 3):
        assert served.exit_of(wid, 10).returncode == 0
    assert not pid_alive(served.started(2)["pid"])
    served.backend.poll()
    assert any(" left" in n for n in served.backend.news())


def test_a_killed_agent_takes_its_workers_and_its_host_is_lost_at_once(served: Served):
    agent = served.agent("--slots", "1")
    served.joined(1)
    served.backend.start(0, served.env(0))
    pid = served.started(0)["pid"]
    time.sleep(0.3)  # its next poll is held
    t0 = time.monotonic()
    agent.kill()
    until(lambda: not pid_alive(pid), 10, "the worker to die with its agent")
    ex = served.exit_of(0, 8)
    lost_s = time.monotonic() - t0
    assert ex.returncode == -signal.SIGKILL and "lost with its host" in ex.reason, ex
    assert "connection closed" in ex.reason and lost_s < 5, (ex.reason, lost_s)
    served.backend.poll()
    assert any(" lost: " in n for n in served.backend.news())


def test_a_silent_host_is_lost_and_what_it_ran_is_ended_when_it_comes_back(tmp_path: Path):
    """A host whose network is cut closes no connection: it is lost after the heartbeat
    timeout of silence (here its agent is stopped, SIGSTOP, its worker running on). When it
    comes back the coordinator no longer knows it: it joins again, and ends the worker that
    was counted lost rather than let it train beside its replacement."""
    served = Served(tmp_path, heartbeat_timeout_s=2.0)
    try:
        agent = served.agent("--slots", "1")
        served.joined(1)
        served.backend.start(0, served.env(0))
        pid = served.started(0)["pid"]
        t0 = time.monotonic()
        agent.send_signal(signal.SIGSTOP)
        ex = served.exit_of(0, 15)
        silent_s = time.monotonic() - t0
        assert ex.returncode == -signal.SIGKILL and "no word from its agent" in ex.reason, ex
        assert 1.0 <= silent_s < 8.0, silent_s  # 2 s from its last call, before the stop
        assert pid_alive(pid)  # its agent lives: nothing ended it yet
        agent.send_signal(signal.SIGCONT)
        until(lambda: not pid_alive(pid), 15, "the agent to end the worker counted lost")
        served.joined(2)  # it came back as a new host
        assert [e.worker_id for e in served.exits] == [0]  # its end is not reported twice
    finally:
        served.close()


def test_an_agent_with_a_wrong_token_says_so_in_one_line(served: Served, tmp_path: Path):
    bad = tmp_path / "bad-token"
    bad.write_text("nope\n")
    served.line = served.line.replace(shlex.split(served.line)[-1], str(bad))
    agent = served.agent()
    assert agent.wait(timeout=30) == 1
    lines = agent.stderr.read().strip().splitlines()
    assert lines == [f"tidal: error: the coordinator at {served.server.url} refused the token "
                     "(not this job's hosts')"], lines  # fmt: skip


def test_the_agent_leaves_when_the_job_is_gone(served: Served):
    agent = served.agent()
    served.joined(1)
    served.stop_serving()  # the job ended: nothing listens at its URL any more
    assert agent.wait(timeout=30) == 0
    assert "is gone (the job ended): leaving" in agent.stderr.read()


@pytest.mark.timeout(300)
def test_a_restarted_coordinator_adopts_the_workers_of_its_hosts(tidal_home, reference_params):
    """The coordinator dies (SIGKILL) while a joined host's workers train; its supervisor
    restarts it, the agent registers again listing them, and they are adopted: the job goes
    on and ends as a one-worker run would."""
    out = tidal_home.path / "final.safetensors"
    job = tidal_home.start(
        "adopt",
        *("--listen", "127.0.0.1:0", "--workers", "2"),
        script_args=["--max-steps", "1500", "--double", "--save", str(out)],
    )
    info = job.coordinator_info()
    token_file = job.dir / "join-token"
    agent = tidal_home.popen(
        "worker", "--join", info["url"], "--token-file", str(token_file), "--slots", "2"
    )
    try:
        job.wait_for(lambda s: s["world_size"] == 2 and s["step"] > 30, 120, "2 workers training")
        os.kill(info["pid"], signal.SIGKILL)  # the coordinator, not its supervisor
        status = job.wait_state("succeeded", "failed", timeout=120)
        assert agent.wait(timeout=60) == 0  # it leaves with the job
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=10)
    events = [e["message"] for e in status["events"]]
    assert status["state"] == "succeeded", "\n".join(events)
    assert any("2 live workers [0, 1] adopted" in e for e in events), events
    assert any(e.endswith("running workers [0, 1] (adopted)") for e in events), events
    assert not any("failed" in e for e in events if e.startswith("worker")), events
    assert relative_l2(out, reference_params(1500, 0, double=True)) < 1e-12
    tidal_home.assert_no_processes()
