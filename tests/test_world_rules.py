"""Restart-based membership (``tidal run --torchrun``) on values: the rules
(``coordinator.world_rules``), the environment a script gets (``worker.torchrun``), and the
coordinator's passes over a recording executor (the ``rig`` of ``test_decisions``)."""

from __future__ import annotations

import signal

import pytest
from test_decisions import rig

from tidal.backends import Exit
from tidal.config import JobSpec
from tidal.coordinator.actions import OpenGeneration, SignalWorker, StartWorker
from tidal.coordinator.rules.exit_rules import ExitFacts
from tidal.coordinator.rules.world_rules import (
    World,
    WorldPlan,
    judge_member_exit,
    plan_world,
    world_finished,
    world_timed_out,
)
from tidal.protocol import JobState, StepReport, WorkerState
from tidal.restarts import parse_max_restarts
from tidal.worker.compat.torchrun import UNLIMITED, max_restarts_count, torchrun_env

EXITED, FAILED = WorkerState.EXITED, WorkerState.FAILED


# -- plan_world ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world", "plan"),
    [
        # the first world: start the target, open once all registered
        (World(target=2), WorldPlan(start=2)),
        (World(target=2, standby=(0,), starting=1), WorldPlan()),
        (World(target=2, standby=(0, 1)), WorldPlan(open=(0, 1))),
        (World(target=2, standby=(0, 1, 5)), WorldPlan(open=(0, 1), retire=(5,))),
        (World(target=2, standby=(0, 1), spares=1), WorldPlan(open=(0, 1), start=1)),
        # a running world at its target: nothing; a warm spare is kept
        (World(target=2, members=(0, 1), live=(0, 1)), WorldPlan()),
        (World(target=2, members=(0, 1), live=(0, 1), standby=(2,), spares=1), WorldPlan()),
        (World(target=2, members=(0, 1), live=(0, 1), standby=(2,)), WorldPlan(retire=(2,))),
        # a scale-up: stop every member, start the whole new world meanwhile
        (World(target=3, members=(0, 1), live=(0, 1)), WorldPlan(stop=(0, 1), start=3)),
        # ... a spare already warm counts (and is replaced)
        (
            World(target=3, members=(0, 1), live=(0, 1), standby=(2,)),
            WorldPlan(stop=(0, 1), start=2),
        ),
        (
            World(target=3, members=(0, 1), live=(0, 1), standby=(2,), spares=1),
            WorldPlan(stop=(0, 1), start=3),
        ),
        # stopping: wait for the old members to exit before opening
        (
            World(target=3, members=(0, 1), live=(1,), stopped=True, standby=(2, 3, 4)),
            WorldPlan(),
        ),
        (
            World(target=3, members=(0, 1), stopped=True, standby=(2, 3, 4)),
            WorldPlan(open=(2, 3, 4)),
        ),
        # a scale-down restarts too, with fresh workers
        (World(target=1, members=(2, 3, 4), live=(2, 3, 4)), WorldPlan(stop=(2, 3, 4), start=1)),
        # a member lost: the world restarts at the same size
        (
            World(target=2, members=(0, 1), live=(0,), broken=True),
            WorldPlan(stop=(0,), start=2),
        ),
        (World(target=2, members=(0, 1), broken=True, standby=(2, 3)), WorldPlan(open=(2, 3))),
        # a member finished (exit 0): no planned change any more; a failure still restarts
        (World(target=3, members=(0, 1), live=(1,), finished=True), WorldPlan()),
        (
            World(target=2, members=(0, 1), live=(1,), finished=True, broken=True),
            WorldPlan(stop=(1,), start=2),
        ),
        # no capacity: stop, open nothing
        (World(target=0, members=(0, 1), live=(0, 1)), WorldPlan(stop=(0, 1))),
        (World(target=0, members=(0, 1), stopped=True), WorldPlan()),
    ],
)
def test_plan_world(world: World, plan: WorldPlan) -> None:
    assert plan_world(world) == plan


# -- a member's end ------------------------------------------------------------------------
def member(**kw) -> ExitFacts:
    base = dict(worker_id=3, returncode=1, how="exited with code 1", was_member=True,
                script="train.py", max_restarts=parse_max_restarts("3"))  # fmt: skip
    if "returncode" in kw and "how" not in kw:
        code = kw["returncode"]
        base["how"] = (
            f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        )
    return ExitFacts(**{**base, **kw})


