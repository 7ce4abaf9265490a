"""The optimizer is stepped by the Trainer only (``tidal.worker.trainer.update``): a script that still
calls ``optimizer.step()`` is refused at that call, not left to step with unsynchronised or
doubled gradients."""

import copy

import pytest
import torch
from torch.utils.data import TensorDataset

import tidal
from tidal.worker.state import landing
from tidal.worker.trainer.update import OptimizerStepRefused, SchedulerStepRefused, Update


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def test_a_step_the_update_did_not_start_is_refused():
    model, opt = _model_and_opt()
    update = Update(optimizer=opt)
    model(torch.ones(3, 4)).sum().backward()
    with pytest.raises(OptimizerStepRefused, match=r"the script called optimizer.step\(\)"):
        opt.step()
    before = model.weight.detach().clone()
    update.apply(0)  # the Trainer's step: allowed, and applied
    assert not torch.equal(model.weight, before)
    with pytest.raises(OptimizerStepRefused):
        opt.step()  # and refused again after it


def test_two_updates_of_one_optimizer_share_one_guard():
    model, opt = _model_and_opt()
    first, second = Update(optimizer=opt), Update(optimizer=opt)
    assert len(opt._optimizer_step_pre_hooks) == 1
    model(torch.ones(3, 4)).sum().backward()
    second.apply(0)
    model(torch.ones(3, 4)).sum().backward()
    first.apply(1)


def test_a_refused_setting_leaves_the_optimizer_unguarded():
    _, opt = _model_and_opt()
    with pytest.raises(ValueError, match="clip_grad_norm"):
        Update(optimizer=opt, clip_grad_norm=-1.0)
    assert not opt._optimizer_step_pre_hooks


def test_a_copy_of_the_optimizer_is_unguarded_and_the_landing_still_steps_one():
    _, opt = _model_and_opt()
    Update(optimizer=opt)
    twin = copy.deepcopy(opt)  # an optimizer's copy holds its state, not its hooks
    assert not twin._optimizer_step_pre_hooks and opt._optimizer_step_pre_hooks
    # Adam: step, exp_avg, exp_avg_sq of the weight, then of the bias
    assert [tuple(t.shape) for t in landing.prepare(opt)] == [(), (2, 4), (2, 4), (), (2,), (2,)]


def test_a_loop_that_steps_the_optimizer_itself_fails_at_that_call():
    model, opt = _model_and_opt()
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    trainer = tidal.Trainer(model, opt, data, global_batch_size=8, device="cpu")
    with pytest.raises(OptimizerStepRefused):
        for step in trainer.run(2):
            for x, y in step.micro_batches():
                step.backward(torch.nn.functional.mse_loss(trainer.model(x), y))
                opt.step()  # left over from the plain loop


def _step_backward(update, model):
    """A micro-batch's backward as ``step.backward`` makes it (counted by the update)."""
    model(torch.ones(3, 4)).sum().backward()
    update.backwards = (update.backwards or 0) + 1


def _scheduled():
    model, opt = _model_and_opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched, Update(optimizer=opt, lr_scheduler=sched)


def test_a_scheduler_step_the_script_made_is_refused_at_the_steps_end():
    model, opt, sched, update = _scheduled()
    update.begin()
    _step_backward(update, model)
    update.apply(0)  # the Trainer's own scheduler step: fine
    assert sched.last_epoch == 1
    update.begin()
    _step_backward(update, model)
    sched.step()  # the script's, e.g. once per micro-batch
    before = model.weight.detach().clone()
    with pytest.raises(
        SchedulerStepRefused, match=r"during step 1 \(its last_epoch went from 1 to 2\)"
    ):
        update.apply(1)
    assert torch.equal(model.weight, before)  # refused before anything was applied


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_a_loop_that_steps_the_scheduler_itself_fails():
    model, opt = _model_and_opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    trainer = tidal.Trainer(model, opt, data, global_batch_size=8, lr_scheduler=sched)
    with pytest.raises(SchedulerStepRefused):
        for step in trainer.run(2):
            for x, y in step.micro_batches():
                step.backward(torch.nn.functional.mse_loss(trainer.model(x), y))
            sched.step()  # left over from the plain loop
    assert trainer.step == 0
