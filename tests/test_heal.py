"""Healing between real processes over gloo: a joiner with no state adopts the source's
parameters, optimizer state (Adam's and SGD's) and RNG exactly, on every device (gloo's
wire is the CPU: CUDA tensors travel as host copies, small and large ones), into the landing
memory it prepared (``landing.prepare``) on the CPU."""

import pytest
from ranks import run_ranks

SCRIPT = r"""
import json, random, sys, torch, torch.distributed as dist
from tidal.worker.state.heal import heal, LARGE
from tidal.worker.state.landing import prepare
from tidal.worker.state import cma
rank, port, dev = int(sys.argv[1]), int(sys.argv[2]), torch.device(sys.argv[3])
if sys.argv[4] == "refused":  # the kernel refuses the joiner's direct read
    def refuse(offer, tensors):
        raise PermissionError(1, "Operation not permitted (the test's)")
    cma.read = refuse
if sys.argv[4] == "released" and rank == 0:  # the source stops holding before the read ends
    real_offer = cma.offer
    def offer_then_release(tensors, hold):
        offer = real_offer(tensors, hold)
        hold.release()
        return offer
    cma.offer = offer_then_release
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
torch.manual_seed(rank)
if dev.type == "cuda":
    torch.cuda.manual_seed(rank)
out = {}
for name in ("adam", "sgd", "sgd_tensor_lr"):
    random.seed(rank)
    random.gauss(0, 1)  # leaves the second of the pair in the state: it travels too
    m = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).to(dev)
    assert max(p.numel() for p in m.parameters()) >= LARGE  # one travels alone
    if name == "adam":  # plain values: its blob is tagged JSON (``blob``)
        opt = torch.optim.Adam(m.parameters(), 1e-3)
    else:  # a tensor in the param groups: its blob carries its raw bytes after the JSON
        lr = torch.tensor(0.1) if name == "sgd_tensor_lr" else 0.1
        opt = torch.optim.SGD(m.parameters(), lr, momentum=0.9)
    if rank == 0:
        for _ in range(3):
            m(torch.randn(5, 16).to(dev)).sum().backward(); opt.step(); opt.zero_grad()
    land = prepare(opt) if rank == 1 and dev.type == "cpu" else []
    result = heal(module=m, optimizer=opt, step=7 if rank == 0 else None, wire=torch.device("cpu"),
                  landing=land)
    sd = opt.state_dict()
    ptrs = {t.data_ptr() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)}
    out[name] = {
        "step": result.step, "sent": result.sent, "source": result.source,
        "direct": result.direct,
        "params": [p.detach().flatten()[::97].tolist() for p in m.parameters()],
        "devices": sorted({str(t.device) for t in list(m.parameters()) + [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]}),
        "state": {str(k): {kk: (v.flatten()[::97].tolist() if torch.is_tensor(v) else v)
                           for kk, v in st.items()} for k, st in sd["state"].items()},
        "groups": repr(sd["param_groups"]),
        "landed": bool(land) and ptrs == {t.data_ptr() for t in land},
        "draw": torch.rand(2).tolist(),
        "py_draw": [random.gauss(0, 1), random.random()],
        "cuda_draw": torch.rand(2, device=dev).tolist() if dev.type == "cuda" else None,
    }
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["direct", "refused", "released"])
def test_joiner_adopts_the_source_state_exactly(device, path, cross_memory):
    """On the CPU the joiner reads the source's memory directly (``cma``); when the kernel
    refuses that read, or the source no longer holds its state when the read ends
    (``cma.Hold``: its wait was cut, it may change it), the same state comes through the
    group instead. On a GPU the tensors are not in host memory: always through the group."""
    if path in ("direct", "released") and device == "cpu" and not cross_memory:
        pytest.skip("this machine refuses process_vm_readv: the 'refused' case tests the rest")
    outs = run_ranks(SCRIPT, 2, args=(device, path))
    source, joiner = outs
    for name in ("adam", "sgd", "sgd_tensor_lr"):
        assert joiner[name]["sent"] and joiner[name]["source"] == 0 and joiner[name]["step"] == 7
        assert joiner[name]["direct"] == (device == "cpu" and path == "direct")
        assert not source[name]["direct"]
        assert joiner[name]["params"] == source[name]["params"]
        assert joiner[name]["state"] == source[name]["state"] and joiner[name]["state"]
        assert joiner[name]["groups"] == source[name]["groups"]
        assert joiner[name]["draw"] == source[name]["draw"]  # the RNG came along
        assert joiner[name]["py_draw"] == source[name]["py_draw"]  # Python's, with its gauss
        assert joiner[name]["cuda_draw"] == source[name]["cuda_draw"]
        assert {d.split(":")[0] for d in joiner[name]["devices"]} == {device}  # stayed there
        # On the CPU the state landed in the memory the joiner prepared, every tensor of it.
        assert joiner[name]["landed"] == (device == "cpu")


SCRIPT3 = r"""
import json, sys, torch, torch.distributed as dist
from tidal.worker.state.heal import heal
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=3)

