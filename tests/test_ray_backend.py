"""``--backend ray`` on a real multi-node Ray cluster started by each test.

The cluster is Ray's own ``ray.cluster_utils.Cluster``: every node is a real raylet with its
own resources, on this machine. Each node offers one CPU and each worker asks for one, so
two workers must land on two nodes, and a third waits for a third node. Token
authentication is on (``RAY_AUTH_MODE=token``): the coordinator joins with the token, as a
user's ``tidal run`` does. Run alone with ``pytest -m ray``.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from e2e_helpers import (
    DIGITS,
    ROOT,
    Home,
    event_messages,
    pid_alive,
    relative_l2,
    summarize,
    wait_gone,
)

from tidal.coordinator.records.home import db_path

if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed: pip install -e '.[ray]'", allow_module_level=True)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]
# The acceptance bound, as on the local backend: a restarted coordinator joins the cluster
# again as a new driver (0.46-0.64 s here) and answers within it.
RAY_RESTART_S = 2.0


class RayCluster:
    """A Ray cluster of one-CPU nodes on this machine, token authentication on."""

    def __init__(self, nodes: int) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        self.nodes = [self.cluster.head_node]
        for _ in range(nodes - 1):
            self.add_node()

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self):
        node = self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()
        self.nodes.append(node)
        return node

    def kill_raylet(self, node) -> None:
        """SIGKILL the node's raylet, as when its machine is lost."""
        (raylet,) = node.all_processes["raylet"]
        os.kill(raylet.process.pid, signal.SIGKILL)

    def shutdown(self) -> None:
        self.cluster.shutdown()


@pytest.fixture(scope="session")
def ray_token() -> Iterator[str]:
    """Token authentication for every cluster of the session and every process that joins
    one. Set before this process first imports Ray, which reads the mode once."""
    token = secrets.token_hex(16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "token")
        mp.setenv("RAY_AUTH_TOKEN", token)
        yield token


@pytest.fixture
def fresh_nodes(ray_token: str) -> Iterator[RayCluster]:
    """Two nodes for a test that changes the cluster (loses or adds a node)."""
    cluster = RayCluster(nodes=2)
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def two_nodes(ray_token: str) -> Iterator[RayCluster]:
    """Two nodes shared by the tests that leave the cluster as they found it (each checks
    that its job left no process behind); ~8 s a cluster saved. They come after the tests
    of ``fresh_nodes`` in this file, so that two clusters never run at once."""
    cluster = RayCluster(nodes=2)
    try:
        yield cluster
    finally:
        cluster.shutdown()


def ray_opts(cluster: RayCluster, *extra: str) -> list[str]:
    return ["--backend", "ray", "--ray-address", cluster.address, *extra]


def node_ids(status: dict, *states: str) -> set[str]:
    return {w["node"] for w in status["workers"] if not states or w["state"] in states}


def test_node_loss_is_a_worker_failure(
    tidal_home: Home, fresh_nodes: RayCluster, reference_params
) -> None:
    out = tidal_home.path / "final.safetensors"
    job = tidal_home.start(
        "rayloss",
        *ray_opts(fresh_nodes, "--workers", "2"),
        # 1500 float64 steps (the coordinator crash tests' reference): a fast machine did
        # 600 float32 ones in ~1.5 s, before the lost node's worker had died (2026-12-03).
        script_args=["--max-steps", "1500", "--double", "--save", str(out)],
    )
    status = job.wait_for(
        lambda s: s["world_size"] == 2 and s["step"] >= 30, 120, "2 workers past step 30"
    )
    second = fresh_nodes.nodes[1]
    first = {w["id"] for w in status["workers"]}
    (lost,) = [w["id"] for w in status["workers"] if w["node"] == second.node_id]
    fresh_nodes.kill_raylet(second)

    status = job.wait_state("succeeded", "failed", timeout=180)
    assert status["state"] == "succeeded", f"{summarize(status)}\n{job.logs_tail()}"
    # The survivor went on alone on the first node, from where the pair had got to.
    last = status["generations"][-1]
    assert last["world_size"] == 1 and lost not in last["members"], summarize(status)
    assert last["start_step"] >= 30
    assert any(f"worker {lost} failed" in m for m in event_messages(status, "failure"))
    # No room for a replacement: it waited as pending, and was cancelled at the end.
    formed_after = [g for g in status["generations"][1:] if g["start_step"] is not None]
    assert [g["world_size"] for g in formed_after] == [1], summarize(status)
    (replacement,) = [w for w in status["workers"] if w["id"] not in first]
    assert replacement["node"] is None and replacement["state"] == "exited"
    assert any("cancelled before Ray placed it" in m for m in event_messages(status))
    # At most one step redone, none applied twice: still a 1-worker run's parameters.
    assert relative_l2(out, reference_params(1500, 0, double=True)) < 1e-12
    tidal_home.assert_no_processes()


