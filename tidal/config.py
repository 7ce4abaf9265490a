"""Typed, validated job configuration: what ``tidal run`` was asked to do."""

from __future__ import annotations

import re
import sys
from dataclasses import asdict, dataclass, field

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


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
    python: str = sys.executable

    def __post_init__(self) -> None:
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
