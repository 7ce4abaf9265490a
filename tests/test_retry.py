"""A worker's retries and what a refused heartbeat keeps (``tidal.worker.agent.retry``), pure."""

from __future__ import annotations

import pytest

from tidal.worker.agent.retry import CAP_S, Refused, after_refusal, backoff_s


@pytest.mark.parametrize(
    ("attempt", "draw", "wait"),
    [
        (0, 0.0, 0.025),
        (0, 0.999999, 0.05),
        (1, 0.0, 0.05),
        (3, 0.5, 0.3),
        (4, 0.0, 0.4),
        (5, 0.0, 0.5),  # 1.6 s capped at 1 s, halved by the lowest draw
        (100, 0.999999, CAP_S),
    ],
)
def test_backoff_grows_exponentially_to_a_cap_with_jitter(attempt, draw, wait):
    assert backoff_s(attempt, draw) == pytest.approx(wait, rel=1e-5)


def test_retries_of_many_workers_spread_out():
    waits = {round(backoff_s(10, d / 100), 6) for d in range(100)}
    assert len(waits) == 100 and min(waits) >= CAP_S / 2 and max(waits) <= CAP_S


def _refused(metrics=0, steps=0, reports=0, checkpoints=(), failures=0):
    return Refused(
        metrics=metrics,
        step_records=steps,
        reports=reports,
        checkpoints=list(checkpoints),
        checkpoint_failures=failures,
    )


@pytest.mark.parametrize(
    ("refused", "keep", "words"),
    [
        (_refused(metrics=2, checkpoints=[(4, "/c/4")]), True, "dropped the 2 metrics"),
        (_refused(steps=3), True, "0 metrics and 3 per-step records it carried"),
        (_refused(checkpoints=[(4, "/c/4")], reports=1), False, "checkpoints step 4 (/c/4)"),
        (_refused(failures=1), False, "1 checkpoint failures"),
        (_refused(), False, None),  # nothing carried: nothing to say beyond the refusal
    ],
)
def test_a_refused_heartbeat_drops_the_scripts_records_and_keeps_tidals(refused, keep, words):
    verdict = after_refusal(refused)
    assert verdict.keep_own is keep
    if words is None:
        assert verdict.dropped is None
    else:
        assert words in verdict.dropped
    if keep and refused.checkpoints:
        assert "go again" in verdict.dropped
