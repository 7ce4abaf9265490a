"""Table tests of the control loop's rules about workers' lives (``coordinator.*_rules``) and
its timing (``coordinator.pacing``): pure functions, milliseconds, no processes."""

from __future__ import annotations

import pytest

from tidal.coordinator.job import Streak as S
from tidal.coordinator.rules.end_rules import (
    completion_refused,
    final_checkpoint,
    start_timed_out,
    wind_down,
)
from tidal.coordinator.rules.exit_rules import ExitFacts, HealthFacts, Kill, judge_exit, to_kill
from tidal.coordinator.rules.pacing import (
    HEARTBEATS_PER_S,
    LOOP_BUSY_S,
    LOOP_SETTLED_S,
    clocks_restart,
    heartbeat_interval,
    loop_wait,
)
from tidal.coordinator.rules.reform_rules import (
    REFORMS_WITHOUT_PROGRESS,
    every_member_lost,
    reform_due,
    repeated_failure,
    roll_back,
)
from tidal.coordinator.rules.scale_rules import (
    capacity_victims,
    effective_target,
    leaver_target,
    newer_forming,
    schedule_ahead,
    schedule_due,
    schedule_near,
    schedule_settled,
)
from tidal.coordinator.rules.verdicts import Act
from tidal.protocol import WorkerState
from tidal.restarts import parse_max_restarts

EXITED, FAILED = WorkerState.EXITED, WorkerState.FAILED
KILLED = dict(returncode=-9, how="killed by SIGKILL")
R3, HOURLY2 = parse_max_restarts(3), parse_max_restarts("2/h")


