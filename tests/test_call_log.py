"""``e2e_helpers.call_log``: a test's hook runs in the processes a job starts, and a hook
that fails to import there is reported, not skipped (Python alone would print "Error in
sitecustomize" into a worker's log and run on without it: a test that then checks less
than it says passes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import call_log, hook_errors

SITE = """
import os
with open(os.environ["CALL_LOG_TEST"], "a") as f:
    f.write("armed\\n")
"""


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_hook_runs_in_a_process_the_test_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = call_log(tmp_path, monkeypatch, SITE, "CALL_LOG_TEST")
    assert _python("pass").returncode == 0
    assert log.read_text() == "armed\n"
    assert hook_errors(tmp_path) == ""


def test_a_hook_that_fails_to_import_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    call_log(tmp_path, monkeypatch, "from tidal.worker.nowhere import Gone\n", "CALL_LOG_TEST")
    proc = _python("print('ran on')")
    assert proc.stdout.strip() == "ran on"  # the process itself runs on, as Python does ...
    errors = hook_errors(tmp_path)  # ... but the test's fixture sees why the hook did not
    assert "ModuleNotFoundError" in errors and "tidal.worker.nowhere" in errors, errors