def trained(steps):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)
    for _ in range(steps):
        m(torch.randn(5, 16)).sum().backward(); opt.step(); opt.zero_grad()
    return m, opt

out = {}
# join: ranks 0 and 1 in sync at step 7, rank 2 new. laggard: rank 0 one step behind.
for case, steps in (("join", {0: 7, 1: 7, 2: None}), ("laggard", {0: 6, 1: 7, 2: 7})):
    n = steps[rank]
    m, opt = trained(n if n is not None else 0)
    if n is None:
        opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)  # no state yet
        torch.manual_seed(100)
        for p in m.parameters():
            torch.nn.init.normal_(p)
    torch.manual_seed(1000 + rank)
    rng_before = torch.get_rng_state()
    result = heal(module=m, optimizer=opt, step=n)
    out[case] = {
        "step": result.step, "sent": result.sent, "source": result.source,
        "params": [p.detach().flatten().tolist() for p in m.parameters()],
        "momentum": [s["momentum_buffer"].flatten().tolist() for s in opt.state.values()],
        "rng_kept": bool(torch.equal(torch.get_rng_state(), rng_before)),
    }
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_only_members_behind_the_source_receive():
    outs = run_ranks(SCRIPT3, 3)
    join = [o["join"] for o in outs]
    assert [o["source"] for o in join] == [0, 0, 0] and {o["step"] for o in join} == {7}
    # Rank 1 was in sync: it received nothing and kept its own RNG; the joiner got it all.
    assert [o["sent"] for o in join] == [True, False, True]
    assert join[1]["rng_kept"] and not join[2]["rng_kept"]
    assert join[2]["params"] == join[0]["params"] and join[2]["momentum"] == join[0]["momentum"]
    assert join[2]["momentum"]  # state exists
    lag = [o["laggard"] for o in outs]
    # The lowest rank at the highest step is the source; only the laggard receives.
    assert [o["source"] for o in lag] == [1, 1, 1] and {o["step"] for o in lag} == {7}
    assert [o["sent"] for o in lag] == [True, True, False]
    assert lag[0]["params"] == lag[1]["params"] == lag[2]["params"]
    assert lag[0]["momentum"] == lag[1]["momentum"]


