"""Healing between two real processes over gloo: a joiner with no state adopts the source's
parameters, optimizer state (Adam's and SGD's) and RNG exactly."""

import json
import socket
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from tidal.worker.heal import heal
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
torch.manual_seed(rank)
out = {}
for name in ("adam", "sgd"):
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = (torch.optim.Adam(m.parameters(), 1e-3) if name == "adam"
           else torch.optim.SGD(m.parameters(), 0.1, momentum=0.9))
    if rank == 0:
        for _ in range(3):
            m(torch.randn(5, 16)).sum().backward(); opt.step(); opt.zero_grad()
    result = heal(module=m, optimizer=opt, step=7 if rank == 0 else None)
    sd = opt.state_dict()
    out[name] = {
        "step": result.step, "sent": result.sent, "source": result.source,
        "params": [p.detach().flatten().tolist() for p in m.parameters()],
        "state": {str(k): {kk: (v.flatten().tolist() if torch.is_tensor(v) else v)
                           for kk, v in st.items()} for k, st in sd["state"].items()},
        "groups": repr(sd["param_groups"]),
        "draw": torch.rand(2).tolist(),
    }
print(json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_joiner_adopts_the_source_state_exactly():
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(r), str(port)], stdout=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    try:
        outs = [json.loads(p.communicate(timeout=100)[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    source, joiner = outs
    for name in ("adam", "sgd"):
        assert joiner[name]["sent"] and joiner[name]["source"] == 0 and joiner[name]["step"] == 7
        assert joiner[name]["params"] == source[name]["params"]
        assert joiner[name]["state"] == source[name]["state"] and joiner[name]["state"]
        assert joiner[name]["groups"] == source[name]["groups"]
        assert joiner[name]["draw"] == source[name]["draw"]  # the RNG came along