@pytest.mark.parametrize(
    ("facts", "state", "message", "lost", "reform", "fail_job", "target"),
    [
        # asked to leave, exited cleanly: nothing to recover
        (
            dict(returncode=0, how="exited with code 0", leaving=True),
            EXITED,
            "worker 3 exited",
            False,
            False,
            None,
            None,
        ),
        (
            dict(returncode=0, how="", retired=True, reason="node drained"),
            EXITED,
            "worker 3 exited: node drained",
            False,
            False,
            None,
            None,
        ),
        # leaving anyway: noted, costs nothing
        (
            dict(**KILLED, retired=True),
            FAILED,
            "worker 3 killed by SIGKILL while leaving",
            False,
            False,
            None,
            None,
        ),
        (
            dict(**KILLED, leaving=True, was_member=False, kill_reason="did not exit"),
            FAILED,
            "worker 3 did not exit while leaving",
            False,
            False,
            None,
            None,
        ),
        # a member that crashed: re-form without it
        (
            dict(**KILLED, was_member=True),
            FAILED,
            "worker 3 failed (killed by SIGKILL)",
            True,
            True,
            None,
            None,
        ),
        # a standby that crashed: lost, no generation to re-form
        (
            dict(**KILLED, was_member=False),
            FAILED,
            "worker 3 failed (killed by SIGKILL)",
            True,
            False,
            None,
            None,
        ),
        # a stopping member (asked to exit with the job) that was killed: still a member
        (
            dict(**KILLED, leaving=True, was_member=True),
            FAILED,
            "worker 3 failed",
            True,
            True,
            None,
            None,
        ),
        # the script raised: every worker would; the job fails
        (
            dict(returncode=1, how="exited with code 1", detail="ValueError: x", was_member=True),
            FAILED,
            "worker 3 failed (exited with code 1): ValueError: x",
            False,
            False,
            "worker 3 exited with code 1: ValueError: x",
            None,
        ),
        # exited 0 before it ever joined (no Trainer, or its run never iterated): the script's
        # bug, every worker shares it; the job fails at once, no replacement (issue 50)
        (
            dict(returncode=0, how="exited with code 0", joined=False, script="train.py"),
            FAILED,
            "worker 3 exited 0 without joining the job",
            False,
            False,
            "train.py exited 0 without running a tidal.Trainer (did it run its main?)",
            None,
        ),
        # ... the same while others train (it was no member), and with restarts spent
        (
            dict(
                returncode=0,
                how="exited with code 0",
                joined=False,
                script="train.py",
                failures=99,
                max_restarts=R3,
                alive_others=2,
                target=3,
            ),
            FAILED,
            "worker 3 exited 0 without joining the job",
            False,
            False,
            "train.py exited 0 without running a tidal.Trainer (did it run its main?)",
            None,
        ),
        # ... not when it was asked to leave before joining (a spare retired), nor once the
        # job is decided, nor when the coordinator killed it
        (
            dict(returncode=0, how="exited with code 0", joined=False, retired=True),
            EXITED,
            "worker 3 exited",
            False,
            False,
            None,
            None,
        ),
        (  # the backend's own word on the end: not the script's doing
            dict(
                returncode=0,
                how="cancelled before Ray placed it",
                joined=False,
                reason="cancelled before Ray placed it",
                was_member=False,
            ),
            FAILED,
            "worker 3 failed (cancelled before Ray placed it)",
            True,
            False,
            None,
            None,
        ),
        (
            dict(returncode=0, how="exited with code 0", joined=False, job_decided=True),
            FAILED,
            "worker 3 failed (exited with code 0)",
            False,
            False,
            None,
            None,
        ),
        (
            dict(returncode=0, how="", joined=False, kill_reason="missed heartbeats"),
            FAILED,
            "worker 3 failed (missed heartbeats)",
            True,
            False,
            None,
            None,
        ),
        # a worker that joined and exited 0 unasked stays a lost worker, as before
        (
            dict(returncode=0, how="exited with code 0", joined=True, was_member=True),
            FAILED,
            "worker 3 failed (exited with code 0)",
            True,
            True,
            None,
            None,
        ),
        # a positive code the coordinator caused (it killed it as hung) is a lost worker
        (
            dict(
                returncode=1,
                how="exited with code 1",
                kill_reason="missed heartbeats for 11.0 s",
                was_member=True,
            ),
            FAILED,
            "worker 3 failed (missed heartbeats for 11.0 s)",
            True,
            True,
            None,
            None,
        ),
        # the job's outcome is decided: recorded, nothing else
        (
            dict(**KILLED, was_member=True, job_decided=True),
            FAILED,
            "worker 3 failed",
            False,
            False,
            None,
            None,
        ),
        # the restart budget is spent: the target shrinks to what is left, never below min
        (
            dict(
                **KILLED,
                was_member=True,
                failures=3,
                max_restarts=R3,
                target=4,
                alive_others=2,
                min_workers=1,
            ),
            FAILED,
            "worker 3 failed",
            True,
            True,
            None,
            2,
        ),
        (
            dict(
                **KILLED,
                was_member=True,
                failures=3,
                max_restarts=R3,
                target=4,
                alive_others=3,
                min_workers=3,
            ),
            FAILED,
            "worker 3 failed",
            True,
            True,
            None,
            3,
        ),
        # ... and fewer left than --min-workers: the job fails rather than train below it
        (
            dict(
                **KILLED,
                was_member=True,
                failures=3,
                max_restarts=R3,
                target=4,
                alive_others=1,
                min_workers=2,
            ),
            FAILED,
            "worker 3 failed",
            True,
            False,
            "the restart budget of 3 is spent and 1 workers are left, fewer than --min-workers 2",
            None,
        ),
        # within the budget, below min is only while a replacement starts: no failure
        (
            dict(
                **KILLED,
                was_member=True,
                failures=2,
                max_restarts=R3,
                target=2,
                alive_others=1,
                min_workers=2,
            ),
            FAILED,
            "worker 3 failed",
            True,
            True,
            None,
            None,
        ),
        # a rate (2/h): two losses in the hour before this one are past it: replacements
        # stop, the target shrinks to what is left
        (
            dict(
                **KILLED,
                was_member=True,
                failures=40,
                max_restarts=HOURLY2,
                recent=(1000.0, 2000.0),
                now=3000.0,
                target=4,
                alive_others=2,
            ),
            FAILED,
            "worker 3 failed",
            True,
            True,
            None,
            2,
        ),
        # ... one of them out of the window (a lifetime count of 40 does not matter): replaced
        (
            dict(
                **KILLED,
                was_member=True,
                failures=40,
                max_restarts=HOURLY2,
                recent=(1000.0, 2000.0),
                now=4600.0,
                target=4,
                alive_others=2,
            ),
            FAILED,
            "worker 3 failed",
            True,
            True,
            None,
            None,
        ),
        # ... past the rate with fewer than --min-workers left: the job fails, saying the rate
        (
            dict(
                **KILLED,
                was_member=True,
                max_restarts=HOURLY2,
                recent=(2990.0, 2995.0),
                now=3000.0,
                target=2,
                alive_others=1,
                min_workers=2,
            ),
            FAILED,
            "worker 3 failed",
            True,
            False,
            "more than 2 workers were lost within an hour and 1 workers are left, fewer than "
            "--min-workers 2",
            None,
        ),
        # unlimited: the thousandth loss in a second is replaced like the first
        (
            dict(
                **KILLED,
                was_member=True,
                failures=1000,
                max_restarts=parse_max_restarts("unlimited"),
                recent=(2999.0,) * 50,
                now=3000.0,
                target=2,
                alive_others=0,
                min_workers=2,
            ),
            FAILED,
            "worker 3 failed",
            True,
            True,
            None,
            None,
        ),
    ],
)
def test_judge_exit(facts, state, message, lost, reform, fail_job, target) -> None:
    v = judge_exit(ExitFacts(worker_id=3, **facts))
    assert v.state == state
    assert v.message.startswith(message), v.message
    assert (v.lost, v.reform, v.fail_job, v.target) == (lost, reform, fail_job, target)


