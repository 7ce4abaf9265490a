"""Installed at interpreter start in the processes of a job a test armed with faults
(``tidal.testing.fault_env`` puts this folder on ``PYTHONPATH``): a worker (it has a
``TIDAL_WORKER_ID``) gets the fault injector on its probe points. Other processes of the
job (the CLI, the coordinator) import nothing."""

import os

if os.environ.get("TIDAL_FAULTS") and os.environ.get("TIDAL_WORKER_ID"):
    from tidal.testing.faults import install_from_environ

    install_from_environ()