@pytest.mark.parametrize(
    ("facts", "formed", "peer", "state", "message", "lost", "reform", "fail"),
    [
        # stopped by the coordinator: an exit, whatever the script did with the SIGTERM
        (member(returncode=-15, retired=True), True, False, EXITED, "stopped (SIGTERM)", 0, 0, None),
        (member(returncode=0, retired=True), True, False, EXITED, "worker 3 stopped", 0, 0, None),
        (
            member(returncode=-9, retired=True, kill_reason="did not exit within 30 s"),
            True, False, FAILED, "did not exit within 30 s while stopping", 0, 0, None,
        ),
        # its script finished
        (member(returncode=0), True, False, EXITED, "finished: train.py exited 0", 0, 0, None),
        # ... before its group formed: the job fails, no restart loop
        (
            member(returncode=0), False, False, FAILED, "exited 0 before its process group",
            0, 0, "train.py exited 0 before its process group formed: under --torchrun",
        ),
        # the script raised at its start: every new world would too
        (
            member(returncode=1, detail="KeyError: 'x'"), False, False, FAILED, "failed",
            0, 0, "worker 3 exited with code 1 before its process group formed: KeyError: 'x'",
        ),
        # ... after a peer was lost: part of that failure
        (member(returncode=1), False, True, FAILED, "after a peer's failure", 0, 0, None),
        (member(returncode=-9), True, True, FAILED, "after a peer's failure", 0, 0, None),
        # a failure once the group formed: torchrun's worker failure, the world restarts
        (member(returncode=1), True, False, FAILED, "failed (exited with code 1)", 1, 1, None),
        (member(returncode=-9), False, False, FAILED, "failed (killed by SIGKILL)", 1, 1, None),
        (
            member(returncode=-9, kill_reason="missed heartbeats for 11.0 s"),
            True, False, FAILED, "missed heartbeats", 1, 1, None,
        ),
        # past --max-restarts: the job fails
        (
            member(returncode=-9, failures=3), True, False, FAILED, "failed", 1, 0,
            "the restart budget of 3 is spent (--max-restarts): worker 3 killed by SIGKILL",
        ),
        # the job's outcome is decided: noted only
        (member(returncode=1, job_decided=True), True, False, FAILED, "failed", 0, 0, None),
        (member(returncode=0, job_decided=True), False, False, EXITED, "exited", 0, 0, None),
    ],
)  # fmt: skip
def test_judge_member_exit(facts, formed, peer, state, message, lost, reform, fail) -> None:
    v = judge_member_exit(facts, formed=formed, peer_failed=peer)
    assert v.state == state and message in v.message
    assert (v.lost, v.reform) == (bool(lost), bool(reform))
    assert (v.fail_job is None) if fail is None else v.fail_job.startswith(fail), v.fail_job


@pytest.mark.parametrize(
    ("formed", "stopped", "codes", "done"),
    [
        (True, False, (0, 0), True),
        (True, False, (0, None), False),  # one still runs
        (True, False, (0, 1), False),
        (True, True, (0, 0), False),  # stopped scripts that exit 0 on SIGTERM: not done
        (False, False, (0, 0), False),
        (True, False, (), False),
    ],
)
def test_world_finished(formed, stopped, codes, done) -> None:
    assert world_finished(formed=formed, stopped=stopped, codes=codes) is done


def test_world_timed_out() -> None:
    assert world_timed_out(formed=False, waited_s=5, timeout_s=10, gen_id=2) is None
    assert world_timed_out(formed=True, waited_s=50, timeout_s=10, gen_id=2) is None
    why = world_timed_out(formed=False, waited_s=11, timeout_s=10, gen_id=2)
    assert why.startswith("the process group of generation 2 did not form within 10 s")
    assert "init_process_group" in why


# -- the script's environment ----------------------------------------------------------------
def test_torchrun_env_on_one_host_is_torchrun_nproc_per_node() -> None:
    env = torchrun_env(rank=2, hosts=["h"] * 3, master_addr="127.0.0.1", master_port=5,
                       restart_count=4, max_restarts=60, run_id="job-1")  # fmt: skip
    assert env == {
        "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "2", "ROLE_WORLD_SIZE": "3",
        "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "5",
        "TORCHELASTIC_RESTART_COUNT": "4", "TORCHELASTIC_MAX_RESTARTS": "60",
        "TORCHELASTIC_RUN_ID": "job-1", "TORCHELASTIC_USE_AGENT_STORE": "True",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("rank", "local", "local_size", "group"),
    [(0, 0, 2, 0), (1, 0, 2, 1), (2, 1, 2, 0), (3, 1, 2, 1), (4, 0, 1, 2)],
)
def test_torchrun_env_counts_one_node_per_host(rank, local, local_size, group) -> None:
    env = torchrun_env(rank=rank, hosts=["a", "b", "a", "b", "c"], master_addr="a",
                       master_port=1, restart_count=0, max_restarts=0, run_id="j")  # fmt: skip
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(local), str(local_size))
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["RANK"]) == (str(group), "3", str(rank))


