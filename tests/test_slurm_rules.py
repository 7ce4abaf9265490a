"""The Slurm backend's decisions as tables, in milliseconds (``tidal.backends.slurm_rules``):
what Slurm's answers say (``SLURM_TASKS_PER_NODE``, ``sinfo``, ``squeue``, ``scontrol show
config``: lines as Slurm 22.05 writes them), which node of an allocation takes the next worker,
the ``srun`` command lines, how an ``srun``'s end counts, which address the coordinator
serves, and what the node's launcher adds to a worker's environment. The real cluster is in
``tests/test_slurm.py``."""

from __future__ import annotations

import signal

import pytest

from tidal.backends.slurm_rules import (
    Allocation,
    Node,
    NodeFacts,
    allocation,
    choose_node,
    controllers,
    gpu_entry,
    job_argv,
    node_failure,
    node_lost,
    parse_nodes,
    parse_queue,
    reachable_address,
    srun_end,
    step_argv,
    tasks_per_node,
    worker_name,
)
from tidal.backends.slurm_task import ENV_SLOT, node_env
from tidal.config import JobSpec
from tidal.protocol import ENV_URL


@pytest.mark.parametrize(
    "text, counts",
    [
        ("1", [1]),
        ("2(x3)", [2, 2, 2]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("4,2(x2),8", [4, 2, 2, 8]),
        (" 1(x2) ", [1, 1]),
    ],
)
def test_tasks_per_node_reads_slurms_compressed_counts(text, counts):
    assert tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "x", "2(3)", "2(x)", "-1", "2(x3)1"])
def test_tasks_per_node_refuses_what_slurm_never_writes(text):
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        tasks_per_node(text)


def test_an_allocation_pairs_nodes_with_their_tasks():
    a = allocation("17", ["n1", "n2", "n3"], "2(x2),1")
    assert a == Allocation(job_id="17", nodes=("n1", "n2", "n3"), slots=(2, 2, 1))
    assert a.capacity == 5
    assert allocation("17", ["n1", "n2"], None).slots == (1, 1)  # one task per node
    with pytest.raises(ValueError, match="does not match the job's 3 nodes"):
        allocation("17", ["n1", "n2", "n3"], "2(x2)")


SINFO = """\
n1|10.0.0.1|mix|none
n2|10.0.0.2|down|x
n3|10.0.0.3|down*|Not responding
n3|10.0.0.3|down*|Not responding
n4|n4|idle|none
n5|10.0.0.5|drain|maintenance | tomorrow
n6|10.0.0.6|fail|bad dimm
n7|10.0.0.7|alloc+|none
"""


def test_sinfo_lines_read_as_nodes_and_which_are_lost():
    nodes = parse_nodes(SINFO)
    assert list(nodes) == ["n1", "n2", "n3", "n4", "n5", "n6", "n7"]  # n3 once
    assert nodes["n1"] == Node(name="n1", address="10.0.0.1", state="mix")
    assert nodes["n5"].reason == "maintenance | tomorrow"  # the reason may hold the separator
    lost = {name for name, n in nodes.items() if n.lost}
    assert lost == {"n2", "n3", "n6"}  # draining is not lost: its steps run on
    assert nodes["n2"].why_lost() == "Slurm set node n2 DOWN (x)"
    assert nodes["n3"].why_lost() == "Slurm set node n3 DOWN (Not responding)"
    assert nodes["n1"].describe() == "n1 (10.0.0.1)"
    assert parse_nodes("garbage\n\n") == {}


def test_squeue_lines_read_as_jobs_and_steps_by_name():
    jobs = parse_queue(
        "12|tidal-a-w0-x|PENDING|\n13|tidal-a-w1-y|RUNNING|n2\n14|other|COMPLETING|n1\n"
    )
    assert jobs["tidal-a-w0-x"].running is False and jobs["tidal-a-w0-x"].nodes == ""
    assert jobs["tidal-a-w1-y"].running and jobs["tidal-a-w1-y"].nodes == "n2"
    assert jobs["other"].running  # completing: its process may still run
    steps = parse_queue(
        "7.0|tidal-a-w0-x|n1\n7.10|tidal-a-w0-x|n2\n7.9|tidal-a-w1-y|n1\n", steps=True
    )
    assert steps["tidal-a-w0-x"].id == "7.10"  # the newest step of a name (7.10 after 7.9)
    assert steps["tidal-a-w1-y"].running
    assert parse_queue("7.0|x|n1\n", steps=False) == {}  # a step line is not a job line