SCRIPT_STRIDED = r"""
import json, sys, torch, torch.distributed as dist
from tidal.worker.state.heal import heal, LARGE
from tidal.worker.state.landing import prepare
rank, port, landed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "landing"
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
torch.manual_seed(rank)
m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
m[0].weight = torch.nn.Parameter(torch.randn(512, 512).t())  # a transposed weight
assert not m[0].weight.is_contiguous() and m[0].weight.numel() >= LARGE
opt = torch.optim.Adam(m.parameters(), 1e-3)
if rank == 0:  # Adam's state takes the weight's strides; a fresh receiver's does not
    for _ in range(3):
        m(torch.randn(5, 512)).sum().backward(); opt.step(); opt.zero_grad()
land = prepare(opt) if rank == 1 and landed else []
heal(module=m, optimizer=opt, step=7 if rank == 0 else None, landing=land)
print(json.dumps({
    "params": [p.detach().flatten().tolist() for p in m.parameters()],
    "state": [v.flatten().tolist() for st in opt.state.values() for v in st.values()],
}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("landing", ["landing", "fresh"])
def test_strided_tensors_travel_whole_whatever_the_receivers_strides(landing):
    # The sender's large state tensors are strided; the receiver's fresh ones are not (its
    # landing's are). Before 2026-12-04 the two sides then disagreed on the messages and
    # gloo aborted the process (or, had the sizes matched, a tensor got another's data).
    source, joiner = run_ranks(SCRIPT_STRIDED, 2, args=(landing,))
    assert joiner["params"] == source["params"]
    assert joiner["state"] == source["state"] and len(source["state"]) == 12


SCRIPT_OTHER_MODEL = r"""
import datetime, json, sys, torch, torch.distributed as dist
from tidal.worker.state.heal import heal, ModelMismatch
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=10))
torch.manual_seed(rank)
# The receiver's layer is the source's transposed: every tensor has the same size, so the
# bytes would fit and nothing would fail but the training.
shape = (512, 256) if rank == 0 else (256, 512)
m = torch.nn.Sequential(torch.nn.Linear(*shape, bias=False), torch.nn.Linear(shape[1], 4))
opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)
if rank == 0:
    m(torch.randn(5, 512)).sum().backward(); opt.step(); opt.zero_grad()
before = [p.detach().clone() for p in m.parameters()]
try:
    heal(module=m, optimizer=opt, step=7 if rank == 0 else None)
    error = None
except Exception as exc:
    error = [type(exc).__name__, str(exc)]
untouched = all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
dist.destroy_process_group()  # a member that failed leaves the group
print(json.dumps({"error": error, "untouched": untouched, "state": len(opt.state)}))
"""


@pytest.mark.timeout(120)
def test_a_receiver_whose_model_differs_refuses_before_receiving():
    source, receiver = run_ranks(SCRIPT_OTHER_MODEL, 2)
    kind, line = receiver["error"]
    assert kind == "ModelMismatch", receiver
    assert "0.weight: [512, 256] float32 here, [256, 512] float32 at the source" in line
    assert receiver["untouched"] and receiver["state"] == 0  # nothing was received
    assert source["error"] is not None and source["untouched"]  # its send failed, loudly


SCRIPT_CUT = r"""
import json, os, sys, torch, torch.distributed as dist
import tidal.worker.state.heal as heal_mod
from tidal.worker.state import cma
rank, port, cut = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
torch.manual_seed(rank)
m = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))
assert m[0].weight.numel() >= heal_mod.LARGE  # the first tensor travels alone, in place
opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)
m(torch.randn(5, 1024)).sum().backward(); opt.step(); opt.zero_grad()

def die(*args, **kwargs):  # the source is lost: in the blob, or after the first tensor
    if cut == "tensors":
        dist.isend(args[0][0].detach(), 1).wait()
    print(json.dumps({"first": m[0].weight.flatten()[:64].tolist()}), flush=True)
    os._exit(0)

real_read = cma.read
def read_one(offer, tensors):  # the direct read is cut after the first tensor
    real_read({**offer, "spans": offer["spans"][:1]}, tensors[:1])
    raise OSError("cut by the test")

if rank == 0:
    setattr(heal_mod, "send_blob" if cut == "blob" else "_send_tensors", die)
    if cut == "tensors":  # through the group: no direct read offered
        cma.offerable = lambda tensors: False
elif cut == "read":
    cma.read = read_one
before = m[0].weight.flatten()[:64].tolist()
try:
    heal_mod.heal(module=m, optimizer=opt, step=7 if rank == 0 else 6)
    error = None
except Exception as exc:
    error = type(exc).__name__