@pytest.mark.parametrize(
    ("given", "count"), [(None, 0), (3, 3), ("3", 3), ("60/h", 60), ("unlimited", UNLIMITED)]
)
def test_max_restarts_count(given, count) -> None:
    assert max_restarts_count(given) == count


def test_torchrun_workers_run_the_launcher() -> None:
    spec = JobSpec(name="j", script="/t.py", script_args=["--x", "1"], torchrun=True)
    assert spec.worker_argv == ["-m", "tidal.worker.compat.torchrun", "/t.py", "--x", "1"]
    assert JobSpec(name="j", script="/t.py").worker_argv == ["/t.py"]
    with pytest.raises(ValueError, match="--torchrun scripts keep their own snapshots"):
        JobSpec(name="j", script="/t.py", torchrun=True, checkpoint_every=5)
    with pytest.raises(ValueError, match="--preemption-notice is tidal.Trainer's"):
        JobSpec(name="j", script="/t.py", torchrun=True, preemption_notice="aws")


# -- the coordinator's passes ----------------------------------------------------------------
def formed(r, gen_id: int, t: float = 100.0) -> None:
    """A member's launcher saw the world's process group (its report, as it arrives)."""
    r.parts.effects.on_step_report(StepReport(generation=gen_id, start_step=0, first_step_time=t))


def register(r, *wids: int) -> None:
    for wid in wids:
        r.job.workers[wid].state = WorkerState.STANDBY


def sigterms(r) -> list[int]:
    return [a.worker_id for a in r.ex.took(SignalWorker) if a.signum == signal.SIGTERM]


def test_a_scale_up_stops_the_world_and_opens_the_next_once_it_is_gone() -> None:
    r = rig(members=(0, 1), torchrun=True)
    r.parts.effects.apply_scale(3)
    r.pass_()
    assert sigterms(r) == [0, 1] and all(r.job.workers[w].retired for w in (0, 1))
    assert [a.worker_id for a in r.ex.took(StartWorker)] == [2, 3, 4]  # meanwhile
    register(r, 2, 3, 4)
    r.pass_()
    assert r.ex.took(OpenGeneration) == []  # the old members still run
    r.ex.exits = [Exit(worker_id=0, returncode=-15), Exit(worker_id=1, returncode=-15)]
    r.pass_()
    assert r.job.members == [2, 3, 4] and r.job.latest.id == 2
    assert r.job.latest.reason == "restart 1: 2 -> 3 workers"
    assert [r.job.workers[w].state for w in (0, 1)] == [EXITED, EXITED]
    assert r.job.failures == 0  # a planned change costs nothing
    formed(r, 2, t=r.job.latest.stopped_at + 1.5)
    assert r.job.latest.pause_s == pytest.approx(1.5)


def test_a_lost_member_restarts_the_world_within_max_restarts() -> None:
    r = rig(members=(0, 1), torchrun=True)
    r.ex.exits = [Exit(worker_id=1, returncode=1), Exit(worker_id=0, returncode=-9)]
    r.pass_()  # the signal first: the peer's error follows from it
    assert r.job.failures == 1 and r.job.outcome is None
    assert r.job.workers[1].state == FAILED and "after a peer's failure" in " ".join(r.ex.events())
    assert [a.worker_id for a in r.ex.took(StartWorker)] == [2, 3]
    register(r, 2, 3)
    r.pass_()
    assert r.job.members == [2, 3] and "worker 0 failed (killed by SIGKILL)" in r.job.latest.reason


def test_the_job_succeeds_once_every_member_finished() -> None:
    r = rig(members=(0, 1), torchrun=True)
    r.ex.exits = [Exit(worker_id=0, returncode=0)]
    r.pass_()
    assert r.job.outcome is None and r.job.workers[0].state == EXITED
    r.parts.effects.apply_scale(3)
    r.pass_()
    assert sigterms(r) == []  # the world ends with the job: no restart
    r.ex.exits = [Exit(worker_id=1, returncode=0)]
    r.pass_()
    assert r.job.outcome == JobState.SUCCEEDED


def test_a_script_that_exits_0_without_a_process_group_fails_the_job_once() -> None:
    r = rig(standby=(0, 1), torchrun=True)
    r.pass_()
    assert r.job.members == [0, 1]
    r.ex.exits = [Exit(worker_id=0, returncode=0)]
    r.pass_()
    assert r.job.outcome == JobState.FAILED and r.ex.took(StartWorker) == []
    assert any("exited 0 before its process group formed" in e for e in r.ex.events())


def test_a_stop_sends_sigterm_to_the_world() -> None:
    r = rig(members=(0, 1), torchrun=True)
    r.parts.effects.apply_stop()
    r.pass_()
    assert r.job.outcome == JobState.STOPPED and sigterms(r) == [0, 1]
