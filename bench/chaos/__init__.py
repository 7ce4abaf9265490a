"""The chaos campaign (issue 15): real jobs, seeded random faults, and checks after each
trial. ``python -m bench.chaos --help``; see ``__main__``, ``kinds`` and ``trial``.

The trials reuse the end-to-end tests' helpers (``tests/e2e_helpers.py``: the home, the
in-process status poll, the process marker and the cleanup), so ``tests`` goes on the path.
"""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[2] / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
