"""Decisions as pure functions of measurements: no I/O in this package."""

from tidal.policy.reconcile import Plan, reconcile
from tidal.policy.registry import get_policy, known_policies

__all__ = ["Plan", "get_policy", "known_policies", "reconcile"]
