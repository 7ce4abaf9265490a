"""Pacing a job's workers from a test: a ``sitecustomize`` that sleeps in each
``cross_entropy`` as long as a file says (the test writes it: slow while changes happen,
then 0). Only workers (``TIDAL_WORKER_ID`` set) are paced, never the mathematics."""

from __future__ import annotations

import os
from pathlib import Path


def pacing_site(var: str, *, not_for: str | None = None) -> str:
    """The ``sitecustomize`` source: the file is named in ``$var``; ``not_for``: a module
    whose processes (``python -m not_for``) are left alone (a launcher that execs the
    worker at once would import torch for nothing)."""
    skip = f" and {not_for!r} not in sys.orig_argv" if not_for else ""
    return f"""
import os, sys
if os.environ.get("TIDAL_WORKER_ID") is not None and os.environ.get({var!r}){skip}:
    import time
    import torch.nn.functional as F
    _pace, _cross_entropy = os.environ[{var!r}], F.cross_entropy
    def cross_entropy(*args, **kwargs):
        try:
            with open(_pace) as f:
                time.sleep(float(f.read()))
        except (OSError, ValueError):
            pass
        return _cross_entropy(*args, **kwargs)
    F.cross_entropy = cross_entropy
"""


def arm_pacing(
    folder: Path, env: dict[str, str], var: str, *, slow_s: float, not_for: str | None = None
) -> tuple[dict[str, str], Path]:
    """``env`` with the pacing hook first on its ``PYTHONPATH`` and ``$var`` naming the
    pace file, which says ``slow_s`` to start with; (that environment, the pace file)."""
    hooks = folder / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(pacing_site(var, not_for=not_for))
    pace = folder / "pace"
    pace.write_text(str(slow_s))
    path = os.pathsep.join(filter(None, [str(hooks), env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path, var: str(pace)}, pace
