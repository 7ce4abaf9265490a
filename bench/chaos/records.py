"""What a trial records: its settings, the events it injected, its result and failure."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


class TrialFailure(Exception):
    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.check, self.detail = check, detail


class JobEnded(Exception):
    """The job reached a terminal state while the trial waited for something else."""


#: The note on an event whose recovery the next fault did not wait for (``checks.pauses``).
OVERLAPPED = "the next fault came before full recovery"


@dataclass
class Settings:
    max_steps: int = 1200
    pace_s: float = 0.03
    heartbeat_timeout_s: float = 3.0
    collective_timeout_s: float = 30.0
    checkpoint_every: int = 25
    recovery_timeout_s: float = 90.0
    train_seed: int = 0
    debug: bool = False  # TIDAL_DEBUG=1 in the jobs: the workers trace their membership


@dataclass
class Event:
    """One fault injection: what was done, when, and the pause it may cost."""

    kind: str
    faults: list[str]
    count: int  # faults it counts for (two at once: 2)
    bound_s: float
    time: float = 0.0
    # The job may fail because of this fault, saying so: a part of its failure message
    # (every member killed: "every worker was lost").
    may_fail: str = ""
    final: bool = False  # no fault follows it: the job runs to its end
    stall_s: float | None = None
    recovered_s: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class TrialResult:
    seed: int
    setup: dict
    events: list[Event]
    seconds: float = 0.0
    failure: TrialFailure | None = None
    pauses: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    state: str = ""  # the job's final state
    status_summary: str = ""
    logs: str = ""
    stacks: str = ""
    leaver_skips: int = 0  # members that left before their last update (``Trial.leaver_skips``)

    @property
    def faults(self) -> int:
        return sum(e.count for e in self.events)

    @property
    def ok(self) -> bool:
        return self.failure is None

    def record(self) -> dict:
        rec = {
            "seed": self.seed,
            "ok": self.ok,
            "seconds": round(self.seconds, 1),
            "setup": self.setup,
            "faults_injected": self.faults,
            "events": [
                {k: v for k, v in asdict(e).items() if v is not None and v != [] and v is not False}
                for e in self.events
            ],
            "pauses": self.pauses,
            "state": self.state,
            "leaver_skips": self.leaver_skips,
        }
        if self.notes:
            rec["notes"] = self.notes
        if self.failure is not None:
            rec |= {
                "check": self.failure.check,
                "why": self.failure.detail,
                "replay": f"python -m bench.chaos --replay {self.seed} "
                f"--faults {self.setup.get('budget')} --kinds {','.join(self.setup.get('kinds', []))}",
                "status": self.status_summary,
                "logs": self.logs,
                **({"stacks": self.stacks} if self.stacks else {}),
            }
        return rec

    @classmethod
    def from_record(cls, rec: dict) -> TrialResult:
        """The result a ``record()`` describes (``--resume``: a campaign's JSON read back)."""
        r = cls(
            seed=rec["seed"],
            setup=rec["setup"],
            events=[Event(**e) for e in rec["events"]],
            seconds=rec["seconds"],
            pauses=rec.get("pauses", []),
            notes=rec.get("notes", []),
            state=rec.get("state", ""),
            leaver_skips=rec.get("leaver_skips", 0),
        )
        if not rec["ok"]:
            r.failure = TrialFailure(rec["check"], rec["why"])
            r.status_summary, r.logs = rec.get("status", ""), rec.get("logs", "")
            r.stacks = rec.get("stacks", "")
        return r
