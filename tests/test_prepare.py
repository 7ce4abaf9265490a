"""``tidal.prepare`` (issue 55) in one process: the script's own loop trains exactly as
without Tidal, accumulates micro-batches, keeps epochs, steps its scheduler only after an
applied step, and refuses a loop it cannot make elastic in one line. Then, on a real gloo
group of two processes, the two things the prepared path adds to DDP: the gradients'
weights are applied before DDP reduces them, and a failed all-reduce is kept instead of
raised in the script's ``loss.backward()``. The elastic run is tests/test_prepare_e2e.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from ranks import run_ranks
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

import tidal
from tidal.worker.batches.sampler import ElasticSampler
from tidal.worker.compat.prepare import PreparedModel, _length
from tidal.worker.membership import ddp
from tidal.worker.trainer.driven import StepNotEnded

D = torch.float64


def data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g, dtype=D)
    return TensorDataset(x, torch.tanh(x @ torch.randn(6, 2, generator=g, dtype=D)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 16, dtype=D), torch.nn.Linear(16, 2, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))

    def double_it(self) -> int:  # a method of the script's own
        return 2


def objects(batch: int = 24, **loader_kw):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(s / 9)))
    return model, opt, DataLoader(data(), batch_size=batch, **loader_kw), sched


def train(model, opt, loader, sched, epochs: int, *, zero_first: bool = False) -> list[int]:
    """The plain loop (AdamW, a scheduler, clipping); the batches' sizes it saw."""
    sizes = []
    for _ in range(epochs):
        for x, y in loader:
            if zero_first:
                opt.zero_grad()
            sizes.append(len(x))
            F.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            opt.step()
            sched.step()
            if not zero_first:
                opt.zero_grad()
    return sizes


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_alone_the_prepared_loop_trains_exactly_as_the_plain_loop() -> None:
    plain = objects()
    train(*plain, epochs=3)
    model, opt, loader, sched = tidal.prepare(*objects(), epochs=3)
    assert train(model, opt, loader, sched, epochs=3) == [24] * 12
    assert torch.equal(params(model), params(plain[0]))  # bitwise
    assert sched.last_epoch == plain[3].last_epoch == 12
    assert opt.state_dict()["state"][0]["step"] == 12


def test_micro_batches_accumulate_to_the_global_batch_update() -> None:
    """``micro_batch_size=8``: three batches a step, ``optimizer.step()`` and
    ``zero_grad()`` after (or before) each as an unchanged loop calls them; only the step's
    last acts, and the update is the global batch's (float64, to rounding)."""
    plain = objects()
    train(*plain, epochs=2)
    for zero_first in (False, True):
        model, opt, loader, sched = tidal.prepare(*objects(), epochs=2, micro_batch_size=8)
        assert train(model, opt, loader, sched, epochs=2, zero_first=zero_first) == [8] * 24
        assert len(loader) == 4 and sched.last_epoch == 8
        rel = (params(model) - params(plain[0])).norm() / params(plain[0]).norm()
        assert rel < 1e-13, rel


