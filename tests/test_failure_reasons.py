"""The reason a member reports for a failed collective is plain words, not gloo's raw text
(issue 50, minor: "Unable to cast [/__w/.../pair.cc:553] Connection closed by peer ...
GLHF! 🏖️ to Tensor" was the reason ``tidal status`` showed)."""

from __future__ import annotations

import pytest

from tests.ranks import run_ranks
from tidal.worker.membership.reasons import MAX_CHARS, failure_reason

CAST = (
    "Unable to cast [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:32903. This is typically caused by a remote "
    "worker crashing. Check the logs of the remote worker before reporting an error. "
    "GLHF! \U0001f3d6\ufe0f to Tensor"
)


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (
            RuntimeError(CAST),
            "RuntimeError: the connection to a peer was lost (gloo: Connection closed by "
            "peer 127.0.0.1:32903)",
        ),
        (
            RuntimeError(
                "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
                "[127.0.0.1]:12345: Connection reset by peer"
            ),
            "RuntimeError: the connection to a peer was lost (gloo: Read error "
            "127.0.0.1:12345: Connection reset by peer)",
        ),
        (
            RuntimeError(
                "[/x/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                "waiting 30000ms for recv operation to complete"
            ),
            "RuntimeError: a peer did not answer in time (gloo: Timed out waiting 30000ms "
            "for recv operation to complete)",
        ),
        (
            RuntimeError("[/x/gloo/gloo/allreduce.cc:12] something new"),
            "RuntimeError: a collective failed (gloo: something new)",
        ),
        (ValueError("a plain error\nwith a second line"), "ValueError: a plain error"),
        (
            RuntimeError("collective aborted: a peer left"),
            "RuntimeError: collective aborted: a peer left",
        ),
        (RuntimeError(""), "RuntimeError: "),
        (RuntimeError("x" * 1000), "RuntimeError: " + "x" * (MAX_CHARS - 14)),
    ],
)
def test_failure_reasons(exc: BaseException, reason: str) -> None:
    assert failure_reason(exc) == reason


SCRIPT = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from tidal.worker.membership.reasons import failure_reason
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=20))
dist.all_reduce(torch.ones(4))
if rank == 1:  # the peer dies before the second all-reduce
    print(json.dumps({}), flush=True)
    os._exit(0)
time.sleep(0.5)
try:
    dist.all_reduce(torch.ones(1 << 20))
    out = {"error": None}
except Exception as exc:
    out = {"error": str(exc), "reason": failure_reason(exc)}
print(json.dumps(out), flush=True)
os._exit(0)
"""


def test_a_real_gloo_failure_reads_as_a_lost_peer() -> None:
    survivor, _ = run_ranks(SCRIPT, 2, timeout=60)
    assert survivor["error"] is not None, "the all-reduce with a dead peer succeeded"
    reason = survivor["reason"]
    assert "the connection to a peer was lost (gloo: " in reason, survivor
    assert ".cc:" not in reason and "GLHF" not in reason and "Unable to cast" not in reason