RUNNING, STANDBY, STOPPING, STARTING = (
    WorkerState.RUNNING,
    WorkerState.STANDBY,
    WorkerState.STOPPING,
    WorkerState.STARTING,
)


@pytest.mark.parametrize(
    ("worker", "kill"),
    [
        (
            HealthFacts(worker_id=1, state=RUNNING, silent_s=10.5),
            ("failure", "missed heartbeats for 10.5 s"),
        ),
        (
            HealthFacts(worker_id=1, state=STANDBY, silent_s=11.0),
            ("failure", "missed heartbeats for 11.0 s"),
        ),
        (HealthFacts(worker_id=1, state=RUNNING, silent_s=9.9), None),
        (HealthFacts(worker_id=1, state=RUNNING, silent_s=None), None),  # never beat yet
        (HealthFacts(worker_id=1, state=STARTING, silent_s=99.0), None),  # start timeout's
        (HealthFacts(worker_id=1, state=RUNNING, silent_s=99.0, killed=True), None),  # once
        # stopping: the grace period bounds it, not its silence
        (HealthFacts(worker_id=1, state=STOPPING, silent_s=99.0, stopping_s=29.0), None),
        (
            HealthFacts(worker_id=1, state=STOPPING, stopping_s=31.0),
            ("worker", "did not exit within 30 s of being asked"),
        ),
    ],
)
def test_to_kill(worker, kill) -> None:
    got = to_kill([worker], heartbeat_timeout_s=10.0, stop_grace_s=30.0)
    assert got == ([] if kill is None else [Kill(worker_id=1, kind=kill[0], reason=kill[1])])


@pytest.mark.parametrize(
    ("alive", "members", "cap", "victims"),
    [
        ([0, 1, 2], [0, 1, 2], 3, []),
        ([0, 1, 2], [0, 1, 2], 2, [2]),  # the highest rank
        ([0, 1, 2, 7], [0, 1, 2], 2, [7, 2]),  # a spare first
        ([0, 1, 2, 7, 8], [2, 0, 1], 1, [7, 8, 1, 0]),  # ranks by member order, not id
        ([0, 1], [0, 1], 0, [0, 1][::-1]),
    ],
)
def test_capacity_victims(alive, members, cap, victims) -> None:
    assert capacity_victims(alive, members, cap) == victims


@pytest.mark.parametrize(
    ("pending", "waited", "why"),
    [
        (True, 121.0, "no generation formed within 120 s (--start-timeout); see the worker logs"),
        (True, 119.0, None),
        (False, 500.0, None),  # running: the start is over
    ],
)
def test_start_timed_out(pending, waited, why) -> None:
    assert start_timed_out(pending=pending, waited_s=waited, start_timeout_s=120.0) == why


def test_start_timed_out_says_the_failed_collectives_that_kept_it_from_forming() -> None:
    failed = S(step=0, count=7, last="worker 1: RuntimeError: boom")
    why = start_timed_out(pending=True, waited_s=121.0, start_timeout_s=120.0, failed=failed)
    assert why == (
        "no generation formed within 120 s (--start-timeout); the collective at step 0 failed 7 "
        "times in a row "
        "(last: worker 1: RuntimeError: boom)"
    )
    running = start_timed_out(pending=False, waited_s=500.0, start_timeout_s=120.0, failed=failed)
    assert running is None


