"""The simulator: capacity traces replayed through the policies against a job model (pure).

``trace`` parses capacity traces, ``job`` holds the job model and its presets, ``simulate``
runs one policy (``simulate``) or all of them (``compare``).
"""

from tidal.sim.job import DEFAULT_JOB, PRESETS, JobModel, get_job
from tidal.sim.simulate import COMPARE_POLICIES, SimConfig, SimResult, compare, simulate
from tidal.sim.trace import Trace, TracePoint, load_trace, parse_trace

__all__ = [
    "COMPARE_POLICIES",
    "DEFAULT_JOB",
    "PRESETS",
    "JobModel",
    "SimConfig",
    "SimResult",
    "Trace",
    "TracePoint",
    "compare",
    "get_job",
    "load_trace",
    "parse_trace",
    "simulate",
]
