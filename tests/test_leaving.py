"""The rule for a member that leaves at a change: it skips its last update only when
nobody needs it (``tidal.worker.membership.leaving``). A table, in milliseconds."""

from __future__ import annotations

import pytest

from tidal.worker.membership.leaving import leave_uncommitted

BASE = dict(
    excluded=True,
    at_change=True,
    sharded=False,
    hooks=False,
    checkpoint_due=False,
    stop=False,
    last=False,
)


@pytest.mark.parametrize(
    ("change", "leaves"),
    [
        ({}, True),  # told it is not in the next generation, which follows this step
        ({"excluded": False}, False),  # it stays: its update is the job's
        ({"at_change": False}, False),  # the change is not agreed at this step
        ({"sharded": True}, False),  # its shard's update is the job's
        ({"hooks": True}, False),  # the script's after_step runs at each commit
        ({"checkpoint_due": True}, False),  # it writes this step's checkpoint
        ({"stop": True}, False),  # the job stops here: final state and checkpoint
        ({"last": True}, False),  # the job's last step
    ],
)
def test_leave_uncommitted(change, leaves) -> None:
    why = leave_uncommitted(**{**BASE, **change})
    assert (why is not None) is leaves
    if leaves:
        assert "does not include this member" in why
