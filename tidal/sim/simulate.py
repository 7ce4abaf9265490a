"""Replay a capacity trace through a scaling policy against a job model: pure Python.

Event-driven: between two events the world size, the price and hence the progress rate and
the spend rate are constant, so each interval is one multiplication, whatever the worker
count. Events are trace rows, the end of a rescale pause, the job's completion and policy
checks. A policy is asked every ``check_every_s`` at first; each answer that changes
nothing doubles the wait up to ``max_check_every_s``; a trace row or a change resets it.

The world size is ``min(target, capacity)``. The job's first ``startup_s`` (its workers
starting) are paid and train nothing. Every change of the world size (the policy's,
or a capacity drop or return) stalls training for the job's rescale pause; workers are paid
for from the moment they are in the world, pauses included. The policy sees exactly what
the coordinator would measure (``Measurements``): samples/s and the compute/communication
split per size trained at, the measured pause once one happened, price, capacity, spend,
and the market's history (``policy.market``): the trace up to now, from ``HISTORY_S``
before the job's start. Nothing after now: a policy cannot see the future.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tidal.policy.inputs import Decision, Measurements, PolicyParams, SizeStats
from tidal.policy.market import MarketTracker
from tidal.policy.registry import get_policy, static
from tidal.sim.job import JobModel
from tidal.sim.trace import Trace

STATIC_ALIASES = ("static-min", "static-max")
HISTORY_S = 7 * 86400.0  # how much of the trace before the job's start its policy sees


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Bounds and knobs of one run. ``workers``: the initial target (default
    ``workers_min``). ``start_s``: when in the trace the job starts. ``max_sim_s``: give up
    (``completed`` False) after this much simulated time (default the trace's length
    plus a year)."""

    workers_min: int = 1
    workers_max: int
    workers: int | None = None
    params: PolicyParams = field(default_factory=PolicyParams)
    check_every_s: float = 30.0
    max_check_every_s: float = 900.0
    max_sim_s: float | None = None
    start_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"--start must be a duration >= 0, got {self.start_s} s")
        if not 1 <= self.workers_min <= self.workers_max:
            raise ValueError(
                f"need 1 <= --workers-min <= --workers-max, got {self.workers_min} and "
                f"{self.workers_max}"
            )
        if self.workers is not None and not self.workers_min <= self.workers <= self.workers_max:
            raise ValueError(
                f"--workers {self.workers} is outside [{self.workers_min}, {self.workers_max}]"
            )
        if not 0 < self.check_every_s <= self.max_check_every_s:
            raise ValueError("need 0 < check_every_s <= max_check_every_s")


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """One run's outcome. ``completion_s`` is None when the job did not finish."""

    policy: str
    completed: bool
    completion_s: float | None
    cost: float
    cost_per_sample: float | None
    worker_hours: float
    samples: float
    mean_workers: float
    peak_workers: int
    rescales: int
    decisions: int
    deadline_s: float | None = None
    budget: float | None = None
    vs_oracle: float | None = None
    oracle: dict | None = None
    log: tuple[tuple[float, int, str], ...] = ()

    def to_dict(self, with_log: bool = False) -> dict:
        out = asdict(self)
        if not with_log:
            out.pop("log")
        else:
            out["log"] = [{"time_s": t, "target": n, "reason": r} for t, n, r in self.log]
        return out


def simulate(job: JobModel, trace: Trace, policy: str, config: SimConfig) -> SimResult:
    """Run ``job`` under ``policy`` (a registered name, or ``static-min``/``static-max``:
    the static policy at ``workers_min``/``workers_max``) over ``trace``."""
    if policy == "static-min":
        decide, target = static, config.workers_min
    elif policy == "static-max":
        decide, target = static, config.workers_max
    else:
        decide = get_policy(policy)
        target = config.workers if config.workers is not None else config.workers_min
    limits = decide is not static
    return run(job, trace, decide, target, config, label=policy, limits=limits)


