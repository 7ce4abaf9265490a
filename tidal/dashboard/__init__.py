"""The web dashboard: a job list, a live job page (charts, event timeline, workers,
generations, checkpoints) and ``/metrics``.

The coordinator mounts ``dashboard_router`` over a ``LiveSource`` (its own job live, the
rest of its home from SQLite); ``tidal dashboard`` runs a ``DashboardServer`` over a
``HomeSource`` (every job of a home from SQLite, running or finished). The charts read the
history that ``Recorder`` samples from the coordinator's loop (``history.py``). Everything
is read-only; the chart library (plotly.js) comes from the installed ``plotly`` package.
"""

from __future__ import annotations

from tidal.dashboard.app import DashboardServer, dashboard_router, make_home_app
from tidal.dashboard.history import HistoryStore, Recorder
from tidal.dashboard.sources import HomeSource, LiveSource

__all__ = [
    "DashboardServer",
    "HistoryStore",
    "HomeSource",
    "LiveSource",
    "Recorder",
    "dashboard_router",
    "make_home_app",
]