@pytest.mark.parametrize(
    "text, found",
    [
        ("SlurmctldHost[0]        = ctl(10.0.0.9)\n", ["10.0.0.9"]),
        (
            "SlurmctldHost[0]        = ctl\nSlurmctldHost[1]        = ctl2(10.0.0.8)\n",
            ["ctl", "10.0.0.8"],
        ),
        ("ControlMachine = head\n", ["head"]),
        ("SlurmctldPort           = 6817\nSlurmctldHostX = y\n", []),
    ],
)
def test_the_controllers_address_from_scontrol_show_config(text, found):
    assert controllers(text) == found


@pytest.mark.parametrize(
    "sources, chosen",
    [
        (["10.0.0.5"], "10.0.0.5"),
        (["127.0.0.1", "10.0.0.5"], "10.0.0.5"),  # a controller on this machine: the next
        (["127.0.1.1", "::1"], None),  # only loopback: the coordinator needs --listen
        (["fe80::1"], "fe80::1"),
        ([], None),
    ],
)
def test_the_coordinator_serves_the_first_address_that_is_not_loopback(sources, chosen):
    assert reachable_address(sources) == chosen


ALLOC = Allocation(job_id="9", nodes=("n1", "n2", "n3"), slots=(1, 1, 1))
WIDE = Allocation(job_id="9", nodes=("n1", "n2"), slots=(2, 2))


@pytest.mark.parametrize(
    "alloc, taken, lost, chosen",
    [
        (ALLOC, {}, (), ("n1", 0)),
        (ALLOC, {"n1": {0}}, (), ("n2", 0)),  # spread
        (ALLOC, {"n1": {0}, "n2": {0}}, (), ("n3", 0)),
        (ALLOC, {"n1": {0}, "n2": {0}}, ("n3",), None),  # the free node is lost: wait
        (ALLOC, {"n1": {0}, "n2": {0}, "n3": {0}}, (), None),  # full: wait
        (WIDE, {"n1": {0}, "n2": {0}}, (), ("n1", 1)),
        (WIDE, {"n1": {1}, "n2": {0, 1}}, (), ("n1", 0)),  # the lowest free slot (GPU)
        (WIDE, {"n1": {0}}, ("n2",), ("n1", 1)),
    ],
)
def test_a_worker_goes_to_the_least_loaded_node_of_the_allocation(alloc, taken, lost, chosen):
    assert choose_node(alloc, taken, lost) == chosen


def test_srun_command_lines():
    step = step_argv(job_id="9", node="n2", name="tidal-a-w3-d", command=["py", "s.py", "--x"])
    assert step[0] == "srun" and step[-3:] == ["py", "s.py", "--x"]
    for option in ("--jobid=9", "--nodes=1", "--ntasks=1", "--nodelist=n2", "--overlap"):
        assert option in step
    assert "--job-name=tidal-a-w3-d" in step
    job = job_argv(name="tidal-a-w3-d", command=["py", "s.py"])
    assert job[0] == "srun" and job[-2:] == ["py", "s.py"]
    assert not any(a.startswith(("--jobid", "--nodelist", "--overlap")) for a in job)
    assert {"--nodes=1", "--ntasks=1", "--job-name=tidal-a-w3-d"} <= set(job)


def test_worker_names_are_readable_and_apart_per_run():
    a = worker_name("digits", 3, "credential-a")
    assert a.startswith("tidal-digits-w3-") and a == worker_name("digits", 3, "credential-a")
    assert a != worker_name("digits", 3, "credential-b")  # another run of a job of that name


DOWN = Node(name="n2", address="10.0.0.2", state="down", reason="x")
MIX = Node(name="n2", address="10.0.0.2", state="mix")


