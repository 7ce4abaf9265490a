"""``--backend slurm`` against a real Slurm (Debian's ``slurm-wlm`` 22.05): a controller and
three compute nodes, each a network namespace of its own address, started by the test
(``slurm_cluster``).

One job, as a user runs it in an allocation: ``salloc --nodes 3 --ntasks-per-node 1
--no-kill tidal run --backend slurm --workers 2 --max-workers 3`` on the login node (the
controller's namespace). Each worker is a job step (``srun --overlap``) on a node of the
allocation, spread one a node; digits in float64 grows to 3 by ``tidal scale``; a node
set DOWN by ``scontrol update`` loses its worker (a failure: the job re-forms without it,
and the replacement waits ``pending``, no member, since the lost node takes nothing); a
``scancel --signal=TERM`` of another worker's step drains it (a planned leave: no step
redone, and the pending worker takes its slot); the job succeeds with one worker's
parameters (relative 1e-12). The workers bind their own node's address: every TCP connection
in the nodes' namespaces is between ``NET.x`` addresses (or loopback inside one).

The test reads the job's records from SQLite (no network from this namespace). Where no
cluster can be made (not root, no ``ip``, Slurm not installed), it skips saying why; under
CI (which installs Slurm and runs as root) it fails instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from e2e_helpers import DIGITS, ROOT, Home, relative_l2, summarize
from slurm_cluster import NET, SlurmCluster, unavailable

from tidal.coordinator.home import db_path

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(180)]

STEPS = 1500  # the reference other multi-machine tests share (one run a session)
NAME = "slurmjob"
SLOW_S = 0.05  # seconds each worker sleeps per loss while the changes happen; then 0
# Paces the job's workers (``TIDAL_WORKER_ID`` set), never the mathematics.
PACE = """
import os
if os.environ.get("TIDAL_WORKER_ID") is not None and os.environ.get("SLURM_TEST_PACE"):
    import time
    import torch.nn.functional as F
    _pace, _cross_entropy = os.environ["SLURM_TEST_PACE"], F.cross_entropy
    def cross_entropy(*args, **kwargs):
        try:
            with open(_pace) as f:
                time.sleep(float(f.read()))
        except (OSError, ValueError):
            pass
        return _cross_entropy(*args, **kwargs)
    F.cross_entropy = cross_entropy
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    reason = unavailable()
    c = SlurmCluster(tmp_path / "slurm")
    if reason is None:
        c.root.mkdir()
        try:
            c.start()
        except (OSError, RuntimeError) as exc:
            c.stop()
            if isinstance(exc, RuntimeError):
                raise
            reason = f"the Slurm cluster's namespaces cannot be made here: {exc}"
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield c
    finally:
        c.stop()


def records(home: Home) -> dict:
    from tidal.coordinator.db import Database

    db = Database(db_path(home.path), readonly=True, check=False)
    try:
        return json.loads(db.load_status(NAME).model_dump_json())
    finally:
        db.close()


def wait(home: Home, pred: Callable[[dict], object], timeout: float, what: str, logs) -> dict:
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        try:
            status = records(home)
        except Exception:  # noqa: BLE001 - no record yet
            status = None
        if status is not None and pred(status):
            return status
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}\n{summarize(status)}\n{logs()}", pytrace=False)


def formed(size: int) -> Callable[[dict], bool]:
    def check(s: dict) -> bool:
        gens = s["generations"]
        return s["world_size"] == size and bool(gens) and gens[-1]["start_step"] is not None

    return check


def members(status: dict) -> list[dict]:
    by_id = {w["id"]: w for w in status["workers"]}
    return [by_id[m] for m in status["generations"][-1]["members"]]


def members_ids(status: dict) -> list[int]:
    return status["generations"][-1]["members"]


def node_of(worker: dict) -> str | None:
    found = re.match(r"(n\d) \(" + re.escape(NET) + r"\.\d+\)$", worker["node"] or "")
    return found[1] if found else None


