"""Decisions as pure functions of measurements: no I/O in this package."""

from tidal.policy.inputs import Decision, Measurements, PolicyParams, SizeStats, parse_duration
from tidal.policy.reconcile import Plan, reconcile
from tidal.policy.registry import get_policy, known_policies

__all__ = [
    "Decision",
    "Measurements",
    "Plan",
    "PolicyParams",
    "SizeStats",
    "get_policy",
    "known_policies",
    "parse_duration",
    "reconcile",
]
