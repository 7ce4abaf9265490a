"""``--max-restarts`` (``tidal.restarts``): its forms, and the sliding window of a rate, as
table tests of pure functions (the time of a loss is a fact passed in)."""

from __future__ import annotations

import pytest

from tidal.config import JobSpec, add_flags, from_flags
from tidal.restarts import (
    DEFAULT_MAX_RESTARTS,
    RestartLimit,
    keep_recent,
    parse_max_restarts,
    within,
)

H = 3600.0


@pytest.mark.parametrize(
    ("given", "count", "window_s", "text"),
    [
        (3, 3, None, "3"),
        (0, 0, None, "0"),
        ("3", 3, None, "3"),
        ("unlimited", None, None, "unlimited"),
        (" Unlimited ", None, None, "unlimited"),
        ("10/h", 10, H, "10/h"),
        ("10 / h", 10, H, "10/h"),
        ("5/m", 5, 60.0, "5/m"),
        ("50/d", 50, 86400.0, "50/d"),
    ],
)
def test_the_forms_of_max_restarts(given, count, window_s, text) -> None:
    limit = parse_max_restarts(given)
    assert (limit.count, limit.window_s, str(limit)) == (count, window_s, text)


@pytest.mark.parametrize("given", [-1, "-1", "3/w", "0/h", "1.5", "", "ten", True, 2.5, None])
def test_a_bad_max_restarts_names_the_flag_and_the_forms(given) -> None:
    with pytest.raises(ValueError, match="--max-restarts") as err:
        parse_max_restarts(given)
    assert "unlimited" in str(err.value) or "write 0" in str(err.value)


@pytest.mark.parametrize(
    ("limit", "failures", "recent", "now", "ok"),
    [
        # a count over the job's life: the third loss of three is within, the fourth is not
        ("3", 2, (), 0.0, True),
        ("3", 3, (), 0.0, False),
        ("0", 0, (), 0.0, False),
        # a rate counts the window before ``now`` only, whatever the job lost before
        ("2/h", 99, (), 10 * H, True),
        ("2/h", 99, (9.5 * H,), 10 * H, True),
        ("2/h", 99, (9.5 * H, 9.9 * H), 10 * H, False),
        ("2/h", 99, (9 * H, 9.9 * H), 10 * H, True),  # exactly an hour ago: out of it
        ("2/h", 99, (9 * H + 1, 9.9 * H), 10 * H, False),
        ("1/m", 0, (100.0,), 159.0, False),
        ("1/m", 0, (100.0,), 161.0, True),
        # a clock set back: a loss "after" now counts as inside the window
        ("1/h", 0, (10 * H + 5,), 10 * H, False),
        # unlimited
        ("unlimited", 10**6, (10 * H,) * 100, 10 * H, True),
    ],
)
def test_within_the_limit(limit, failures, recent, now, ok) -> None:
    assert within(parse_max_restarts(limit), failures=failures, recent=recent, now=now) is ok


@pytest.mark.parametrize(
    ("limit", "recent", "now", "kept"),
    [
        ("2/h", [1.0, 2.0, 3.0], 10.0, [2.0, 3.0]),  # at most count: older ones never matter
        ("3/h", [6.0, H + 4.0, 1.0, 5.0], H + 5.0, [6.0, H + 4.0]),  # out of the window, and sorted
        ("3", [1.0, 2.0], 3.0, []),  # a count keeps no times
        ("unlimited", [1.0], 2.0, []),
    ],
)
def test_keep_recent(limit, recent, now, kept) -> None:
    assert keep_recent(parse_max_restarts(limit), recent, now) == kept


def test_keep_recent_keeps_what_within_needs() -> None:
    """Losses every 10 minutes for a day against 5/h: keeping only ``keep_recent``'s times
    gives every verdict that keeping them all gives."""
    limit = parse_max_restarts("5/h")
    kept: list[float] = []
    every: list[float] = []
    for i in range(144):
        now = i * 600.0 + (i % 7)  # uneven spacing
        assert within(limit, failures=i, recent=kept, now=now) == within(
            limit, failures=i, recent=every, now=now
        )
        every.append(now)
        kept = keep_recent(limit, [*kept, now], now)
        assert len(kept) <= 5


def test_the_default_is_a_rate_and_the_flag_takes_every_form() -> None:
    import argparse

    assert parse_max_restarts(DEFAULT_MAX_RESTARTS) == RestartLimit(60, H, "60/h")
    spec = JobSpec(name="j", script="x.py")
    assert spec.restart_limit.window_s == H
    parser = argparse.ArgumentParser()
    add_flags(parser, JobSpec)
    for text in ("unlimited", "10/h", "0"):
        values = vars(parser.parse_args(["--max-restarts", text]))
        derived = dict(max_workers=1, schedule=(), capacity_trace=None, deadline_s=None)
        made = from_flags(JobSpec, values, name="j", script="x.py", **derived)
        assert str(made.restart_limit) == text
        assert JobSpec.from_dict(made.to_dict()) == made
    assert JobSpec.from_dict({**spec.to_dict(), "max_restarts": 3}).restart_limit.count == 3
    with pytest.raises(ValueError, match="--max-restarts"):
        JobSpec(name="j", script="x.py", max_restarts="3/w")
