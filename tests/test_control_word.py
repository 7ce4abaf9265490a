"""The control word rides a real DDP all-reduce between two gloo processes: every member
reads the same sums of the flags, and the gradients are summed exactly, whether the word is
appended to the first bucket (small) or sent beside it (a first bucket too big to copy)."""

import pytest
from ranks import run_ranks

from tidal.worker.group import CARRIER_MAX

SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from tidal.worker import group as grp
rank, port, dev = int(sys.argv[1]), int(sys.argv[2]), torch.device(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
out = {}
for case, width in (("small", 8), ("huge", 1024)):  # last layer 8x4 or 1024x1024
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width)).to(dev)
    control = grp.ControlWord(dev)
    ddp = grp.wrap(m, control)
    control.set(switch=rank == 0, stop=rank == 1)
    torch.manual_seed(10 + rank)
    x = torch.randn(3, 16).to(dev)
    ddp(x).sum().backward()
    control.settle()
    mine = torch.autograd.grad(m(x).sum(), list(m.parameters()))
    out[case] = {
        "switch": control.switch, "stop": control.stop,
        "flags": control.recv.tolist(),
        "on": [str(control.recv.device), str(next(m.parameters()).grad.device)],
        "grads": [p.grad.flatten()[:50].tolist() for p in m.parameters()],
        "mine": [g.flatten()[:50].tolist() for g in mine],
        "first_bucket": max(p.numel() for p in m.parameters()),
    }
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_flags_and_gradients_are_summed_on_every_member(device):
    outs = run_ranks(SCRIPT, 2, args=(device,))
    assert outs[1]["huge"]["first_bucket"] > CARRIER_MAX  # the word went beside it
    for case in ("small", "huge"):
        a, b = outs[0][case], outs[1][case]
        # rank 0 asked to switch, rank 1 to stop: both see both, with the same sums.
        assert a["flags"] == b["flags"] == [1.0, 1.0]
        assert {x.split(":")[0] for x in a["on"] + b["on"]} == {device}  # gloo, on the device
        assert a["switch"] and a["stop"] and b["switch"] and b["stop"]
        assert a["grads"] == b["grads"]
        for ga, ma, mb in zip(a["grads"], a["mine"], b["mine"], strict=True):
            assert ga == pytest.approx([x + y for x, y in zip(ma, mb, strict=True)], rel=1e-5)
