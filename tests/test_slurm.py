"""``--backend slurm`` against a real Slurm (Debian's ``slurm-wlm`` 22.05): a controller and
three compute nodes, each a network namespace of its own address, started by the test
(``slurm_cluster``).

One job, as a user runs it on a cluster: ``sbatch --nodes 3 --ntasks-per-node 1 --no-kill
--requeue`` of a script that runs ``tidal run --backend slurm --workers 2 --max-workers 3``,
or ``tidal resume`` when the job exists (``deploy/slurm/tidal.sbatch``'s logic). The
coordinator runs in the batch script on the first node; each worker is a job step (``srun
--overlap``) on a node of the allocation, spread one a node. Digits in float64 grows to 3 by
``tidal scale``; a node set DOWN by ``scontrol update`` loses its worker (a failure: the job
re-forms without it, and the replacement waits ``pending``, no member, since the lost node
takes nothing); a ``scancel --signal=TERM`` of another worker's step drains it (a planned
leave: no step redone); ``scontrol requeue`` of the batch job (what ``PreemptMode=REQUEUE``
does) stops it and runs the script again, which resumes the job from its newest checkpoint;
the job succeeds with one worker's parameters (relative 1e-12). The workers bind their own
node's address: every TCP connection in the nodes' namespaces is between ``NET.x``
addresses (or loopback inside one).

The test reads the job's records from SQLite (no network from this namespace). Where no
cluster can be made (not root, no ``ip``, Slurm not installed), it skips saying why; under
CI (which installs Slurm and runs as root) it fails instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import DIGITS, Home, relative_l2, summarize
from job_records import JobRecords, formed, members
from pacing import arm_pacing
from slurm_cluster import NET, SlurmCluster, unavailable

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 1500  # the reference other multi-machine tests share (one run a session)
NAME = "slurmjob"
JOB = JobRecords(NAME)
records, wait = JOB.read, JOB.wait
SLOW_S = 0.05  # seconds each worker sleeps per loss while the changes happen; then 0


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


def members_ids(status: dict) -> list[int]:
    return status["generations"][-1]["members"]


def node_of(worker: dict) -> str | None:
    found = re.match(r"(n\d) \(" + re.escape(NET) + r"\.\d+\)$", worker["node"] or "")
    return found[1] if found else None


BATCH = """#!/bin/bash
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
#SBATCH --no-kill
#SBATCH --requeue
#SBATCH --open-mode=append
if {python} -m tidal.cli status --home {home} {name} >/dev/null 2>&1; then
    exec {python} -m tidal.cli resume --home {home} {name}
fi
exec {python} -m tidal.cli run --home {home} --name {name} --backend slurm --workers 2 \\
    --max-workers 3 --checkpoint-every 100 {script} --max-steps {steps} --double --save {out}
