"""The control word and the gradients' SUM hook (``worker.ddp``) on a real DDP all-reduce
between two gloo processes: every member reads the same sums of the flags, summed beside
the forward and backward, and the gradients are summed, with one bucket (a small model) or
several (a layer larger than DDP's first bucket); the fault-injection point and the
exposed-wait timing belong to the last bucket."""

import pytest
from ranks import run_ranks

SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from tidal.worker.membership import ddp as tddp
earlier = []  # buckets before the last one, as the hook completes them
plain = tddp._tensor
tddp._tensor = lambda fut: (earlier.append(1), plain(fut))[1]
rank, port, dev = int(sys.argv[1]), int(sys.argv[2]), torch.device(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
out = {}
for case, width in (("small", 8), ("huge", 2600)):  # 8x8 or 2600x2600: 27 MB, two buckets
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width)).to(dev)
    control = tddp.ControlWord(dev)
    ddp = tddp.wrap(m, control)
    torch.manual_seed(10 + rank)
    x = torch.randn(3, 16).to(dev)
    for _ in range(2):  # DDP re-buckets after its first backward: the second has them all
        m.zero_grad()
        calls, earlier[:] = [], []
        control.before_allreduce = lambda: calls.append(control.comm_started)
        control.set(switch=rank == 0, stop=rank == 1, every=5 if rank == 0 else 0)
        control.count(3 + 4 * rank)  # items=: 3 on rank 0, 7 on rank 1
        control.start()
        ddp(x).sum().backward()
        control.settle()
    grads = [p.grad.flatten()[:50].tolist() for p in m.parameters()]
    reduced = control.reduced
    m.zero_grad()
    m(x).sum().backward()  # the module itself, not the wrapper: nothing is all-reduced
    bypassed = control.reduced - reduced
    mine = torch.autograd.grad(m(x).sum(), list(m.parameters()))
    out[case] = {
        "switch": control.switch, "stop": control.stop,
        "flags": list(control.sums), "every": control.every,
        "on": [str(control.recv.device), str(next(m.parameters()).grad.device)],
        "grads": grads,
        "mine": [g.flatten()[:50].tolist() for g in mine],
        "buckets": len(earlier) + 1,
        "reduced": reduced, "bypassed": bypassed, "items": control.items,
        "before_allreduce": len(calls),
        "timed": control.comm_done >= control.comm_started > 0,
    }
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_flags_and_gradients_are_summed_on_every_member(device):
    outs = run_ranks(SCRIPT, 2, args=(device,))
    assert outs[0]["small"]["buckets"] == 1 and outs[0]["huge"]["buckets"] > 1
    for case in ("small", "huge"):
        a, b = outs[0][case], outs[1][case]
        # rank 0 asked to switch, rank 1 to stop: both see both, with the same sums, and
        # rank 0's cadence (the others put 0).
        assert a["flags"] == b["flags"] == [1.0, 1.0, 5.0, 10.0]
        assert a["items"] == b["items"] == 10.0  # the item counts, summed
        # each step through the wrapper all-reduced its last bucket once; the bare module's
        # backward none (``step.GradientsNotReduced``)
        assert a["reduced"] == b["reduced"] == 2 and a["bypassed"] == b["bypassed"] == 0
        assert a["every"] == b["every"] == 5
        assert {x.split(":")[0] for x in a["on"] + b["on"]} == {device}  # gloo, on the device
        assert a["switch"] and a["stop"] and b["switch"] and b["stop"]
        assert a["before_allreduce"] == b["before_allreduce"] == 1  # the last bucket only
        assert a["timed"] and b["timed"]
        assert a["grads"] == b["grads"]
        for ga, ma, mb in zip(a["grads"], a["mine"], b["mine"], strict=True):
            assert ga == pytest.approx([x + y for x, y in zip(ma, mb, strict=True)], rel=1e-5)


@pytest.mark.parametrize(
    ("step_s", "every"),
    [
        (None, 1),  # no step timed yet: every step
        (0.0, 1),
        (-1.0, 1),
        (float("nan"), 1),
        (0.5, 1),  # a step longer than the period: every step
        (0.2, 1),
        (0.05, 4),
        (0.043, 4),  # the bench's two-worker step: one word in four steps
        (0.01, 20),
        (0.001, 32),  # capped: a change waits at most MAX_EVERY steps
    ],
)
def test_a_word_rides_once_per_period_of_training(step_s, every):
    from tidal.worker.membership.ddp import CONTROL_PERIOD_S, MAX_EVERY, control_every

    assert control_every(step_s) == every
    if step_s is not None and step_s > 0:  # noticed within a period and a step, or the cap
        assert (every - 1) * step_s <= CONTROL_PERIOD_S or every == MAX_EVERY


COMPRESSED = r"""
import json, sys, torch, torch.distributed as dist
from tidal.worker.membership import ddp as tddp
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
torch.manual_seed(0)
m = torch.nn.Linear(64, 64)
control = tddp.ControlWord(None)
wrapped = tddp.wrap(m, control, tddp.check_kwargs({"compression": sys.argv[3]}))
torch.manual_seed(10 + rank)
x = torch.randn(5, 64)
control.set(switch=rank == 1, stop=False)
control.count(2)
control.start()
wrapped(x).sum().backward()
control.settle()
mine = torch.autograd.grad(m(x).sum(), [m.weight])[0]
print(json.dumps({"grad": m.weight.grad.flatten().tolist(), "mine": mine.flatten().tolist(),
                  "sums": list(control.sums), "reduced": control.reduced,
                  "dtype": str(control.compress)}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "tol"), [("bf16", 2e-2), ("fp16", 2e-3)])
def test_compressed_gradients_travel_in_half_precision_beside_the_word(name, tol):
    import torch

    a, b = run_ranks(COMPRESSED, 2, args=(name,))
    assert (
        a["grad"] == b["grad"]
        and a["dtype"] == f"torch.{'bfloat16' if name == 'bf16' else 'float16'}"
    )
    exact = torch.tensor(a["mine"]) + torch.tensor(b["mine"])
    got = torch.tensor(a["grad"])
    assert torch.allclose(got, exact, rtol=tol, atol=tol)  # the sum, to half precision
    assert not torch.equal(got, exact)  # and rounded: it did travel compressed
    assert a["sums"] == b["sums"] == [1.0, 0.0, 0.0, 4.0]  # the word, whole
    assert a["reduced"] == b["reduced"] == 1


def test_a_compression_other_than_bf16_or_fp16_is_refused():
    from tidal.worker.membership.ddp import check_kwargs

    with pytest.raises(ValueError, match=r"compression'\] must be one of \['bf16', 'fp16'\]"):
        check_kwargs({"compression": "int8"})
    with pytest.raises(ValueError, match=r"not \['broadcast_buffers'\]"):
        check_kwargs({"broadcast_buffers": True})
