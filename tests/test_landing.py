"""Landing space for a heal (``tidal.worker.state.landing``): prepared without touching anything
the job carries, shaped like the state one optimizer step makes, handed out by shape."""

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from tidal.worker.state.landing import Landing, prepare, state_tensors


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.5),
    ],
    ids=["sgd", "adam", "adamw"],
)
def test_prepare_makes_one_steps_state_and_touches_nothing_the_job_carries(make):
    m = _model()
    opt = make(m.parameters())
    fired = []
    opt.register_step_pre_hook(lambda *a: fired.append("pre"))
    opt.register_step_post_hook(lambda *a: fired.append("post"))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    params = [p.detach().clone() for p in m.parameters()]
    rng = torch.get_rng_state()
    hook = register_optimizer_step_post_hook(lambda *a: fired.append("global"))
    try:
        land = prepare(opt)
    finally:
        hook.remove()
    # Nothing the job carries moved: parameters, gradients, state, hooks, schedule, RNG.
    assert all(torch.equal(a, p) for a, p in zip(params, m.parameters(), strict=True))
    assert all(p.grad is None for p in m.parameters())
    assert not opt.state and fired == [] and sched.last_epoch == 0
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0]
    assert torch.equal(torch.get_rng_state(), rng)
    # The landing is what one real step makes: same shapes and dtypes, in the same order.
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    real = state_tensors(opt.state_dict())
    assert [(t.shape, t.dtype) for t in land] == [(t.shape, t.dtype) for t in real]
    assert {t.data_ptr() for t in land}.isdisjoint(t.data_ptr() for t in real)


def test_an_optimizer_with_state_or_that_needs_a_closure_gets_none():
    m = _model()
    assert prepare(torch.optim.LBFGS(m.parameters())) == []  # step() needs a closure
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    assert prepare(opt) == []  # its own state is its landing


def test_landing_hands_each_tensor_out_once_by_shape_and_dtype():
    a, b = torch.zeros(4, 2), torch.zeros(4, 2)
    land = Landing([a, b, torch.zeros(3, dtype=torch.float64)])
    first, second, third = (land.take([4, 2], "float32") for _ in range(3))
    assert {first.data_ptr(), second.data_ptr()} == {a.data_ptr(), b.data_ptr()}
    assert third.data_ptr() not in {a.data_ptr(), b.data_ptr()} and third.shape == (4, 2)
    other = land.take([3], "float32")  # the float64 one does not fit a float32 slot
    assert other.dtype == torch.float32
    assert land.take([3], "float64").dtype == torch.float64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_landing_for_parameters_on_a_gpu():
    # A second copy of the state on the device could exhaust it; the same optimizer on the
    # CPU gets its landing.
    on_gpu = _model().cuda()
    assert prepare(torch.optim.SGD(on_gpu.parameters(), lr=0.1, momentum=0.9)) == []
    assert prepare(torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)) != []
