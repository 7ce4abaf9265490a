"""Table tests of the early-stop rules (``tidal.coordinator.rules.stop_rules``) and of the
worker's final-checkpoint writer rule (``tidal.worker.trainer.stopping.writes_final``)."""

from __future__ import annotations

import pytest

from tidal.coordinator.job import ScriptStop
from tidal.coordinator.rules.stop_rules import MemberExit, accept_stop, stop_outcome
from tidal.coordinator.rules.verdicts import Act
from tidal.protocol import StopAnswer
from tidal.worker.trainer.stopping import writes_final

STOP = ScriptStop(worker_id=1, step=51, generation=1, members=(0, 1))


def _accept(**kw):
    base = dict(
        worker_id=1,
        step=51,
        generation=1,
        writes=True,
        members=(0, 1),
        current={0, 1},
        recorded=None,
        decided=False,
    )
    return accept_stop(**(base | kw))


@pytest.mark.parametrize(
    "kw, recorded, step, writer, event",
    [
        ({}, True, 51, True, "worker 1's script stopped the job at step 51"),
        ({"writes": False}, True, 51, False, "stopped the job at step 51"),  # fsdp
        # a second report (another member, or a retried call) is told the same stop
        ({"worker_id": 0, "step": 50, "recorded": STOP}, False, 51, False, None),
        ({"recorded": STOP}, False, 51, True, None),
        # the outcome is decided or a tidal stop is pending: the usual end applies
        ({"decided": True}, False, None, False, None),
        # no member of the current generation: ignored, said so
        ({"worker_id": 5, "current": {0, 1}}, False, None, False, "ignored"),
    ],
)
def test_accept_stop(kw, recorded, step, writer, event) -> None:
    v = _accept(**kw)
    assert (v.record is not None) is recorded
    assert v.step == step and v.writer is writer
    if event is None:
        assert v.event is None
    else:
        assert event in v.event
    if recorded:
        assert v.record.worker_id == kw.get("worker_id", 1) and v.record.members == (0, 1)


RUNNING = "running"


def _exits(*codes, killed=()):
    """One member per code; ``RUNNING``: still running; None: ended, its code unknown."""
    return {
        i: MemberExit(
            running=c == RUNNING,
            code=None if c == RUNNING else c,
            killed=i in killed,
            detail="Boom",
        )
        for i, c in enumerate(codes)
    }


@pytest.mark.parametrize(
    "exits, checkpoints, written, error, action, words",
    [
        (_exits(RUNNING, 0), False, False, None, Act.WAIT, ""),  # a member still running
        (_exits(0, 0), False, False, None, Act.SUCCEED, "stopped the job at step 51"),
        (_exits(0, 0), True, True, None, Act.SUCCEED, "final checkpoint written"),
        (_exits(0, 0), True, False, None, Act.FAIL, "was not written"),
        (_exits(RUNNING, 0), True, False, "disk full", Act.FAIL, "disk full"),
        (_exits(0, RUNNING), True, True, None, Act.WAIT, ""),
        # a script that raised (a raise closes the loop as a break does): the job fails
        (_exits(0, 1), True, True, None, Act.FAIL, "worker 1 then exited with code 1: Boom"),
        (_exits(RUNNING, 1), False, False, None, Act.FAIL, "exited with code 1"),
        # killed by the coordinator (outstayed its grace), or lost to a signal: not failed
        (_exits(0, 1, killed=(1,)), False, False, None, Act.SUCCEED, ""),
        (_exits(-9, 0), True, True, None, Act.SUCCEED, ""),
        (_exits(None, 0), True, True, None, Act.SUCCEED, ""),  # ended, its code unknown: lost
    ],
)
def test_stop_outcome(exits, checkpoints, written, error, action, words) -> None:
    got = stop_outcome(
        stop=STOP, exits=exits, checkpoints=checkpoints, written=written, error=error
    )
    assert got.act is action and words in got.why


def test_stop_outcome_under_fsdp_needs_no_checkpoint() -> None:
    stop = ScriptStop(worker_id=1, step=51, generation=1, members=(0, 1), checkpoint=False)
    got = stop_outcome(stop=stop, exits=_exits(0, 0), checkpoints=True, written=False, error=None)
    assert got.act is Act.SUCCEED and "no final checkpoint" in got.why


@pytest.mark.parametrize(
    "finished, rank, sharded, answer, stop_step, writes",
    [
        (True, 0, False, None, None, True),  # completed or tidal stop: rank 0 writes
        (True, 1, False, None, None, False),
        (True, 0, True, None, None, False),  # sharded: every member wrote its shard
        (False, 0, False, None, None, False),  # told to leave
        (False, 1, False, StopAnswer(step=51, writer=True), 51, True),  # named writer
        (False, 0, False, StopAnswer(step=51, writer=False), 51, False),
        (True, 0, False, None, 51, False),  # another member's script stopped the job
        (False, 0, False, StopAnswer(step=None), None, True),  # stopped nothing: as a stop
        (False, 1, False, StopAnswer(step=None), None, False),
    ],
)
def test_writes_final(finished, rank, sharded, answer, stop_step, writes) -> None:
    got = writes_final(
        finished=finished, last_rank=rank, sharded=sharded, answer=answer, stop_step=stop_step
    )
    assert got is writes