def test_a_job_in_an_allocation_grows_loses_a_node_drains_a_step_and_ends_exactly(
    tidal_home: Home, cluster: SlurmCluster, reference_params, tmp_path: Path
):
    out = tmp_path / "final.safetensors"
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(PACE)
    pace = tmp_path / "pace"
    pace.write_text(str(SLOW_S))
    env = cluster.env(tidal_home.env())
    path = os.pathsep.join(filter(None, [str(hooks), env.get("PYTHONPATH")]))
    env.update(PYTHONPATH=path, SLURM_TEST_PACE=str(pace))
    home = str(tidal_home.path)
    t0 = time.monotonic()
    timeline: list[str] = []

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:6.1f} s  {what}")

    def cli(*args: str) -> subprocess.CompletedProcess:  # on the login node
        return subprocess.run(
            cluster.run("ctl", sys.executable, "-m", "tidal.cli", *args, "--home", home),
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    coordinator = subprocess.Popen(
        cluster.run(
            "ctl", "salloc", "--nodes", "3", "--ntasks-per-node", "1", "--no-kill",
            sys.executable, "-m", "tidal.cli", "run", "--home", home, "--name", NAME,
            "--quiet", "--backend", "slurm", "--workers", "2", "--max-workers", "3",
            str(DIGITS), "--max-steps", str(STEPS), "--double", "--save", str(out),
        ),
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    said: list[str] = []
    threading.Thread(target=lambda: said.extend(coordinator.stderr), daemon=True).start()

    def logs() -> str:
        parts = ["--- timeline ---", *timeline, "--- salloc / tidal run ---", *said[-20:]]
        parts.append(cluster.command("squeue", "-s", "-h").stdout)
        for log in sorted((tidal_home.path / "jobs" / NAME / "logs").glob("worker-*.log")):
            parts += [f"--- {log.name} ---", *log.read_text(errors="replace").splitlines()[-8:]]
        return "\n".join(parts) + "\n" + cluster.logs(8)

    try:
        two = wait(
            tidal_home, lambda s: formed(2)(s) and s["step"] >= 20, 90, "2 workers training", logs
        )
        mark("2 workers training")
        assert sorted(node_of(w) for w in members(two)) == ["n1", "n2"], summarize(two)  # spread
        scaled = cli("scale", NAME, "3")
        assert scaled.returncode == 0, scaled.stderr
        three = wait(tidal_home, formed(3), 60, "3 workers training", logs)
        mark("3 workers training")
        assert sorted(node_of(w) for w in members(three)) == ["n1", "n2", "n3"]
        steps = cluster.command("squeue", "-h", "-s", "-o", "%i %j %N").stdout.split("\n")
        by_worker = {}
        for line in filter(None, steps):
            step, name, node = line.split()
            if m := re.match(rf"tidal-{NAME}-w(\d+)-", name):
                by_worker[int(m[1])] = (step, node)
        assert {by_worker[w["id"]][1] for w in members(three)} == {"n1", "n2", "n3"}, steps
        # Gloo binds each node's own address: no connection leaves the cluster's network.
        seen = [c for n in cluster.nodes for c in tcp(cluster, n)]
        assert seen, "no TCP connection in the nodes' namespaces"
        for local, remote in seen:
            for addr in (local, remote):
                assert addr.startswith(f"{NET}.") or addr.startswith("127."), (local, remote)

        # Node n3 goes DOWN: its worker is lost, the job re-forms with the two others.
        doomed = next(w["id"] for w in members(three) if node_of(w) == "n3")
        down = cluster.command("scontrol", "update", "nodename=n3", "state=down", "reason=test")
        assert down.returncode == 0, down.stderr
        after = wait(
            tidal_home,
            lambda s: formed(2)(s) and doomed not in s["generations"][-1]["members"],
            60,
            "a generation without the lost node's worker",
            logs,
        )
        mark("n3 down: 2 workers training")
        by_id = {w["id"]: w for w in after["workers"]}
        assert by_id[doomed]["state"] == "failed", summarize(after)
        # Its replacement waits for a slot (n3 takes nothing now): pending, not a member.
        after = wait(
            tidal_home,
            lambda s: any(w["state"] == "pending" for w in s["workers"]),
            30,
            "the replacement pending",
            logs,
        )
        pending = [w["id"] for w in after["workers"] if w["state"] == "pending"]
        assert after["world_size"] == 2 and not set(pending) & set(members_ids(after))

        # A preemption notice for worker on n1: scancel --signal=TERM of its step.
        leaver = next(w["id"] for w in members(after) if node_of(w) == "n1")
        gens_before = len(after["generations"])
        # (Slurm 22.05's scancel may exit 225, "Invalid job id specified", having signalled
        # the step all the same: what follows is the test.)
        cluster.command("scancel", "--signal=TERM", by_worker[leaver][0])
        drained = wait(
            tidal_home,
            lambda s: (
                {w["id"]: w for w in s["workers"]}[leaver]["state"] == "exited"
                and len(s["generations"]) > gens_before
                and s["generations"][-1]["start_step"] is not None
            ),
            60,
            "the drained worker's planned leave",
            logs,
        )
        mark("worker drained by scancel --signal=TERM")
        pace.write_text("0")
        left = drained["generations"][gens_before]
        assert leaver not in left["members"] and not left["redone_steps"], summarize(drained)

        end = wait(
            tidal_home, lambda s: s["state"] in ("succeeded", "failed"), 120, "the end", logs
        )
        assert coordinator.wait(timeout=60) == 0, logs()
        mark("the job ended")
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
        coordinator.wait(timeout=30)

    status = records(tidal_home)
    assert status["state"] == "succeeded" == end["state"], summarize(status)
    events = [e["message"] for e in status["events"]]
    assert any(e.startswith(f"node n3 ({NET}.4) lost: Slurm ") for e in events), events
    assert any(f"worker {doomed} failed" in e and "lost with its node" in e for e in events), events
    by_id = {w["id"]: w for w in status["workers"]}
    assert by_id[leaver]["state"] == "exited", summarize(status)
    failures = [e for e in status["events"] if e["kind"] == "failure"]
    assert len(failures) == 1 and f"worker {doomed}" in failures[0]["message"], summarize(status)
    reference = reference_params(STEPS, 0, double=True)
    mark("the reference: a one-worker run (once a session)")
    print("\n".join(timeline))
    assert relative_l2(out, reference) < 1e-12
    tidal_home.assert_no_processes()


def tcp(cluster: SlurmCluster, machine: str) -> list[tuple[str, str]]:
    """The (local, remote) addresses of ``machine``'s established TCP connections."""
    text = subprocess.run(
        cluster.run(machine, "cat", "/proc/net/tcp"), capture_output=True, text=True, timeout=30
    ).stdout
    pairs = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01":
            pairs.append((_ipv4(fields[1]), _ipv4(fields[2])))
    return pairs


def _ipv4(hex_addr: str) -> str:
    packed = bytes.fromhex(hex_addr.split(":")[0])
    return ".".join(str(b) for b in reversed(packed))