def test_an_epoch_of_the_loader_is_the_job_epoch_and_the_end_is_the_job_end() -> None:
    """100 samples in batches of 24: 4 steps an epoch (4 samples left over, as drop_last);
    max_steps=10 ends in the third epoch, and later epochs are empty."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(*data(100).tensors), batch_size=24, shuffle=True)
    model, opt, loader, _ = tidal.prepare(model, opt, loader, max_steps=10, seed=3)
    seen = []
    for _ in range(5):
        epoch = []
        for x, y in loader:
            epoch.append(x)
            F.mse_loss(model(x), y).backward()
            opt.step()
        seen.append(epoch)
    assert [len(e) for e in seen] == [4, 4, 2, 0, 0] and len(loader) == 4
    # shuffle=True: Tidal's seeded order (the same at any world size), epoch by epoch
    order = ElasticSampler(dataset_size=100, global_batch_size=24, seed=3)
    x_all = data(100).tensors[0]
    for step, x in enumerate(x for e in seen for x in e):
        assert torch.equal(x, x_all[order.global_batch(step)])


def test_a_scheduler_stepped_once_an_epoch_moves_once_an_epoch() -> None:
    def run(prepared: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        loader = DataLoader(data(), batch_size=32)
        if prepared:
            model, opt, loader, sched = tidal.prepare(model, opt, loader, sched, epochs=3)
        for _ in range(3):
            for x, y in loader:
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            sched.step()
        assert sched.last_epoch == 3
        return params(model)

    assert torch.equal(run(True), run(False))


def test_the_prepared_model_is_the_module() -> None:
    module, opt, loader, sched = objects()
    model, popt, _, psched = tidal.prepare(module, opt, loader, sched, max_steps=1)
    assert isinstance(model, PreparedModel) and model.module is module
    assert model.state_dict().keys() == module.state_dict().keys()  # no "module." prefix
    assert [id(p) for p in model.parameters()] == [id(p) for p in module.parameters()]
    assert model.double_it() == 2 and model.a is module.a  # the module's own attributes
    ema = torch.optim.swa_utils.AveragedModel(model)  # deep-copies what it averages
    assert type(ema.module) is Net and ema.module is not module
    assert copy.deepcopy(model).state_dict().keys() == module.state_dict().keys()
    assert isinstance(popt, torch.optim.Optimizer) and popt.param_groups is opt.param_groups
    assert psched.get_last_lr() == sched.get_last_lr() and psched.scheduler is sched


def _one_batch(**kw):
    model, opt, loader, _ = tidal.prepare(*objects()[:3], max_steps=4, **kw)
    it = iter(loader)
    x, y = next(it)
    return model, opt, it, F.mse_loss(model(x), y)


def test_a_step_must_end_with_optimizer_step_once() -> None:
    _, opt, it, loss = _one_batch()
    loss.backward()
    with pytest.raises(StepNotEnded, match="without calling optimizer.step"):
        next(it)
    _, opt, it, loss = _one_batch()
    loss.backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) twice in step 0"):
        opt.step()
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: loss)
    model, opt, loader, _ = tidal.prepare(*objects()[:3], max_steps=4)
    with pytest.raises(RuntimeError, match="before the loop took a batch"):
        opt.step()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # on purpose
def test_the_scheduler_waits_for_the_step_it_follows() -> None:
    model, opt, loader, sched = tidal.prepare(*objects(), max_steps=4, micro_batch_size=12)
    sched.step()  # before the first step: between steps, it moves
    assert sched.last_epoch == 1
    it = iter(loader)
    x, y = next(it)  # the first of two micro-batches
    F.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()  # inside the step (accumulating): nothing
    assert sched.last_epoch == 1
    x, y = next(it)
    F.mse_loss(model(x), y).backward()
    sched.step()  # before the step's optimizer.step(): nothing
    assert sched.last_epoch == 1
    opt.step()
    sched.step()  # after the applied step
    assert sched.last_epoch == 2


@pytest.mark.parametrize(
    ("max_steps", "epochs", "per_epoch", "expect"),
    [
        (10, None, 4, 10),
        (None, 3, 4, 12),
        (0, None, None, 0),
        (None, None, 4, "once"),
        (5, 2, 4, "once"),
        (None, 2, None, "a stream has no epochs"),
        (-1, None, 4, "max_steps must be"),
        (None, 1.5, 4, "epochs must be"),
        (True, None, 4, "max_steps must be"),
    ],
)
def test_the_job_length(max_steps, epochs, per_epoch, expect) -> None:
    if isinstance(expect, str):
        with pytest.raises(ValueError, match=expect):
            _length(max_steps, epochs, per_epoch)
    else:
        assert _length(max_steps, epochs, per_epoch) == expect


@pytest.mark.parametrize(
    ("loader", "kw", "message"),
    [
        (data(), {}, "takes a torch DataLoader"),
        (DataLoader(data(), batch_sampler=[[0, 1]]), {}, "batch_sampler"),
        (
            DataLoader(data(), batch_size=24, sampler=WeightedRandomSampler([1.0] * 96, 96)),
            {},
            "sampler",
        ),
        (DataLoader(data(), batch_size=24), {"state": {"scheduler": None}}, "scheduler"),
        (DataLoader(data(), batch_size=24), {"micro_batch_size": 0}, "micro_batch_size"),
    ],
)
def test_what_is_refused(loader, kw, message) -> None:
    model, opt, _, sched = objects()
    with pytest.raises(ValueError, match=message):
        tidal.prepare(model, opt, loader, sched, max_steps=2, **kw)


def test_a_kept_failure_completes_the_bucket_instead() -> None:
    control = ddp.ControlWord()
    buf = torch.ones(3)
    failing: torch.futures.Future = torch.futures.Future()
    fut = control.kept(buf, lambda: failing)
    failing.set_exception(RuntimeError("peer left"))
    assert fut.wait() is buf and str(control.take_caught()) == "peer left"
    assert control.take_caught() is None  # taken once

    def broken() -> torch.futures.Future:
        raise RuntimeError("group gone")

    assert control.kept(buf, broken).wait() is buf
    assert str(control.take_caught()) == "group gone"
    done: torch.futures.Future = torch.futures.Future()
    done.set_result([torch.zeros(3)])  # a collective's list of tensors: its first
    assert torch.equal(control.kept(buf, lambda: done).wait(), torch.zeros(3))
    assert control.take_caught() is None


RANKS = r"""
import json, os, sys, torch, torch.distributed as dist
from tidal.worker.membership import ddp as tddp
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
control = tddp.ControlWord()
control.catching = True
wrapper = tddp.wrap(m, control)
torch.manual_seed(10 + rank)
x = torch.randn(5, 4, dtype=torch.float64)
weight = [0.25, 0.75][rank]  # each member's share, as the prepared loop's hooks weigh it
hooks = [p.register_hook(lambda g: g * weight) for p in m.parameters()]
wrapper(x).pow(2).mean().backward()
summed = [p.grad.clone() for p in m.parameters()]
for h in hooks:
    h.remove()
mine = torch.autograd.grad(m(x).pow(2).mean(), list(m.parameters()))
out = {"summed": [g.flatten().tolist() for g in summed], "mine": [g.flatten().tolist() for g in mine]}
m.zero_grad()
if rank == 1:  # leaves inside the next all-reduce, before its part of it
    def die():
        print(json.dumps(out), flush=True)
        os._exit(0)
    control.before_allreduce = die
try:
    wrapper(x).pow(2).mean().backward()  # the script's own backward: must not raise
    out["raised"] = None
except Exception as exc:
    out["raised"] = repr(exc)
caught = control.take_caught()
out["caught"] = None if caught is None else type(caught).__name__
print(json.dumps(out), flush=True)
os._exit(0)
"""


@pytest.mark.timeout(120)
def test_weights_apply_before_ddp_and_a_failed_all_reduce_is_kept() -> None:
    a, b = run_ranks(RANKS, 2)
    # the reduced gradient is the weighted sum: each member's hook ran before DDP reduced
    for g, ga, gb in zip(a["summed"], a["mine"], b["mine"], strict=True):
        assert g == pytest.approx([0.25 * x + 0.75 * y for x, y in zip(ga, gb, strict=True)])
    assert a["summed"] == b["summed"]
    # rank 1 left inside the second all-reduce: rank 0's backward returned, the failure kept
    assert a["raised"] is None and a["caught"] is not None, a