@pytest.mark.parametrize(
    ("checkpoint", "action", "text"),
    [
        (None, Act.FAIL, "no live worker holds the training state of step 57"),
        (50, Act.ROLL_BACK, "rolling back to the checkpoint of step 50 (7 steps redone)"),
        (57, Act.ROLL_BACK, "(0 steps redone)"),
    ],
)
def test_roll_back(checkpoint, action, text) -> None:
    got = roll_back(lost_step=57, checkpoint_step=checkpoint)
    assert got.act is action and text in got.why


@pytest.mark.parametrize(
    ("keeps", "checkpoint", "action", "text"),
    [
        (False, None, Act.FAIL, "every worker was lost; nothing holds the training state"),
        (True, None, Act.FAIL, "every worker was lost; no live worker holds the training state"),
        (
            True,
            50,
            Act.RESUME,
            "lost at step 57: the next members resume from the checkpoint of step 50",
        ),
    ],
)
def test_every_member_lost(keeps, checkpoint, action, text) -> None:
    got = every_member_lost(keeps_checkpoints=keeps, checkpoint_step=checkpoint, step=57)
    assert got.act is action and text in got.why


@pytest.mark.parametrize(
    ("wid", "step", "length", "why"),
    [
        (1, 100, 100, ""),
        (1, 101, 100, ""),
        (1, 99, 100, "the job has 100 steps"),
        (5, 100, 100, "it is not a member of the current generation"),
        (1, 100, None, "the job's length is unknown (no worker registered its max_steps)"),
    ],
)
def test_completion_refused(wid, step, length, why) -> None:
    assert completion_refused(worker_id=wid, step=step, current={0, 1}, job_length=length) == why


@pytest.mark.parametrize(
    ("ours", "requested", "minimum", "target"),
    [(True, 3, 1, None), (False, 3, 1, 2), (False, 2, 2, 2), (False, 1, 1, 1)],
)
def test_leaver_target(ours, requested, minimum, target) -> None:
    assert leaver_target(sent_by_us=ours, requested=requested, min_workers=minimum) == target


@pytest.mark.parametrize(
    ("requested", "capacity", "target"), [(4, None, 4), (4, 2, 2), (2, 5, 2), (3, 0, 0)]
)
def test_effective_target(requested, capacity, target) -> None:
    assert effective_target(requested, capacity) == target


SCHEDULE = ((20, 3), (40, 1), (60, 2))


@pytest.mark.parametrize(
    ("done", "step", "due"),
    [
        (0, 19, []),
        (0, 20, [(20, 3)]),
        (0, 45, [(20, 3), (40, 1)]),  # a resumed job passes several at once, in order
        (1, 45, [(40, 1)]),
        (3, 99, []),
    ],
)
def test_schedule_due(done, step, due) -> None:
    assert schedule_due(SCHEDULE, done, step) == due


@pytest.mark.parametrize(
    ("schedule", "done", "step", "formed", "settled", "due"),
    [
        (SCHEDULE, 0, 18, True, -1, []),  # two steps before: nothing yet
        (SCHEDULE, 0, 19, True, -1, [(20, 3)]),  # the step before, formed: one step ahead
        (SCHEDULE, 0, 19, False, -1, []),  # not before the latest generation formed
        (SCHEDULE, 0, 20, False, -1, [(20, 3)]),  # ... then at its step, as always
        (SCHEDULE, 1, 39, True, 20, [(40, 1)]),
        (SCHEDULE, 1, 39, True, None, []),  # the change at 20 is not settled yet
        (SCHEDULE, 3, 99, True, 60, []),  # the schedule is done
        (((10, 2), (11, 3)), 0, 10, True, -1, [(10, 2)]),  # one due now goes alone ...
        (((10, 2), (11, 3)), 1, 10, True, -1, []),  # ... the next waits for it to settle,
        (((10, 2), (11, 3)), 1, 10, False, 10, []),  # ... for its generation to form,
        (((10, 2), (11, 3)), 1, 10, True, 10, [(11, 3)]),  # ... then goes a step ahead
        (((10, 2), (11, 3)), 0, 9, True, -1, [(10, 2)]),  # never two in one change
        (SCHEDULE, 0, 45, True, -1, [(20, 3), (40, 1)]),  # a resumed job's passed entries
    ],
)
def test_schedule_ahead(schedule, done, step, formed, settled, due) -> None:
    assert schedule_ahead(schedule, done, step, formed=formed, settled=settled) == due


@pytest.mark.parametrize(
    ("step", "near"),
    [(18, False), (19, True), (20, True), (21, False), (39, True), (60, True), (61, False)],
)
def test_schedule_near(step, near) -> None:
    assert schedule_near(SCHEDULE, step) is near


