"""Scaling policies by name. A policy maps the job's measurements to a target count."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Measurements:
    step: int
    world_size: int
    target: int
    min_workers: int
    max_workers: int


@dataclass(frozen=True, kw_only=True)
class Decision:
    target: int
    reason: str


Policy = Callable[[Measurements], Decision]


def static(m: Measurements) -> Decision:
    """Keep what was asked (by --workers, --schedule or ``tidal scale``)."""
    return Decision(target=m.target, reason="static policy keeps the requested count")


_POLICIES: dict[str, Policy] = {"static": static}


def known_policies() -> list[str]:
    return sorted(_POLICIES)


def get_policy(name: str) -> Policy:
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(known_policies())}"
        ) from None