"""


def test_a_batch_job_grows_loses_a_node_drains_a_step_is_requeued_and_ends_exactly(
    tidal_home: Home, cluster: SlurmCluster, reference_params, tmp_path: Path
):
    out = tmp_path / "final.safetensors"
    env, pace = arm_pacing(
        tmp_path,
        cluster.env(tidal_home.env()),
        "SLURM_TEST_PACE",
        slow_s=SLOW_S,
        not_for="tidal.backends.slurm_task",  # the node's launcher execs the worker at once
    )
    home = str(tidal_home.path)
    script = tmp_path / "tidal.sbatch"  # deploy/slurm/tidal.sbatch's logic, for this test
    script.write_text(
        BATCH.format(
            python=sys.executable, home=home, name=NAME, script=DIGITS, steps=STEPS, out=out
        )
    )
    batch_out = tmp_path / "batch.out"
    t0 = time.monotonic()
    timeline: list[str] = []

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:6.1f} s  {what}")

    def slurm(*argv: str) -> subprocess.CompletedProcess:  # on the login node, as the user
        return subprocess.run(
            cluster.run("ctl", *argv), env=env, capture_output=True, text=True, timeout=60,
            cwd=tmp_path,
        )  # fmt: skip

    def logs() -> str:
        parts = ["--- timeline ---", *timeline, "--- squeue ---"]
        parts.append(slurm("squeue", "-h", "-o", "%i %T %r %N").stdout)
        parts.append(slurm("squeue", "-h", "-s").stdout)
        if batch_out.exists():
            parts += ["--- batch output ---", *batch_out.read_text().splitlines()[-25:]]
        for log in sorted((tidal_home.path / "jobs" / NAME / "logs").glob("worker-*.log")):
            parts += [f"--- {log.name} ---", *log.read_text(errors="replace").splitlines()[-8:]]
        return "\n".join(parts) + "\n" + cluster.logs(8)

    submitted = slurm("sbatch", "--parsable", f"--output={batch_out}", str(script))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        two = wait(
            tidal_home, lambda s: formed(2)(s) and s["step"] >= 20, 90, "2 workers training", logs
        )
        mark("2 workers training")
        assert sorted(node_of(w) for w in members(two)) == ["n1", "n2"], summarize(two)  # spread
        scaled = slurm(sys.executable, "-m", "tidal.cli", "scale", "--home", home, NAME, "3")
        assert scaled.returncode == 0, scaled.stderr
        three = wait(tidal_home, formed(3), 60, "3 workers training", logs)
        mark("3 workers training")
        assert sorted(node_of(w) for w in members(three)) == ["n1", "n2", "n3"]
        by_worker = {}
        for line in slurm("squeue", "-h", "-s", "-o", "%i %j %N").stdout.splitlines():
            step, name, node = line.split()
            if m := re.match(rf"tidal-{NAME}-w(\d+)-", name):
                by_worker[int(m[1])] = (step, node)
        assert {by_worker[w["id"]][1] for w in members(three)} == {"n1", "n2", "n3"}
        # Gloo binds each node's own address: no connection leaves the cluster's network.
        seen = [c for n in cluster.nodes for c in tcp(cluster, n)]
        assert seen, "no TCP connection in the nodes' namespaces"
        for local, remote in seen:
            for addr in (local, remote):
                assert addr.startswith(f"{NET}.") or addr.startswith("127."), (local, remote)

        # Node n3 goes DOWN: its worker is lost, the job re-forms with the two others.
        doomed = next(w["id"] for w in members(three) if node_of(w) == "n3")
        down = slurm("scontrol", "update", "nodename=n3", "state=down", "reason=test")
        assert down.returncode == 0, down.stderr
        after = wait(
            tidal_home,
            lambda s: formed(2)(s) and doomed not in members_ids(s),
            60,
            "a generation without the lost node's worker",
            logs,
        )
        mark("n3 down: 2 workers training")
        assert {w["id"]: w for w in after["workers"]}[doomed]["state"] == "failed"
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

        # A preemption notice: scancel --signal=TERM of the step of n2's worker. (Slurm
        # 22.05's scancel may exit 225, "Invalid job id specified", having signalled the
        # step all the same: what follows is the test.)
        leaver = next(w["id"] for w in members(after) if node_of(w) == "n2")
        gens_before = len(after["generations"])
        slurm("scancel", "--signal=TERM", by_worker[leaver][0])
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
        left = drained["generations"][gens_before]
        assert leaver not in left["members"] and not left["redone_steps"], summarize(drained)

        # Slurm requeues the batch job (as PreemptMode=REQUEUE does): SIGTERM to the batch
        # script's `tidal run` and to every step, then the job waits in the queue and runs
        # the script again, which resumes the job from its newest checkpoint. (n3 is back;
        # the requeued job's begin time, 120 s away by Slurm's rule, is brought to now.)
        saved = wait(
            tidal_home,
            lambda s: any(c["step"] > drained["step"] for c in s["checkpoints"]),
            60,
            "a checkpoint after the drain",
            logs,
        )
        slurm("scontrol", "update", "nodename=n3", "state=resume")
        requeue = slurm("scontrol", "requeue", job_id)
        assert requeue.returncode == 0, requeue.stderr
        mark("requeued")
        deadline = time.monotonic() + 60
        while "PENDING" not in slurm("squeue", "-h", "-j", job_id, "-o", "%T").stdout:
            assert time.monotonic() < deadline, logs()
            time.sleep(0.2)
        mark("pending again")
        slurm("scontrol", "update", f"jobid={job_id}", "StartTime=now")
        resumed = wait(
            tidal_home,
            lambda s: (
                any("resumed from" in e["message"] for e in s["events"])
                and s["state"] == "running"
                and s["generations"][-1]["start_step"] is not None
            ),
            90,
            "the requeued job resumed and training",
            logs,
        )
        mark("resumed after the requeue")
        pace.write_text("0")
        end = wait(
            tidal_home, lambda s: s["state"] in ("succeeded", "failed"), 120, "the end", logs
        )
        mark("the job ended")
        deadline = time.monotonic() + 30
        while slurm("squeue", "-h", "-j", job_id).stdout.strip():
            assert time.monotonic() < deadline, logs()
            time.sleep(0.2)
    finally:
        slurm("scancel", job_id)

    status = records(tidal_home)
    assert status["state"] == "succeeded" == end["state"], summarize(status)
    events = [e["message"] for e in status["events"]]
    assert any(e.startswith(f"node n3 ({NET}.4) lost: Slurm ") for e in events), events
    assert any(f"worker {doomed} failed" in e and "lost with its node" in e for e in events), events
    assert {w["id"]: w for w in status["workers"]}[leaver]["state"] == "exited"
    # Resumed from the newest checkpoint: the one written at the requeue's SIGTERM, or the
    # last periodic one if that did not make it in time.
    newest = max(c["step"] for c in saved["checkpoints"])
    from_step = [int(m[1]) for e in events if (m := re.search(r"resumed from .*\(step (\d+)\)", e))]
    assert from_step and from_step[0] >= newest, (from_step, newest)
    assert resumed["generations"][-1]["start_step"] == from_step[0]
    print("\n".join(timeline))
    reference = reference_params(STEPS, 0, double=True)
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