@pytest.mark.parametrize(
    ("at", "latest", "formed", "held", "forming"),
    [
        # the lone survivor holds at 20 in generation 3; generation 4 needs it to form
        (20, 4, False, [(20, 3), None], True),
        (20, 4, True, [(20, 3), None], False),  # it formed: nothing waits on them
        # ``10:2,11:3``: the member holds at 11 in generation 2, whose first-step report
        # has not come yet: generation 2 is theirs, not a newer one
        (11, 2, False, [(11, 2), None], False),
        (11, 2, False, [(10, 1), None], False),  # an earlier hold is not this one's
        (11, 2, False, [None, None], False),  # nobody holds yet
    ],
)
def test_newer_forming(at, latest, formed, held, forming) -> None:
    assert newer_forming(at=at, latest=latest, formed=formed, held=held) is forming


@pytest.mark.parametrize(
    ("held_at", "settled", "members", "target", "waited", "forming", "go"),
    [
        (None, None, 2, 2, 0.0, False, False),  # no schedule applied yet
        (None, None, 2, 3, 0.0, True, False),  # nobody held
        (20, None, 3, 3, 0.1, False, True),  # the generation has the target
        (20, None, 2, 3, 5.0, False, False),  # still joining
        (20, None, 2, 3, 121.0, False, True),  # it could not: train on with what it has
        (20, None, 2, 3, 0.1, True, True),  # a newer generation needs the held to form
        (20, 10, 3, 3, 0.1, False, True),  # an earlier step settled
        (20, 20, 3, 3, 0.1, True, False),  # already settled
    ],
)
def test_schedule_settled(held_at, settled, members, target, waited, forming, go) -> None:
    got = schedule_settled(
        held_at=held_at,
        settled=settled,
        members=members,
        target=target,
        waited_s=waited,
        timeout_s=120.0,
        newer_forming=forming,
    )
    assert got is go


@pytest.mark.parametrize(
    ("age", "reported", "latest", "unreported", "due"),
    [
        (0.05, 4, 4, 1, False),  # a member has not reported: its exit may be on its way
        (0.15, 4, 4, 1, True),  # the grace is over: re-form with the same members
        (0.2, 3, 4, 1, None),  # a newer generation answers it
        (0.05, 3, 4, 1, False),
        (0.0, 4, 4, 0, True),  # every member reported: nobody's exit to wait for
        (0.05, 3, 4, 0, False),  # ... of an older generation: not a reason to re-form
        (0.2, 3, 4, 0, None),
    ],
)
def test_reform_due(age, reported, latest, unreported, due) -> None:
    got = reform_due(
        requested_at=10.0,
        now=10.0 + age,
        grace_s=0.1,
        reported_gen=reported,
        latest_gen=latest,
        unreported=unreported,
    )
    assert got is due


PREMUL = "RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo"
LOST = None  # a member lost: the coordinator forgets the streak (``Lifecycle.on_exit``)


def fold(history):
    """The verdicts of ``repeated_failure`` along ``history``: the job's committed step at
    each failed collective due for a re-form, or ``LOST``."""
    streak, verdicts = None, []
    for i, step in enumerate(history):
        if step is LOST:
            streak = None
            continue
        streak, fail = repeated_failure(streak, step=step, worker_id=i % 2, error=PREMUL)
        verdicts.append(fail)
    return streak, verdicts


@pytest.mark.parametrize(
    ("history", "fails_at", "count"),
    [
        ([0] * 10, 9, 10),  # the tenth in a row at step 0 fails the job, not an eleventh
        ([0] * 9, None, 9),  # nine: a legitimate run of forming failures under load
        ([5] * 3 + [0] * 10, 12, 10),  # a roll-back to step 0: a new streak there
        ([0] * 9 + [1] + [1] * 8, None, 9),  # one committed step resets the count
        ([0] * 9 + [1] * 10, 18, 10),  # ...and a new streak fails at its own tenth
        ([3, 4] * 20, None, 1),  # a failure every step, each one a step further: progress
        ([7] * 9 + [LOST] + [7] * 9, None, 9),  # a lost member explains its peers' failures
        ([7] * 5 + [LOST] + [7] * 10, 14, 10),
        ([0] * 12, 9, 12),  # were it asked again, it still fails
    ],
)
def test_repeated_failure(history, fails_at, count) -> None:
    streak, verdicts = fold(history)
    failed = [i for i, v in enumerate(verdicts) if v is not None]
    assert (failed[0] if failed else None) == fails_at
    assert streak.count == count