print(json.dumps({"error": error, "before": before, "first": m[0].weight.flatten()[:64].tolist()}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cut", ["blob", "tensors", "read"])
def test_a_heal_cut_while_receiving_says_the_state_is_a_mix(cut, cross_memory):
    """A laggard (step 6) heals from the source (step 7), which dies mid-heal. Cut in the
    tensors (through the group), or in a direct read whose fallback then finds the source
    gone, the laggard's first parameter is already the source's: it holds a mix of two
    steps, and the heal says so (``HealInterrupted``, which makes the member forget its
    state). Cut before any tensor, its state is untouched and stays its own."""
    if cut == "read" and not cross_memory:
        pytest.skip("this machine refuses process_vm_readv: no direct read to cut")
    source, laggard = run_ranks(SCRIPT_CUT, 2, args=(cut,))
    assert laggard["error"] is not None  # the heal failed either way
    if cut in ("tensors", "read"):
        assert laggard["error"] == "HealInterrupted"
        assert laggard["first"] == source["first"] != laggard["before"]
    else:
        assert laggard["error"] != "HealInterrupted"
        assert laggard["first"] == laggard["before"] != source["first"]


SCRIPT_BLOB = r"""
import json, sys, torch, torch.distributed as dist
from tidal.worker.state.heal import BLOB_FIRST, send_blob
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
sizes = [0, 1, BLOB_FIRST - 8, BLOB_FIRST - 7, 3 * BLOB_FIRST + 5]
got = []
for n in sizes:
    blob = bytes((i * 7 + n) % 251 for i in range(n)) if rank == 1 else None
    back = send_blob(blob, 1, [0, 2])
    got.append([len(back), back == bytes((i * 7 + n) % 251 for i in range(n))])
print(json.dumps(got))
"""


@pytest.mark.timeout(120)
def test_a_blob_of_any_size_arrives_whole():
    """A blob that fits the first message travels in it; one a byte longer, or much longer,
    in two; the empty blob too. Every receiver gets the source's bytes, exactly."""
    outs = run_ranks(SCRIPT_BLOB, 3)
    for out in outs:
        assert all(same for _, same in out), out
        assert [n for n, _ in out] == [0, 1, 128 * 1024 - 8, 128 * 1024 - 7, 3 * 128 * 1024 + 5]


SCRIPT_STEPS = r"""
import json, sys, torch, torch.distributed as dist
from tidal.protocol import GenerationInfo
from tidal.worker.membership import group as grp
from tidal.worker.state.heal import NO_STATE, heal
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
info = GenerationInfo(id=4, members=[10, 11, 12], store_prefix="ns/gen4", reason="test")
step = {0: 7, 1: 7, 2: None}[rank]
torch.manual_seed(0 if step else 5)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)
if step:
    m(torch.randn(5, 16)).sum().backward(); opt.step(); opt.zero_grad()
grp.publish_step(store, info, rank, step)  # then the group forms on the same connection
dist.init_process_group("gloo", store=dist.PrefixStore("ns/gen4/pg", store), rank=rank, world_size=3)
steps = grp.member_steps(store, info, none=NO_STATE)
result = heal(module=m, optimizer=opt, step=step, steps=steps)
try:
    heal(module=m, optimizer=opt, step=step, steps=[7, 7, 7, 7])
    wrong = None
except ValueError as exc:
    wrong = str(exc)
print(json.dumps({"steps": steps, "sent": result.sent, "step": result.step, "wrong": wrong,
                  "params": [p.detach().flatten().tolist() for p in m.parameters()]}))
"""


@pytest.mark.timeout(120)
def test_steps_read_from_the_store_decide_the_heal_as_the_gather_would():
    """Each member publishes its step before the group forms; once formed, every member
    reads all of them (``group.member_steps``) and the heal sends to the joiner alone. A
    list that does not name this member is refused before anything moves."""
    outs = run_ranks(SCRIPT_STEPS, 3)
    assert [o["steps"] for o in outs] == [[7, 7, -1]] * 3
    assert [o["sent"] for o in outs] == [True, False, True]
    assert {o["step"] for o in outs} == {7}
    assert outs[2]["params"] == outs[0]["params"] == outs[1]["params"]
    assert all("do not name this member" in o["wrong"] for o in outs)