def run(
    job: JobModel,
    trace: Trace,
    decide: Callable[[Measurements], Decision] | None,
    target: int,
    config: SimConfig,
    *,
    label: str,
    limits: bool = True,
    plan: Callable[[float], int] | None = None,
) -> SimResult:
    """Run ``job`` from the target ``target`` under the policy function ``decide``, or
    the scripted ``plan`` (the target as a function of the seconds since the start);
    ``limits``: the result carries the deadline and budget of ``config.params``."""
    params = config.params
    asks = decide is not None and decide is not static and plan is None
    start = config.start_s
    if config.max_sim_s is not None:
        horizon = start + config.max_sim_s
    else:
        horizon = max(start, trace.duration_s) + 365 * 86400
    total = float(job.total_steps)
    steps_done, t, cost, worker_s = 0.0, start, 0.0, 0.0
    world, peak, rescales = 0, 0, 0
    pause_until, last_change = start + job.startup_s, None  # the start-up: paid, no steps
    next_check, interval = start, config.check_every_s
    trained = _Trained(job)
    log: list[tuple[float, int, str]] = []
    idx = trace.index_at(start)
    points = trace.points
    market = MarketTracker()
    for row in points[trace.index_at(start - HISTORY_S) : idx]:  # the market's past
        market.observe(
            max(row.time_s, start - HISTORY_S) - start, row.price_per_worker_hour, row.capacity
        )
    while steps_done < total:
        row = points[idx]
        if t >= next_check:
            if plan is not None:
                new, why = plan(t - start), "scripted"
            elif asks:
                market.observe(t - start, row.price_per_worker_hour, row.capacity)
                decision = decide(
                    Measurements(
                        step=int(steps_done),
                        world_size=world,
                        target=target,
                        min_workers=config.workers_min,
                        max_workers=config.workers_max,
                        stats=trained.stats(world),
                        rescale_pause_s=job.rescale_pause_s if rescales else None,
                        price_per_worker_hour=row.price_per_worker_hour,
                        capacity=row.capacity,
                        max_steps=job.total_steps,
                        elapsed_s=t - start,
                        spent=cost,
                        since_change_s=None if last_change is None else t - last_change,
                        market=market.summary(),
                        params=params,
                    )
                )
                new, why = decision.target, decision.reason
            else:
                new, why = target, ""
            if new != target:
                target, last_change = new, t
                log.append((t, target, why))
                interval = config.check_every_s
            else:
                interval = min(2 * interval, config.max_check_every_s)
            next_check = t + interval
        want = min(target, row.capacity)
        if want != world:
            if want > 0 and (world > 0 or t > start):
                pause_until = t + job.rescale_pause_s
                rescales += 1
            world = want
            peak = max(peak, world)
            interval = config.check_every_s
            next_check = min(next_check, t + interval)
        t_row = points[idx + 1].time_s if idx + 1 < len(points) else math.inf
        if world == 0 and t_row == math.inf:
            break  # no capacity for ever: the job cannot finish
        t_next = min(t_row, next_check)
        paused = pause_until > t
        if paused:
            t_next = min(t_next, pause_until)
        elif world > 0:
            step_s = job.step_s(world)
            t_next = min(t_next, t + (total - steps_done) * step_s)
        if t_next > horizon:
            break
        dt = t_next - t
        cost += world * row.price_per_worker_hour * dt / 3600.0
        worker_s += world * dt
        if world > 0 and not paused:
            done = min(total - steps_done, dt / step_s)
            steps_done = total if total - steps_done - done < 1e-9 else steps_done + done
            trained.add(world, done)
        t = t_next
        while idx + 1 < len(points) and points[idx + 1].time_s <= t:
            idx += 1
            interval = config.check_every_s
            next_check = t
    completed = steps_done >= total
    samples = steps_done * job.global_batch
    return SimResult(
        policy=label,
        completed=completed,
        completion_s=t - start if completed else None,
        cost=cost,
        cost_per_sample=cost / samples if samples > 0 else None,
        worker_hours=worker_s / 3600.0,
        samples=samples,
        mean_workers=worker_s / (t - start) if t > start else 0.0,
        peak_workers=peak,
        rescales=rescales,
        decisions=len(log),
        deadline_s=params.deadline_s if limits else None,
        budget=params.budget if limits else None,
        log=tuple(log),
    )


class _Trained:
    """Steps trained per world size, and what the coordinator would report: the
    ``SizeStats`` of at most ``REPORTED`` sizes, the current one and the most trained
    (capacity churn at thousands of workers trains thousands of sizes)."""

    REPORTED = 16

    def __init__(self, job: JobModel) -> None:
        self.job = job
        self.steps: dict[int, float] = {}
        self.dirty: set[int] = set()
        self.report: dict[int, SizeStats] = {}
        self.cached: tuple[SizeStats, ...] = ()

    def add(self, size: int, steps: float) -> None:
        self.steps[size] = self.steps.get(size, 0.0) + steps
        self.dirty.add(size)

    def stats(self, current: int) -> tuple[SizeStats, ...]:
        if not self.dirty:
            return self.cached
        for n in self.dirty:
            steps = int(self.steps[n])
            old = self.report.get(n)
            if steps < 1 or (old is not None and old.steps == steps):
                continue
            if old is None and len(self.report) >= self.REPORTED and n != current:
                least = min(self.report.values(), key=lambda s: s.steps)
                if least.steps >= steps:
                    continue
            job = self.job
            self.report[n] = SizeStats(
                world_size=n,
                samples_per_s=job.samples_per_s(n),
                samples=steps * job.global_batch,
                steps=steps,
                compute_s=job.compute_s(n),
                comm_s=job.comm_s(n),
            )
            while len(self.report) > self.REPORTED:
                drop = min(
                    (s for s in self.report.values() if s.world_size != current),
                    key=lambda s: s.steps,
                )
                del self.report[drop.world_size]
        self.dirty.clear()
        self.cached = tuple(self.report.values())
        return self.cached
