"""Typed, validated job configuration: what ``tidal run`` was asked to do."""

from __future__ import annotations

import math
import re
import sys
from dataclasses import asdict, dataclass, field, fields

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# The largest number of seconds a setting may hold (~31 years): ``timedelta`` overflows
# beyond about 8.6e13, and nobody waits longer.
MAX_SECONDS = 1e9
# The largest amount of dollars (a price per worker-hour, a budget).
MAX_DOLLARS = 1e12

# Every float field of the specs: (its flag, its rule, its upper bound). Rules: ``>0``
# positive, ``>=0`` at least 0. ``check_numbers`` refuses a float field missing here.
_NUMBER_RULES: dict[str, tuple[str, str, float]] = {
    "heartbeat_interval_s": ("the heartbeat interval", ">0", MAX_SECONDS),
    "heartbeat_timeout_s": ("--heartbeat-timeout", ">0", MAX_SECONDS),
    "collective_timeout_s": ("--collective-timeout", ">0", MAX_SECONDS),
    "orphan_timeout_s": ("--orphan-timeout", ">0", MAX_SECONDS),
    "start_timeout_s": ("the start timeout", ">0", MAX_SECONDS),
    "checkpoint_interval_s": ("--checkpoint-interval", ">0", MAX_SECONDS),
    "price_per_worker_hour": ("--price", ">=0", MAX_DOLLARS),
    "min_efficiency": ("--min-efficiency", ">0", 1.0),
    "deadline_s": ("--deadline", ">0", MAX_SECONDS),
    "budget": ("--budget", ">0", MAX_DOLLARS),
    "decision_interval_s": ("--decision-interval", ">=0", MAX_SECONDS),
    "worker_cpus": ("--worker-cpus", ">0", 1e6),
    "worker_gpus": ("--worker-gpus", ">=0", 1e6),
}


def check_numbers(spec: object) -> None:
    """Refuse, with the flag to fix, any float field of ``spec`` (a dataclass) that is not a
    finite number within its rule: NaN would pass every comparison (a NaN heartbeat timeout
    never expires), infinity overflows timers."""
    for f in fields(spec):
        if "float" not in str(f.type):
            continue
        flag, rule, upper = _NUMBER_RULES[f.name]
        value = getattr(spec, f.name)
        if value is None and "None" in str(f.type):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{flag} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{flag} must be a finite number, got {value}")
        if rule == ">0" and value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
        if rule == ">=0" and value < 0:
            raise ValueError(f"{flag} must be at least 0, got {value}")
        if value > upper:
            raise ValueError(f"{flag} must be at most {upper:g}, got {value:g}")


