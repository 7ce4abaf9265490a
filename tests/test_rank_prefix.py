"""An uncaught traceback in a worker carries one ``[rankN]:`` prefix, the current
generation's, however many groups the process formed (issue 50, minor: they stacked, one
per generation). A real process forms three one-member gloo groups through
``group.form_group`` and dies of an uncaught exception."""

from __future__ import annotations

import subprocess
import sys

from tidal.worker.membership.rank_prefix import unwrapped

SCRIPT = r"""
import datetime, sys
import torch.distributed as dist
from tidal.protocol import GenerationInfo
from tidal.store_keys import generation_prefix
from tidal.worker.membership import group as grp

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
if sys.argv[1] == "own-hook":  # the script's own hook, set before training: kept
    def mine(*exc, _inner=sys.excepthook):
        print("own hook ran", file=sys.stderr)
        _inner(*exc)
    sys.excepthook = mine
for i in (1, 2, 3):
    info = GenerationInfo(id=i, members=[7], store_prefix=generation_prefix("ns", i), reason="")
    grp.form_group(store, info, 0, namespace="ns", timeout_s=20, connect_s=2)
    if i < 3:
        grp.destroy_group()
raise RuntimeError("boom")
"""


def run(mode: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    return proc.stderr


def test_a_traceback_after_three_generations_has_one_rank_prefix() -> None:
    err = run("plain")
    assert "[rank0]: RuntimeError: boom" in err, err
    assert "[rank0]: [rank0]:" not in err, err


def test_the_scripts_own_excepthook_is_kept() -> None:
    err = run("own-hook")
    assert "[rank0]: own hook ran" in err, err
    assert "[rank0]: RuntimeError: boom" in err and "[rank0]: [rank0]:" not in err, err


def test_a_hook_that_is_not_torchs_is_left_as_it_is() -> None:
    def _distributed_excepthook(*args):  # torch's name, but no old_hook cell
        return args

    assert unwrapped(_distributed_excepthook) is _distributed_excepthook
    assert unwrapped(sys.__excepthook__) is sys.__excepthook__