def test_third_worker_waits_for_a_third_node(tidal_home: Home, fresh_nodes: RayCluster) -> None:
    job = tidal_home.start(
        "raypend",
        *ray_opts(fresh_nodes, "--workers", "2", "--max-workers", "3"),
        script_args=["--max-steps", "1000000", "--log-every", "1000"],
    )
    job.wait_for(lambda s: s["world_size"] == 2, 120, "2 workers training")
    assert job.scale(3).returncode == 0
    status = job.wait_for(lambda s: s["pending_workers"] == 1, 30, "a pending worker")
    (pending,) = [w for w in status["workers"] if w["state"] == "pending"]
    assert status["target_workers"] == 3 and status["world_size"] == 2

    # Still pending a while later: the target is kept, nothing fails.
    later = job.wait_for(lambda s: s["step"] > status["step"] + 50, 60, "50 more steps")
    assert later["pending_workers"] == 1 and later["target_workers"] == 3
    assert later["world_size"] == 2 and later["state"] == "running"

    third = fresh_nodes.add_node()
    status = job.wait_for(lambda s: s["world_size"] == 3, 120, "the third worker joined")
    joined = {w["id"]: w for w in status["workers"]}[pending["id"]]
    assert joined["state"] == "running" and joined["node"] == third.node_id
    assert node_ids(status, "running") == {n.node_id for n in fresh_nodes.nodes}
    assert status["pending_workers"] == 0

    # Scale-down removes a worker (the highest rank): its actor ends and frees its node.
    assert job.scale(2).returncode == 0
    status = job.wait_for(
        lambda s: s["world_size"] == 2 and s["generations"][-1]["start_step"] is not None,
        60,
        "back to 2 workers",
    )
    left = [w for w in status["workers"] if w["state"] in ("exited", "stopping")]
    assert len(left) == 1, summarize(status)
    assert not any(m.endswith("failed") for m in event_messages(status, "failure"))

    assert job.stop().returncode == 0
    assert job.wait_state("stopped", timeout=60)["state"] == "stopped"
    tidal_home.assert_no_processes()


def test_two_nodes_train_digits(tidal_home: Home, two_nodes: RayCluster, reference_params) -> None:
    out = tidal_home.path / "final.safetensors"
    job = tidal_home.start(
        "ray2",
        *ray_opts(two_nodes, "--workers", "2"),
        script_args=["--max-steps", "200", "--save", str(out)],
    )
    # The URL the workers reach the coordinator at, while the job runs (an ended job's
    # status names none: nothing answers there any more).
    url = job.wait_for(lambda s: s["url"] is not None, 120, "the job's url")["url"]
    status = job.wait_state("succeeded", "failed", "stopped", timeout=240)
    assert status["state"] == "succeeded", f"{summarize(status)}\n{job.logs_tail()}"
    assert status["metrics"]["accuracy"] > 0.9
    # One worker on each node: each node has room for one.
    assert node_ids(status) == {n.node_id for n in two_nodes.nodes}, summarize(status)
    assert [g["world_size"] for g in status["generations"]] == [2]
    # Workers reached the coordinator at the node's address, not at loopback.
    host = urlparse(url).hostname
    assert host and not host.startswith("127."), url
    # Same mathematics as anywhere else: equal to a 1-worker local run.
    assert relative_l2(out, reference_params(200)) < 1e-4
    tidal_home.assert_no_processes()