def parse_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """``"50:3,120:1"`` -> ``((50, 3), (120, 1))``: at step 50 the target becomes 3, ..."""
    entries = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        step, sep, count = part.partition(":")
        if not sep or not step.strip().isdigit() or not count.strip().isdigit():
            raise ValueError(
                f"bad --schedule entry {part!r}: write STEP:WORKERS pairs, e.g. 50:3,120:1"
            )
        entries.append((int(step), int(count)))
    steps = [s for s, _ in entries]
    if steps != sorted(set(steps)):
        raise ValueError(f"--schedule steps must be strictly increasing, got {steps}")
    return tuple(entries)


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Where workers run on a cluster backend (``ray``): the cluster's address and what each
    worker asks the cluster for. The local backend ignores it."""

    address: str = (
        "auto"  # "auto": the running cluster this machine belongs to; "local": a private one
    )
    worker_cpus: float = 1.0
    worker_gpus: float = 0.0

    def __post_init__(self) -> None:
        check_numbers(self)
        if self.worker_cpus <= 0:
            raise ValueError(f"--worker-cpus must be positive, got {self.worker_cpus}")
        if self.worker_gpus < 0:
            raise ValueError(f"--worker-gpus must be at least 0, got {self.worker_gpus}")
        if not self.address.strip():
            raise ValueError("--ray-address must be 'auto', 'local' or HOST:PORT")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One job. Invariants: 1 <= min_workers <= workers <= max_workers, every scheduled
    count within [min_workers, max_workers]."""

    name: str
    script: str
    script_args: list[str] = field(default_factory=list)
    workers: int = 1
    min_workers: int = 1
    max_workers: int = 1
    backend: str = "local"
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    policy: str = "static"
    schedule: tuple[tuple[int, int], ...] = ()
    # 0.1 s: a member learns of a new generation within it (training goes on meanwhile, so it
    # is no pause); at 0.05 s the heartbeats took ~3% of a core in the coordinator alone.
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 10.0
    collective_timeout_s: float = 120.0
    start_timeout_s: float = 120.0
    # How long a worker trains on without reaching any coordinator before it exits: its
    # coordinator is restarted by its supervisor within a second or two, or re-attached by
    # ``tidal attach`` (``WorkerConfig.orphan_timeout_s``).
    orphan_timeout_s: float = 600.0
    max_restarts: int = 3
    checkpoint_every: int | None = None
    checkpoint_interval_s: float | None = None
    keep_checkpoints: int = 3
    price_per_worker_hour: float = 0.0
    capacity_trace: str | None = None
    min_efficiency: float = 0.7
    deadline_s: float | None = None
    budget: float | None = None
    decision_interval_s: float = 30.0
    # Local backend: allow more workers per core than ``backends.local.WORKERS_PER_CORE``.
    oversubscribe: bool = False
    python: str = sys.executable

    def __post_init__(self) -> None:
        check_numbers(self)
        if not NAME_RE.match(self.name):
            raise ValueError(
                f"bad job name {self.name!r}: use letters, digits, '.', '_' or '-' (at most 64)"
            )
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.min_workers < 1:
            raise ValueError(f"--min-workers must be at least 1, got {self.min_workers}")
        if not self.min_workers <= self.workers <= self.max_workers:
            raise ValueError(
                f"need --min-workers <= --workers <= --max-workers, got "
                f"{self.min_workers} <= {self.workers} <= {self.max_workers}"
            )
        for step, count in self.schedule:
            if not self.min_workers <= count <= self.max_workers:
                raise ValueError(
                    f"--schedule asks for {count} workers at step {step}, outside "
                    f"[{self.min_workers}, {self.max_workers}]: raise --max-workers"
                )
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("--heartbeat-timeout must be longer than the heartbeat interval")
        if self.collective_timeout_s <= self.heartbeat_timeout_s:
            raise ValueError(
                "--collective-timeout must be longer than --heartbeat-timeout: a hung peer is "
                "found by its missed heartbeats before a collective gives up on it"
            )
        if self.orphan_timeout_s <= self.heartbeat_timeout_s:
            raise ValueError(
                "--orphan-timeout must be longer than --heartbeat-timeout: a worker waits out "
                "a coordinator's restart before it gives up on the job"
            )
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(
                f"--checkpoint-every must be at least 1 step, got {self.checkpoint_every}"
            )
        if self.checkpoint_interval_s is not None and self.checkpoint_interval_s <= 0:
            raise ValueError(
                f"--checkpoint-interval must be positive seconds, got {self.checkpoint_interval_s}"
            )
        if self.keep_checkpoints < 1:
            raise ValueError(f"--keep-checkpoints must be at least 1, got {self.keep_checkpoints}")
        if self.price_per_worker_hour < 0:
            raise ValueError(f"--price must be at least 0, got {self.price_per_worker_hour}")
        if not 0 < self.min_efficiency <= 1:
            raise ValueError(f"--min-efficiency must be in (0, 1], got {self.min_efficiency}")
        if self.decision_interval_s < 0:
            raise ValueError(
                f"--decision-interval must be at least 0 s, got {self.decision_interval_s}"
            )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be at least 0, got {self.max_restarts}")

    @property
    def checkpoints(self) -> bool:
        return self.checkpoint_every is not None or self.checkpoint_interval_s is not None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> JobSpec:
        data = dict(data)
        data["schedule"] = tuple(tuple(e) for e in data.get("schedule", ()))
        data["cluster"] = ClusterSpec(**data.get("cluster", {}))
        return cls(**data)
