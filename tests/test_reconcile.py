"""The membership plan is a pure function: queue pools, check the decisions."""

import pytest

from tidal.policy.reconcile import START_DEFER_S, Pool, reconcile
from tidal.policy.schedule import future_peak, ignored, reachable


def test_first_generation_waits_for_the_whole_initial_group():
    plan = reconcile(Pool(members=[], standby=[0], starting=[1], target=2, forming=True))
    assert plan.members is None and plan.start == 0
    plan = reconcile(Pool(members=[], standby=[0, 1], starting=[], target=2, forming=True))
    assert plan.members == [0, 1]
    assert "start" in plan.reason


def test_cold_start_launches_target_plus_spares():
    plan = reconcile(Pool(members=[], standby=[], starting=[], target=2, spares=1, forming=True))
    assert plan.start == 3


def test_scale_up_admits_ready_standbys_in_order_and_starts_the_rest():
    plan = reconcile(Pool(members=[0, 1], standby=[5], starting=[], target=4))
    assert plan.members == [0, 1, 5]
    assert plan.start == 1
    assert "5 joined" in plan.reason


def test_a_joiner_waits_while_the_latest_generation_forms_and_starts_nothing_more():
    # After a failure the survivors re-form [0, 1]; the replacement 7 registered meanwhile.
    pool = dict(members=[0, 1], standby=[7], starting=[], target=3)
    plan = reconcile(Pool(**pool, settling=True))
    assert plan.members is None and plan.start == 0 and plan.retire == []
    plan = reconcile(Pool(**pool, settling=False))  # formed: the join is the next switch
    assert plan.members == [0, 1, 7] and "7 joined" in plan.reason


@pytest.mark.parametrize(
    ("settling", "settling_s", "start"),
    [
        (True, 0.0, 0),  # a failure's survivors re-form: the replacement waits
        (True, START_DEFER_S - 0.01, 0),
        (True, START_DEFER_S, 1),  # a first step that long (a compile): wait no more
        (False, 0.0, 1),  # formed: start at once
    ],
)
def test_a_start_waits_for_the_settling_generations_first_step_within_a_bound(
    settling, settling_s, start
):
    plan = reconcile(
        Pool(
            members=[0],
            standby=[],
            starting=[],
            target=2,
            settling=settling,
            settling_s=settling_s,
        )
    )
    assert plan.start == start and plan.members is None


def test_a_scale_down_does_not_wait_for_the_forming_generation():
    plan = reconcile(Pool(members=[0, 1, 2], standby=[], starting=[], target=2, settling=True))
    assert plan.members == [0, 1]


@pytest.mark.parametrize(
    "pool",
    [
        # chaos seed 20500008: a replacement ready as the members finish the last step
        dict(members=[3, 5, 6], standby=[7], starting=[], target=4),
        dict(members=[0, 1, 2], standby=[], starting=[], target=2),  # a scale-down
        dict(members=[0, 1], standby=[], starting=[], target=3),  # a start
    ],
)
def test_a_generation_whose_member_ended_its_loop_is_not_re_formed(pool):
    plain = reconcile(Pool(**pool))
    assert plain.members is not None or plain.start > 0  # a change, were it not ending
    plan = reconcile(Pool(**pool, ending=True))
    assert plan.members is None and plan.start == 0 and plan.retire == []
    assert "ended its training loop" in plan.reason


def test_scale_up_while_processes_start_does_not_start_more():
    plan = reconcile(Pool(members=[0, 1], standby=[], starting=[2], target=3))
    assert plan.members is None and plan.start == 0


def test_scale_down_removes_highest_ranks_and_keeps_spares_warm():
    plan = reconcile(Pool(members=[0, 1, 2], standby=[], starting=[], target=1, spares=1))
    assert plan.members == [0]
    assert plan.to_standby == [1]
    assert plan.retire == [2]
    assert "left" in plan.reason


def test_scale_down_without_future_need_retires_everyone_removed():
    plan = reconcile(Pool(members=[0, 1, 2], standby=[], starting=[], target=1))
    assert plan.members == [0] and plan.retire == [1, 2] and plan.to_standby == []


def test_surplus_standbys_are_retired():
    plan = reconcile(Pool(members=[0], standby=[3, 4], starting=[], target=1, spares=1))
    assert plan.members is None
    assert plan.retire == [3]


def test_steady_state_is_a_no_op():
    plan = reconcile(Pool(members=[0, 1], standby=[], starting=[], target=2))
    assert plan.members is None and plan.start == 0 and plan.retire == []


def test_replacement_after_failure_is_started():
    plan = reconcile(Pool(members=[0], standby=[], starting=[], target=2))
    assert plan.members is None and plan.start == 1


def test_future_peak_looks_only_ahead():
    sched = ((40, 3), (100, 1), (160, 2))
    assert future_peak(sched, 0) == 3
    assert future_peak(sched, 40) == 2
    assert future_peak(sched, 100) == 2
    assert future_peak(sched, 160) == 0


@pytest.mark.parametrize(
    ("sched", "step", "length", "peak"),
    [
        (((500, 3),), 0, 200, 0),  # past the end: no spares (issue 50)
        (((200, 3),), 0, 200, 0),  # at the end: the job is over at step 200
        (((199, 3),), 0, 200, 3),  # the last step's change still comes
        (((500, 3),), 0, None, 3),  # the length not known yet: counted, as before
        (((40, 2), (500, 4)), 0, 200, 2),  # only the reachable entries
        (((40, 2), (500, 4)), 40, 200, 0),
        (((40, 2), (100, 3)), 0, 0, 0),  # run(0): nothing is reachable
    ],
)
def test_future_peak_ignores_entries_at_or_past_the_jobs_length(sched, step, length, peak):
    assert future_peak(sched, step, length) == peak


def test_reachable_and_the_lines_for_the_ignored_entries():
    sched = ((40, 2), (200, 3), (500, 1))
    assert reachable(sched, 200) == ((40, 2),)
    assert reachable(sched, None) == sched
    assert ignored(sched, 200) == [
        "--schedule entry 200:3 is at or past the job's last step (Trainer.run(200)): ignored",
        "--schedule entry 500:1 is at or past the job's last step (Trainer.run(200)): ignored",
    ]
    assert ignored(sched, 1000) == []