def test_wrong_ray_token_is_one_line(tidal_home: Home, two_nodes: RayCluster) -> None:
    env = {**tidal_home.env(), "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    # Ray's driver retries the refused connection once a second, 20 times by default: two
    # are enough to see the refusal (Ray's own setting; 20 s -> 2 s here).
    env["RAY_gcs_server_port_wait_time_s"] = "2"
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "run", "--home", str(tidal_home.path)]
        + ray_opts(two_nodes, "--workers", "1", "--quiet")
        + [str(DIGITS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("tidal: error: cannot join a Ray cluster"), proc.stderr
    # Nothing recorded for a job that never started.
    assert not db_path(tidal_home.path).exists()


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_killed_actor_process_is_replaced(tidal_home: Home, two_nodes: RayCluster) -> None:
    job = tidal_home.start(
        "rayactor",
        *ray_opts(two_nodes, "--workers", "2"),
        script_args=["--max-steps", "1000000", "--log-every", "1000"],
    )
    status = job.wait_for(
        lambda s: s["world_size"] == 2 and s["step"] >= 30, 120, "2 workers past step 30"
    )
    second = two_nodes.nodes[1].node_id
    first = {w["id"] for w in status["workers"]}
    (victim,) = [w for w in status["workers"] if w["node"] == second]
    actor = parent_of(victim["pid"])  # the worker's script is the actor's child
    assert Path(f"/proc/{actor}/cmdline").read_bytes().startswith(b"ray::"), actor
    os.kill(actor, signal.SIGKILL)

    # The script died with its actor; the freed node takes a replacement, which joins.
    status = job.wait_for(
        lambda s: (
            s["world_size"] == 2
            and any(w["id"] not in first and w["state"] == "running" for w in s["workers"])
        ),
        120,
        "a replacement on the freed node",
    )
    assert not pid_alive(victim["pid"])
    by_id = {w["id"]: w for w in status["workers"]}
    assert by_id[victim["id"]]["state"] == "failed"
    (new,) = [w for w in status["workers"] if w["id"] not in first]
    assert new["node"] == second
    assert any(f"worker {victim['id']} failed" in m for m in event_messages(status, "failure"))

    assert job.stop().returncode == 0
    assert job.wait_state("stopped", timeout=60)["state"] == "stopped"
    tidal_home.assert_no_processes()


def _reregistered(status: dict) -> list[str]:
    return [m for m in event_messages(status, "worker") if "re-registered (generation 1" in m]


def test_sigkill_of_the_coordinator_loses_nothing_on_ray(
    tidal_home: Home, two_nodes: RayCluster, reference_params
) -> None:
    """The coordinator is the cluster's driver; its workers' actors are detached. Killed at
    step >= 100, it is restarted (a new driver), adopts both actors by name, and the same
    two scripts finish the job in the generation they formed, exactly as one worker."""
    steps = 1500  # the 1-worker run of test_coordinator_crash's (trained once a session)
    out = tidal_home.path / "final.safetensors"
    job = tidal_home.start(
        "raycrash",
        *ray_opts(two_nodes, "--workers", "2"),
        script_args=["--max-steps", str(steps), "--double", "--save", str(out)],
    )
    before = job.wait_for(
        lambda s: s["world_size"] == 2 and s["step"] >= 100, 120, "2 workers past step 100"
    )
    pids = {w["id"]: w["pid"] for w in before["workers"] if w["state"] == "running"}
    assert len(pids) == 2, summarize(before)
    old = job.coordinator_info()
    assert old["supervisor_pid"] and old["pid"] != old["supervisor_pid"], old
    os.kill(old["pid"], signal.SIGKILL)
    killed_at, step_at_kill = time.monotonic(), before["step"]
    job.wait_for(
        lambda s: s.get("coordinator_pid") not in (None, old["pid"]),
        timeout=60,
        what="a restarted coordinator answering",
        interval=0.05,
    )
    took = time.monotonic() - killed_at
    print(f"the coordinator answered again {took:.2f} s after its SIGKILL")
    assert took <= RAY_RESTART_S, f"the coordinator answered again after {took:.2f} s"

    # Then `tidal run` itself dies (the supervisor and its coordinator): the actors train on,
    # and `tidal attach` on this node adopts them again.
    adopted = job.wait_for(lambda s: len(_reregistered(s)) == 2, 60, "both workers re-registered")
    info = job.coordinator_info()
    for pid in (info["supervisor_pid"], info["pid"]):
        os.kill(pid, signal.SIGKILL)
    assert not wait_gone([info["supervisor_pid"], info["pid"]], timeout=10)
    orphaned = job.status()  # from SQLite
    assert orphaned["state"] == "interrupted", summarize(orphaned)
    attached = tidal_home.cli("attach", "raycrash", "--detach")
    assert attached.returncode == 0 and attached.stdout.strip() == "raycrash", attached.stderr

    status = job.wait_state("succeeded", "failed", "stopped", "interrupted", timeout=240)
    assert status["state"] == "succeeded" and status["step"] == steps, summarize(status)
    assert {w["id"]: w["pid"] for w in status["workers"]} == pids, summarize(status)
    assert len(status["generations"]) == 1, summarize(status)
    steps_at = [int(m.rsplit("step ", 1)[1].rstrip(")")) for m in _reregistered(status)]
    assert len(steps_at) == 4 and min(steps_at) > step_at_kill, summarize(status)
    # Re-registered with the attached coordinator after training on, orphaned.
    assert min(steps_at[2:]) > adopted["step"], summarize(status)
    adoptions = [m for m in event_messages(status, "coordinator") if "2 live workers" in m]
    assert len(adoptions) == 2, summarize(status)  # the supervisor's restart, the attach
    rel = relative_l2(out, reference_params(steps, 0, double=True))
    assert rel <= 1e-12, f"parameters differ from the 1-worker run: relative L2 {rel:.3e}"
    tidal_home.assert_no_processes()
