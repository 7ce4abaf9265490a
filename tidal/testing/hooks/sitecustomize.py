"""Installed at interpreter start in the processes of a job a test armed with faults
(``tidal.testing.fault_env`` puts this folder on ``PYTHONPATH``): a worker (it has a
``TIDAL_WORKER_ID``) gets the fault injector on its probe points. Other processes of the
job (the CLI, the coordinator) import nothing. A test's own ``sitecustomize`` further down
the path, which this one shadows, is run after it."""

import importlib.util
import os
import sys

if os.environ.get("TIDAL_FAULTS") and os.environ.get("TIDAL_WORKER_ID"):
    from tidal.testing.faults import install_from_environ

    install_from_environ()


def _run_next() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    later = [p for p in sys.path if p and os.path.abspath(p) != here]
    for folder in later:
        path = os.path.join(folder, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_tidal_next_sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_run_next()
