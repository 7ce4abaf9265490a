"""What the coordinator measures for the scaling policy, and what the job costs.

``observe`` is called from the control loop. Training throughput is attributed to a world
size only over intervals in which that size trained without a membership change (pauses
excluded), so a policy compares sizes on what they really did. Cost accrues for every live
worker process, warm standbys and starting ones included: they are paid for too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tidal.policy.inputs import Measurements, PolicyParams, SizeStats
from tidal.sim.trace import Trace


@dataclass
class _Size:
    steps: int = 0
    seconds: float = 0.0
    compute_s: float | None = None  # rank 0's mean per-step split, last reported
    comm_s: float | None = None


class Accounting:
    def __init__(self, *, price: float, trace: Trace | None, params: PolicyParams) -> None:
        self.base_price = price
        self.trace = trace
        self.params = params
        self.started = time.monotonic()
        self.spent = 0.0
        self.worker_seconds = 0.0
        self._sizes: dict[int, _Size] = {}
        # time, step, world size, generation, and whether the interval since counts
        self._last: tuple[float, int, int, int, bool] | None = None
        self._cost_time: float | None = None

    def elapsed(self, now: float | None = None) -> float:
        return (now if now is not None else time.monotonic()) - self.started

    def price(self, now: float | None = None) -> float:
        if self.trace is not None:
            return self.trace.at(self.elapsed(now)).price_per_worker_hour
        return self.base_price

    def capacity(self, now: float | None = None) -> int | None:
        return self.trace.at(self.elapsed(now)).capacity if self.trace is not None else None

    def observe(
        self, *, now: float, step: int, world_size: int, generation: int, live: int
    ) -> None:
        if self._cost_time is not None:
            dt = now - self._cost_time
            self.spent += live * self.price(now) * dt / 3600
            self.worker_seconds += live * dt
        self._cost_time = now
        last = self._last
        if last is None or (last[2], last[3]) != (world_size, generation):
            # A new membership: the first step reported after it ends the pause; rates are
            # measured from there.
            self._last = (now, step, world_size, generation, False)
            return
        t0, step0, _, _, measuring = last
        if step <= step0:
            return  # no new step reported yet: the interval keeps growing
        if measuring and world_size > 0:
            size = self._sizes.setdefault(world_size, _Size())
            size.steps += step - step0
            size.seconds += now - t0
        self._last = (now, step, world_size, generation, True)

    def note_split(self, world_size: int, compute_s: float, comm_s: float) -> None:
        """Rank 0's measured step split (compute, exposed communication) at this size."""
        if world_size > 0 and compute_s + comm_s > 0:
            size = self._sizes.setdefault(world_size, _Size())
            size.compute_s, size.comm_s = compute_s, comm_s

    def stats(self, global_batch: int) -> tuple[SizeStats, ...]:
        return tuple(
            SizeStats(
                world_size=w,
                samples_per_s=s.steps * global_batch / s.seconds,
                samples=s.steps * global_batch,
                steps=s.steps,
                compute_s=s.compute_s,
                comm_s=s.comm_s if s.compute_s is not None else None,
            )
            for w, s in sorted(self._sizes.items())
            if s.seconds > 0
        )

    def measurements(
        self,
        *,
        step: int,
        world_size: int,
        target: int,
        min_workers: int,
        max_workers: int,
        global_batch: int | None,
        max_steps: int | None,
        pause_s: float | None,
        since_change_s: float | None,
    ) -> Measurements:
        return Measurements(
            step=step,
            world_size=world_size,
            target=target,
            min_workers=min_workers,
            max_workers=max_workers,
            stats=self.stats(global_batch) if global_batch else (),
            rescale_pause_s=pause_s,
            price_per_worker_hour=self.price(),
            capacity=self.capacity(),
            max_steps=max_steps,
            elapsed_s=self.elapsed(),
            spent=self.spent,
            since_change_s=since_change_s,
            params=self.params,
        )

    def summary(self, *, step: int, global_batch: int | None, max_steps: int | None) -> dict:
        """``cost`` (dollars so far), ``cost_per_1k_samples`` and, when the job's length is
        known, ``projected_cost`` at the current spending rate."""
        out = {"cost": self.spent, "price_per_worker_hour": self.price()}
        samples = step * global_batch if global_batch else 0
        if samples:
            out["cost_per_1k_samples"] = 1000 * self.spent / samples
        if max_steps and step:
            out["projected_cost"] = self.spent * max_steps / step
        return out
