"""The control loop's timing rules: how often workers beat, how long the loop sleeps, and
when the coordinator's own silence restarts every clock. Pure functions of plain values,
table-tested (``tests/test_rules.py``) like ``rules``; their callers (``answers``,
``host.runner``, ``lifecycle``) carry the numbers out.
"""

from __future__ import annotations

# -- heartbeat pacing ------------------------------------------------------------------------
#: Heartbeats a second one coordinator core answers, with room to spare (350 to 600 measured
#: by ``bench.control_plane`` on this machine's HTTP stack).
HEARTBEATS_PER_S = 400.0


def heartbeat_interval(*, base_s: float, peers: int, timeout_s: float) -> float:
    """How often a worker among ``peers`` others of its kind (the generation's members, or
    the workers outside it) should beat: the job's interval while the group is small; in a
    large one, slower, so that the whole job stays within half of ``HEARTBEATS_PER_S``
    each. Members learn of a new generation through the store at the next step
    (``worker.notice``), whatever the pacing. Never slower than a fifth of the heartbeat
    timeout: a silent worker is still told apart from a slow one."""
    paced = max(base_s, peers / (HEARTBEATS_PER_S / 2))
    return min(paced, timeout_s / 5)


# -- the control loop's sleep -----------------------------------------------------------------
#: The loop's longest sleep while something is in motion, and while the job is settled.
LOOP_BUSY_S = 0.02
LOOP_SETTLED_S = 0.25


def loop_wait(*, settled: bool) -> tuple[float, str]:
    """How long the control loop may sleep before its next pass if nothing wakes it, and
    why. API calls that need a decision and workers' exits wake it at once whatever this
    says (``Wake``, ``Backend.wake_fds``); what only a pass notices is either timed in
    tenths of a second (a re-form's grace, a worker still importing, a leaver's release:
    the job is not ``settled``) or in seconds (heartbeat silence, policies, capacity
    traces, start timeouts). A settled job sleeps ``LOOP_SETTLED_S``, the cadence of the
    heartbeat check: each pass walks every worker, and at every ``LOOP_BUSY_S`` took ~4% of
    a core that a 2-worker job's training needs (docs/benchmarks.md).

    A wake's pass applies what woke it, and leaves the job unsettled if anything follows
    within tenths of a second, so a settled job sleeps ``LOOP_SETTLED_S`` even right after
    a wake. (Half a second of ``LOOP_BUSY_S`` after every wake, as before, ran ~25 more
    passes around each planned change, ~8 ms of the coordinator's CPU per change, taken
    from the members' first step on two busy cores: ``docs/benchmarks.md``.)"""
    if not settled:
        return LOOP_BUSY_S, "a change is in motion"
    return LOOP_SETTLED_S, "settled"


# -- the coordinator's own pauses ----------------------------------------------------------------
def clocks_restart(*, gap_s: float, not_running_s: float) -> bool:
    """The coordinator did not run for ``gap_s`` between two checks (stopped, starved, its
    VM suspended): it could not read heartbeats meanwhile, so every silence and grace clock
    restarts instead of condemning workers that trained on. Only a gap longer than
    ``not_running_s``: an ordinary pass interval never resets a hung worker's clock."""
    return gap_s > not_running_s
