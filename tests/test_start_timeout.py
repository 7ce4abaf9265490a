"""``--start-timeout`` takes effect (issue 50): a job whose first generation has not formed
within it fails with one line naming the flag, through the real CLI. The flag's parsing and
validation are in ``test_config.py``; the rule's table in ``test_rules.py``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2e_helpers import Home

# Its Trainer would come long after any start timeout a test waits for.
SLOW_START = """
import time
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_short_start_timeout_fails_the_job_in_one_line(tidal_home: Home, tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text(SLOW_START)
    began = time.monotonic()
    proc, _ = tidal_home.run("slow", "--start-timeout", "2", script=script, timeout=45)
    took = time.monotonic() - began
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tidal: error:")]
    assert errors == [
        "tidal: error: job slow failed: no generation formed within 2 s (--start-timeout); "
        "see the worker logs"
    ], proc.stderr
    assert took < 30, took  # not the default 120 s
    tidal_home.assert_no_processes(timeout=20)
