"""What tests and benchmarks use to reach inside real worker processes; never imported by
the library itself.

``fault_env(spec)`` is the environment that arms deterministic faults (``faults``) in the
workers a job starts: the specification, and the ``hooks`` folder on ``PYTHONPATH``, whose
``sitecustomize`` installs the injector on the worker's probe points
(``tidal.worker.probes``) when the interpreter starts.
"""

from __future__ import annotations

import os
from pathlib import Path

HOOKS = Path(__file__).resolve().parent / "hooks"


def fault_env(spec: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables to add to a job's environment so that its workers fire ``spec``
    (``tidal.testing.faults``: ``KIND@worker=W,...`` or ``@PATH``)."""
    base = os.environ if environ is None else environ
    path = [str(HOOKS), *filter(None, base.get("PYTHONPATH", "").split(os.pathsep))]
    return {"TIDAL_FAULTS": spec, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}