def test_repeated_failure_names_the_repeat_and_quotes_the_last_error_in_one_line() -> None:
    streak = S(step=0, count=REFORMS_WITHOUT_PROGRESS - 1, last="worker 0: RuntimeError: x")
    streak, fail = repeated_failure(
        streak, step=0, worker_id=1, error=PREMUL + "\nException raised from ...\n  frame #0"
    )
    assert fail == (
        "the collective at step 0 failed 10 times in a row with every member alive "
        "(last: worker 1: RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo)"
    )
    assert streak == S(step=0, count=10, last=f"worker 1: {PREMUL}")
    _, fail = repeated_failure(None, step=3, worker_id=0, error="RuntimeError: " + "y" * 900)
    assert fail is None
    streak, fail = repeated_failure(
        S(step=3, count=1, last=""), step=3, worker_id=0, error="E: " + "y" * 900, limit=2
    )
    assert fail is not None and len(streak.last) <= len("worker 0: ") + 300
    assert REFORMS_WITHOUT_PROGRESS == 10


@pytest.mark.parametrize(
    ("peers", "interval"),
    [
        (2, 0.1),  # a small job beats at its own interval
        (20, 0.1),
        (400, 2.0),  # 400 members: 200 a second in all, half a core's budget
        (1024, 2.0),  # never slower than a fifth of the heartbeat timeout
    ],
)
def test_heartbeat_interval(peers, interval) -> None:
    got = heartbeat_interval(base_s=0.1, peers=peers, timeout_s=10.0)
    assert got == pytest.approx(interval)


def test_heartbeat_pacing_keeps_the_job_within_budget() -> None:
    for peers in (50, 100, 200, 300):
        got = heartbeat_interval(base_s=0.1, peers=peers, timeout_s=1e9)
        assert peers / got == pytest.approx(HEARTBEATS_PER_S / 2)


@pytest.mark.parametrize(
    ("written", "error", "writer", "live", "action", "text"),
    [
        (True, None, 0, False, Act.SUCCEED, ""),  # recorded: success, whoever is left
        (False, None, 0, True, Act.WAIT, ""),  # its report may come after the completion's
        (False, "disk full", 0, True, Act.FAIL, "could not be written: disk full"),
        (False, None, 3, False, Act.FAIL, "worker 3, its writer, was lost while writing it"),
        (False, None, None, False, Act.FAIL, "its writer was lost"),
    ],
)
def test_final_checkpoint(written, error, writer, live, action, text) -> None:
    got = final_checkpoint(step=1200, written=written, error=error, writer=writer, writer_live=live)
    assert got.act is action and text in got.why
    if action is Act.FAIL:
        assert "last step (1200)" in got.why


@pytest.mark.parametrize(
    ("failed", "waited", "alive", "begin", "kill", "end"),
    [
        (False, None, 3, True, None, False),  # members finish their step on their own
        (True, None, 3, True, "the job failed", False),  # nothing they do is kept
        (False, 29.0, 1, False, None, False),  # within the grace
        (False, 31.0, 1, False, "still running 30 s", False),
        (True, 31.0, 0, False, None, True),  # every process gone: the end is recorded
        (False, None, 0, True, None, True),  # gone before the outcome: begin and end at once
    ],
)
def test_wind_down(failed, waited, alive, begin, kill, end) -> None:
    got = wind_down(failed=failed, waited_s=waited, alive=alive, grace_s=30.0)
    assert (got.begin, got.end) == (begin, end)
    assert (got.kill is None) == (kill is None) and (kill is None or kill in got.kill)


@pytest.mark.parametrize(
    ("gap", "restart"), [(0.02, False), (2.0, False), (2.01, True), (60, True)]
)
def test_clocks_restart(gap, restart) -> None:
    assert clocks_restart(gap_s=gap, not_running_s=2.0) is restart


@pytest.mark.parametrize(
    ("settled", "wait_s", "why"),
    [
        (False, LOOP_BUSY_S, "a change is in motion"),
        (True, LOOP_SETTLED_S, "settled"),
    ],
)
def test_loop_wait(settled, wait_s, why) -> None:
    assert loop_wait(settled=settled) == (wait_s, why)
    assert LOOP_BUSY_S < LOOP_SETTLED_S <= 0.25  # no slower than the heartbeat check
