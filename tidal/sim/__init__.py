"""The simulator: capacity traces replayed through the policies against a job model (pure).

``trace`` parses capacity traces, ``job`` holds the job model and its presets, ``simulate``
runs one policy (``simulate``), ``oracle`` the hindsight optimum, ``compare`` all of them.
"""

from tidal.sim.compare import COMPARE_POLICIES, DEADLINE_FACTOR, compare, oracle
from tidal.sim.job import DEFAULT_JOB, PRESETS, JobModel, get_job
from tidal.sim.simulate import SimConfig, SimResult, run, simulate
from tidal.sim.trace import Trace, TracePoint, load_trace, parse_trace

__all__ = [
    "COMPARE_POLICIES",
    "DEADLINE_FACTOR",
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
    "oracle",
    "parse_trace",
    "run",
    "simulate",
]
