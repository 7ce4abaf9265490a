"""Failed-collective reports and the re-form they ask for (``Effects.apply_failure``,
``reform_rules.reform_due``), on a real coordinator in this process with worker records and no
worker processes (the harness of ``test_repeated_failure``). Time is passed to the loop's
step (``_maybe_reform(now)``), so nothing here depends on the machine's speed."""

from __future__ import annotations

import pytest
from test_repeated_failure import PREMUL, coord  # noqa: F401 - the fixture

from tidal.coordinator.control.controller import Coordinator
from tidal.coordinator.control.loop import REFORM_GRACE_S
from tidal.protocol import FailureReport


def report(c: Coordinator, wid: int, gen: int) -> None:
    c.on_failure(wid, FailureReport(generation=gen, step=5, error=PREMUL))


def reform_at(c: Coordinator, after_s: float) -> None:
    """One decision of the loop, ``after_s`` after the pending request was made."""
    with c.lock:
        c.loop.maybe_reform(c.job.reform_requested.at + after_s)


def test_a_failure_every_member_reported_re_forms_without_the_grace(coord: Coordinator):  # noqa: F811
    gen = coord.job.latest.id
    report(coord, 1, gen)
    reform_at(coord, 0.001)
    assert coord.job.latest.id == gen  # one member still to report: its exit may be coming
    report(coord, 0, gen)
    assert coord.job.reform_requested.reporters == frozenset({0, 1})
    reform_at(coord, 0.001)
    assert coord.job.latest.id == gen + 1, "every member reported: nobody's exit to wait for"
    assert coord.job.latest.members == [0, 1]
    assert coord.job.reform_requested is None


def test_with_a_member_silent_the_re_form_waits_the_grace(coord: Coordinator):  # noqa: F811
    gen = coord.job.latest.id
    report(coord, 1, gen)
    report(coord, 1, gen)  # the same member twice counts once
    assert coord.job.reform_requested.reporters == frozenset({1})
    reform_at(coord, REFORM_GRACE_S / 2)
    assert coord.job.latest.id == gen
    reform_at(coord, REFORM_GRACE_S * 1.5)
    assert coord.job.latest.id == gen + 1


def test_a_report_of_the_next_generation_is_not_lost_with_a_stale_request(coord: Coordinator):  # noqa: F811
    """A request for generation G waits its grace; G+1 opens meanwhile (the coordinator saw
    an exit) and fails too. Its reports used to be dropped while G's request was pending,
    and G's was then dropped as answered: G+1's members waited for a re-form forever."""
    gen = coord.job.latest.id
    report(coord, 1, gen)
    with coord.lock:
        coord.generations.open([0, 1], "a member's exit was seen")  # G+1, within G's grace
    report(coord, 0, gen + 1)
    req = coord.job.reform_requested
    assert (req.generation, req.reporters) == (gen + 1, frozenset({0}))
    reform_at(coord, REFORM_GRACE_S * 1.5)
    assert coord.job.latest.id == gen + 2


@pytest.mark.parametrize("late", [0, 1])
def test_a_report_of_an_older_generation_changes_nothing(coord: Coordinator, late: int):  # noqa: F811
    gen = coord.job.latest.id
    with coord.lock:
        coord.generations.open([0, 1], "re-formed")
    report(coord, late, gen)
    assert coord.job.reform_requested is None