@pytest.mark.parametrize(
    "facts, why",
    [
        (NodeFacts(name="n2", state=MIX, in_job=True), None),
        (NodeFacts(name="n2", state=MIX), None),  # outside an allocation
        (NodeFacts(name="n2", state=DOWN, in_job=True), "Slurm set node n2 DOWN (x)"),
        (NodeFacts(name="n2", state=DOWN, in_job=False), "Slurm set node n2 DOWN (x)"),
        # Slurm kills the step after it removed the node from the job, before sinfo says so
        (
            NodeFacts(name="n2", state=MIX, in_job=False),
            "Slurm removed node n2 from the job (a node failure)",
        ),
        (
            NodeFacts(name="n2", state=None, srun_failure=True),
            "Slurm reported a failure of node n2",
        ),
    ],
)
def test_a_node_is_lost_by_any_of_slurms_three_signs(facts, why):
    assert node_lost(facts) == why


REFUSED = (
    "srun: error: Unable to create step for job 1: Requested node configuration is not available\n"
)


@pytest.mark.parametrize(
    "code, lost, cancelled, said, returncode, reason",
    [
        (0, None, False, "", 0, ""),
        (1, None, False, "", 1, ""),  # the script failed: the job fails
        (137, None, False, "", -signal.SIGKILL, ""),  # killed (a hung worker, OOM)
        (143, None, False, "", -signal.SIGTERM, ""),  # SIGTERM before its handler was set
        (
            1,
            "Slurm set node n2 DOWN (x)",
            False,
            "",
            -9,
            "lost with its node: Slurm set node n2 DOWN (x)",
        ),
        (
            0,
            "Slurm set node n2 DOWN (x)",
            False,
            "",
            -9,
            "lost with its node: Slurm set node n2 DOWN (x)",
        ),
        (143, None, True, "", 0, "cancelled before Slurm placed it"),
        (1, None, False, REFUSED, -9, "Slurm did not start it: " + REFUSED.strip()[13:]),
        (255, None, False, "", 255, ""),
    ],
)
def test_an_sruns_end_counts_as_its_worker_end(code, lost, cancelled, said, returncode, reason):
    end = srun_end(code, lost=lost, cancelled=cancelled, said=said)
    assert (end.returncode, end.reason) == (returncode, reason)


@pytest.mark.parametrize(
    "visible, slot, entry",
    [
        (None, 0, None),
        ("0", 3, None),  # one GPU (or the job's own): as Slurm set it
        ("0,1,2,3", 1, "1"),
        ("4,5", 3, "5"),
        ("GPU-a,GPU-b", 0, "GPU-a"),
    ],
)
def test_a_worker_takes_one_of_the_steps_gpus_by_its_slot(visible, slot, entry):
    assert gpu_entry(visible, slot) == entry


def test_the_launcher_binds_the_interface_of_the_route_to_the_coordinator():
    env = {ENV_URL: "http://127.0.0.1:7000", ENV_SLOT: "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    added = node_env(env)
    assert added["GLOO_SOCKET_IFNAME"] == added["NCCL_SOCKET_IFNAME"] == "lo"
    assert added["CUDA_VISIBLE_DEVICES"] == "1"
    assert "GLOO_SOCKET_IFNAME" not in node_env({**env, "GLOO_SOCKET_IFNAME": "eth9"})


def test_listen_names_the_address_on_slurm_too():
    spec = JobSpec(name="a", script="s.py", backend="slurm", listen="10.0.0.5:0")
    assert spec.listen == "10.0.0.5:0"
    with pytest.raises(ValueError, match="not the ray backend"):
        JobSpec(name="a", script="s.py", backend="ray", listen="10.0.0.5:0")


def test_srun_reports_a_node_failure():
    said = "step 225: loss 0.01\nsrun: error: Node failure on n3\n"
    assert node_failure(said) == "n3"
    assert node_failure("srun: error: n1: task 0: Killed\n") is None
    assert node_failure("a line that mentions srun: error: Node failure on n3 inside") is None
