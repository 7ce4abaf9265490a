"""Scaling policies by name. A policy is a pure function ``Measurements -> Decision``.

``static`` keeps the requested count; ``throughput`` and ``cost`` are described in their
modules and in ``docs/policies.md``. ``Measurements`` and ``Decision`` live in ``inputs``
and are re-exported here, where the coordinator imports them from.
"""

from __future__ import annotations

from collections.abc import Callable

from tidal.policy.cost import cost
from tidal.policy.inputs import Decision, Measurements, PolicyParams, SizeStats
from tidal.policy.throughput import throughput

Policy = Callable[[Measurements], Decision]

__all__ = [
    "Decision",
    "Measurements",
    "Policy",
    "PolicyParams",
    "SizeStats",
    "get_policy",
    "known_policies",
    "static",
]


def static(m: Measurements) -> Decision:
    """Keep what was asked (by --workers, --schedule or ``tidal scale``). The capacity limits
    the world size, not the target: when it comes back, so do the workers."""
    return Decision(target=m.target, reason="static policy keeps the requested count")


_POLICIES: dict[str, Policy] = {"static": static, "throughput": throughput, "cost": cost}


def known_policies() -> list[str]:
    """The registered names: ``static`` (the default) first, then the others sorted."""
    return ["static", *sorted(n for n in _POLICIES if n != "static")]


def get_policy(name: str) -> Policy:
    """The policy called ``name``; a ValueError naming the known ones if there is none."""
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(known_policies())}"
        ) from None
