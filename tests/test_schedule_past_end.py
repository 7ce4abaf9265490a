"""``--schedule`` entries at or past the job's last step start no spares (issue 50).

Before: a scheduled scale-up past ``--max-steps`` (the script's ``Trainer.run(max_steps)``)
kept its spares started, registered and billed for the whole job, for a change that never
comes. Now, once the first worker registers the job's length, such entries are ignored for
spares (``policy.schedule.future_peak``) and one event says so; the spares started before the
length was known are retired. The rule's table is in ``test_reconcile.py``;
``docs/decisions/schedule-past-the-end.md`` says why a warning and not a refusal.
"""

from __future__ import annotations

import pytest
from e2e_helpers import Home, event_messages, summarize


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_spares_for_a_schedule_entry_past_the_end_are_retired(tidal_home: Home) -> None:
    job = tidal_home.start(
        "past",
        "--workers",
        "1",
        "--max-workers",
        "3",
        "--schedule",
        "500000:3",
        script_args=["--max-steps", "100000"],  # never reached: the test stops it
    )

    def spares_gone(s: dict) -> bool:  # whichever registered first is the member
        states = sorted(w["state"] for w in s["workers"])
        return s["step"] > 0 and states == ["exited", "exited", "running"]

    status = job.wait_for(spares_gone, timeout=90, what="the spares retired while it trains")
    assert (
        event_messages(status, "scale").count(
            "--schedule entry 500000:3 is at or past the job's last step (Trainer.run(100000)): "
            "ignored"
        )
        == 1
    ), summarize(status)
    assert job.stop().returncode == 0
    status = job.wait_state("stopped", "failed", "succeeded", timeout=60)
    assert status["state"] == "stopped", summarize(status)
    assert not event_messages(status, "failure"), summarize(status)
    tidal_home.assert_no_processes(timeout=20)
