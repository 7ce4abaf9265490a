"""How a worker's calls to the coordinator retry, and what a refused heartbeat keeps: pure.

- ``backoff_s``: the wait before retry ``attempt`` of a call through a coordinator outage:
  capped exponential with jitter (the first retries come fast, since a coordinator restarted
  by its supervisor answers within ~0.5 s; hundreds of workers retrying for minutes neither
  hammer it at a fixed beat nor come back all at once).
- ``after_refusal``: a heartbeat the coordinator refused (a 4xx: sent again it would be
  refused again) is not dropped whole. What the script put in it (metrics, per-step
  records) is the likely cause and is dropped, saying so; what Tidal itself put in it (step
  reports, checkpoint records and failures) is kept for the next heartbeat. A heartbeat
  refused with only Tidal's records in it drops them, naming each checkpoint lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal import backoff
from tidal.protocol import HeartbeatRequest

#: ``backoff_s``'s first wait and its cap, in seconds.
BASE_S, CAP_S = 0.05, 1.0


def backoff_s(attempt: int, draw: float) -> float:
    """The wait before retry ``attempt`` (0 for the first), ``draw`` uniform in [0, 1):
    ``backoff.capped`` from ``BASE_S`` to ``CAP_S``."""
    return backoff.capped(attempt, base_s=BASE_S, cap_s=CAP_S, draw=draw)


@dataclass(frozen=True, kw_only=True)
class Refused:
    """What a refused heartbeat carried, by kind: counts of the script's records and the
    steps (and paths) of Tidal's own."""

    metrics: int
    step_records: int
    reports: int
    checkpoints: list[tuple[int, str]]
    checkpoint_failures: int

    @classmethod
    def of(cls, req: HeartbeatRequest) -> Refused:
        return cls(
            metrics=len(req.metrics),
            step_records=len(req.step_metrics),
            reports=len(req.reports) + len(req.departures),  # both Tidal's step reports
            checkpoints=[(c.step, c.path) for c in req.checkpoints],
            checkpoint_failures=len(req.checkpoint_failures),
        )


@dataclass(frozen=True, kw_only=True)
class AfterRefusal:
    keep_own: bool  # Tidal's own records go again with the next heartbeat
    dropped: str | None  # what was dropped, in words (None: nothing)


def after_refusal(r: Refused) -> AfterRefusal:
    """What to keep of a refused heartbeat (module doc)."""
    own = r.reports + len(r.checkpoints) + r.checkpoint_failures
    if r.metrics or r.step_records:
        return AfterRefusal(
            keep_own=True,
            dropped=(
                f"dropped the {r.metrics} metrics and {r.step_records} per-step records it "
                "carried" + ("; its reports and checkpoint records go again" if own else "")
            ),
        )
    if not own:
        return AfterRefusal(keep_own=False, dropped=None)
    lost = ", ".join(f"step {s} ({p})" for s, p in r.checkpoints) or "none"
    return AfterRefusal(
        keep_own=False,
        dropped=(
            f"it carried only Tidal's own records: dropped {r.reports} step reports, "
            f"{r.checkpoint_failures} checkpoint failures and the records of checkpoints "
            f"{lost} (the files stay on disk)"
        ),
    )
