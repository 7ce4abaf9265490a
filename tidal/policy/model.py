"""Throughput against world size, fitted to measurements: the all-reduce cost model.

With a fixed global batch ``B`` split over ``n`` workers, a step takes

    T(n) = B * c / n  +  comm(n),      comm(1) = 0,
    comm(n) = 2(n-1)/n * bytes / bandwidth + latency      (ring all-reduce)

Divided by ``B`` this is the time per sample ``t(n) = c/n + a * 2(n-1)/n + l`` (``n > 1``),
with ``c`` the compute seconds per sample on one worker and ``a``, ``l`` the bandwidth and
latency terms per sample. Throughput is ``1 / t(n)`` samples/s. Nothing here needs ``B``.

Fitting (``fit``), from the sizes measured so far, weighted by their sample counts:

- with the compute/communication split, ``c`` comes from the compute part of every size and
  ``a``, ``l`` from the communication part of the sizes above 1;
- without it but with size 1 measured, ``c = t(1)`` and the rest of each larger size's time
  is its communication;
- without either, ``t(n) = alpha/n + beta`` over the sizes measured (the only identifiable
  form above 1), read as ``c = alpha + beta``, ``a = beta/2``, ``l = 0``.

Non-negative least squares throughout. With a single size above 1 its communication is
attributed to bandwidth (``l = 0``), which grows with ``n``: the cautious reading. With no
size above 1 (or a single size and no split) nothing is known about communication and the
model assumes perfect scaling (``comm_known`` is False): the optimistic upper bound, which
the policies use only to decide whether exploring is worth a rescale pause.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from tidal.policy.inputs import SizeStats


def ring_factor(n: int) -> float:
    """``2(n-1)/n``: the fraction of the gradient bytes each worker sends in a ring all-reduce."""
    return 2.0 * (n - 1) / n


@dataclass(frozen=True)
class ScalingModel:
    """``seconds_per_sample(n) = c/n + (a * 2(n-1)/n + l if n > 1 else 0)``."""

    c: float
    a: float = 0.0
    l: float = 0.0  # noqa: E741 - the latency term's name in the formula
    comm_known: bool = False
    how: str = ""

    def seconds_per_sample(self, n: int) -> float:
        if n < 1:
            raise ValueError(f"world size must be >= 1, got {n}")
        comm = self.a * ring_factor(n) + self.l if n > 1 else 0.0
        return self.c / n + comm

    def samples_per_s(self, n: int) -> float:
        t = self.seconds_per_sample(n)
        return 1.0 / t if t > 0 else float("inf")


def _nnls(points: list[tuple[float, float, float, float]]) -> tuple[float, float]:
    """Weighted least squares ``y ~ p*u + q*v`` with ``p, q >= 0`` over ``(u, v, y, w)``.

    Candidates are both terms, ``p`` alone, ``q`` alone; the feasible one with the smallest
    residual wins, ties going to that order (a single point fits ``p`` alone exactly)."""
    best: tuple[float, float, float] | None = None  # (residual, p, q)
    tol = 1e-9 * sum(w * y * y for _, _, y, w in points)

    def consider(p: float, q: float) -> None:
        nonlocal best
        if p < 0 or q < 0:
            return
        res = sum(w * (y - p * u - q * v) ** 2 for u, v, y, w in points)
        if best is None or res < best[0] - tol:
            best = (res, p, q)

    suu = svv = suv = suy = svy = 0.0
    for u, v, y, w in points:
        suu += w * u * u
        svv += w * v * v
        suv += w * u * v
        suy += w * u * y
        svy += w * v * y
    det = suu * svv - suv * suv
    if len({(u, v) for u, v, _, _ in points}) >= 2 and abs(det) > 1e-12 * max(suu * svv, 1e-300):
        consider((suy * svv - svy * suv) / det, (svy * suu - suy * suv) / det)
    if suu > 0:
        consider(max(0.0, suy / suu), 0.0)
    if svv > 0:
        consider(0.0, max(0.0, svy / svv))
    return (best[1], best[2]) if best is not None else (0.0, 0.0)


def fit(stats: Iterable[SizeStats]) -> ScalingModel | None:
    """The model fitted to ``stats`` (sizes with no samples are ignored); None if none left.
    Memoised on the (immutable) stats: a control loop asks again and again with the same."""
    return _fit(tuple(stats))


@functools.lru_cache(maxsize=64)
def _fit(stats: tuple[SizeStats, ...]) -> ScalingModel | None:
    pts = [s for s in stats if s.samples > 0 and s.samples_per_s > 0]
    if not pts:
        return None
    w = {s.world_size: float(s.samples) for s in pts}
    t = {s.world_size: 1.0 / s.samples_per_s for s in pts}
    above = [s for s in pts if s.world_size > 1]
    if all(s.has_split for s in pts):
        share = {s.world_size: s.compute_s / (s.compute_s + s.comm_s) for s in pts}
        # compute_per_sample(n) = c / n  ->  weighted least squares in 1/n
        num = sum(w[n] * t[n] * share[n] / n for n in t)
        den = sum(w[n] / (n * n) for n in t)
        c = num / den
        comm = [(n, t[n] * (1 - share[n])) for n in (s.world_size for s in above)]
        how = "fitted to the measured compute/communication split"
    elif 1 in t:
        c = t[1]
        comm = [(s.world_size, t[s.world_size] - c / s.world_size) for s in above]
        how = "fitted to step times with size 1 as the compute baseline"
    else:
        if len(pts) == 1:
            (s,) = pts
            return ScalingModel(
                c=t[s.world_size] * s.world_size,
                how=f"perfect-scaling guess from size {s.world_size} alone",
            )
        alpha, beta = _nnls([(1.0 / n, 1.0, t[n], w[n]) for n in t])
        return ScalingModel(
            c=alpha + beta,
            a=beta / 2,
            comm_known=True,
            how="fitted to step times as alpha/n + beta",
        )
    if not comm:
        return ScalingModel(c=c, how=how + "; no communication measured yet (perfect scaling)")
    a, lat = _nnls([(ring_factor(n), 1.0, y, w[n]) for n, y in comm])
    return ScalingModel(c=c, a=a, l=lat, comm_known=True, how=how)
