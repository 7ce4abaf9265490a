"""Scripts written the way plain PyTorch loops are written: each trap that would change the
mathematics without a word is refused when the Trainer is made or at the first step, in
one line naming the fix (issue 49). Training alone (no ``tidal run``) takes the same checks;
the refusals that need a real group (a forward that bypassed the DDP wrapper) are in
``test_script_traps_e2e.py``."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import tidal
from tidal.worker.batches.sampler import ElasticSampler
from tidal.worker.trainer.step import item_count
from tidal.worker.trainer.update import BackwardBypassed, ScalerCallRefused


def _setup(n: int = 32):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, 4, generator=g).double(), torch.randn(n, 2, generator=g))
    return model, opt, data


def _train(trainer, steps=2, *, bare=False, loss_fn=None):
    for step in trainer.run(steps):
        for x, y in step.micro_batches():
            loss = torch.nn.functional.mse_loss(trainer.model(x), y.double())
            if bare:
                loss.backward()
            else:
                step.backward(loss if loss_fn is None else loss_fn(loss))


def test_a_bare_loss_backward_is_refused_at_the_first_step():
    model, opt, data = _setup()
    trainer = tidal.Trainer(model, opt, data, global_batch_size=8)
    before = model.weight.detach().clone()
    with pytest.raises(BackwardBypassed, match=r"step 0 .* call step.backward\(loss\)"):
        _train(trainer, bare=True)
    assert trainer.step == 0 and torch.equal(model.weight, before)  # nothing applied


def test_the_scripts_own_scaler_calls_are_refused():
    model, opt, data = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    trainer = tidal.Trainer(model, opt, data, global_batch_size=8, grad_scaler=scaler)
    with pytest.raises(ScalerCallRefused, match=r"grad_scaler.scale\(\).*unscaled loss"):
        _train(trainer, loss_fn=scaler.scale)  # the leftover scaler.scale(loss)
    assert trainer.step == 0
    for call, fix in (("update", "updates the scale"), ("unscale_", "clip_grad_norm=")):
        with pytest.raises(ScalerCallRefused, match=fix):
            getattr(scaler, call)(*((opt,) if call == "unscale_" else ()))


def test_the_trainers_own_scaling_still_trains():
    """The guard leaves the Trainer's own use whole: the same result as the unscaled run."""
    results = []
    for scaled in (False, True):
        model, opt, data = _setup()
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
        _train(tidal.Trainer(model, opt, data, global_batch_size=8, grad_scaler=scaler), 4)
        results.append(model.weight.detach().clone())
        if scaled:
            assert scaler.get_scale() == 1024.0  # no inf: never backed off
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("loader_kwargs", "match"),
    [
        ({"batch_size": 5}, r"batch_size=5 would be ignored.*micro_batch_size=5"),
        ({"batch_sampler": [[0, 1]]}, r"batch_sampler \(list\)"),
        ("distributed", r"sampler \(DistributedSampler\) would be ignored"),
    ],
)
def test_a_dataloaders_batching_that_would_be_ignored_is_refused(loader_kwargs, match):
    model, opt, data = _setup()
    if loader_kwargs == "distributed":
        loader_kwargs = {
            "batch_size": 8,
            "sampler": DistributedSampler(data, num_replicas=2, rank=0),
        }
    loader = DataLoader(data, **loader_kwargs)
    with pytest.raises(ValueError, match=match):
        tidal.Trainer(model, opt, loader, global_batch_size=8)


@pytest.mark.parametrize("size", [1, 8, 4])  # DataLoader's default, the global, the micro
def test_a_dataloader_batch_size_that_agrees_is_taken(size):
    model, opt, data = _setup()
    loader = DataLoader(data, batch_size=size, shuffle=True)
    tidal.Trainer(model, opt, loader, global_batch_size=8, micro_batch_size=4)


def test_a_tracked_module_on_another_device_is_refused():
    model, opt, data = _setup()
    ema = torch.optim.swa_utils.AveragedModel(model, device="meta")  # not the model's device
    with pytest.raises(ValueError, match=r"tracked state 'ema' .* is on meta but the model"):
        tidal.Trainer(model, opt, data, global_batch_size=8, state={"ema": ema}, device="cpu")


def test_a_scheduler_that_needs_a_metric_is_refused():
    model, opt, data = _setup()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau.step\(\) needs an argument"):
        tidal.Trainer(model, opt, data, global_batch_size=8, lr_scheduler=plateau)


@pytest.mark.parametrize(
    ("items", "ok"),
    [
        (3, 3.0),
        (0, 0.0),
        (torch.tensor(5), 5.0),
        (4.0, 4.0),
        (-1, None),
        (2.5, None),
        (True, None),
        (torch.ones(2), None),
        ("3", None),
        (float("nan"), None),
    ],
)
def test_item_counts(items, ok):
    if ok is None:
        with pytest.raises(ValueError, match="items="):
            item_count(items)
    else:
        assert item_count(items) == ok


def test_items_on_some_micro_batches_only_is_refused():
    model, opt, data = _setup()
    trainer = tidal.Trainer(model, opt, data, global_batch_size=8, micro_batch_size=4)
    with pytest.raises(ValueError, match="on some micro-batches of a step but not on others"):
        for step in trainer.run(1):
            for i, (x, y) in enumerate(step.micro_batches()):
                loss = torch.nn.functional.mse_loss(trainer.model(x), y.double(), reduction="sum")
                step.backward(loss, **({"items": len(x)} if i == 1 else {}))


def test_item_sums_give_the_global_item_mean_at_any_split():
    """Alone, ``items=`` over 1, 2 and 4 micro-batches: the same update as one process's
    global mean over the counted items (ragged: each sample counts a different number)."""
    counts = torch.arange(32) % 5  # 0..4 items per sample: some samples count nothing

    def loss_sum(out, y, idx):
        per = ((out - y.double()) ** 2).sum(1)  # a per-sample loss, weighted by its items
        return (per * counts[idx].double()).sum(), int(counts[idx].sum())

    finals = {}
    for micro in (8, 4, 2):
        model, opt, data = _setup()
        ids = TensorDataset(*data.tensors, torch.arange(32))
        trainer = tidal.Trainer(model, opt, ids, global_batch_size=8, micro_batch_size=micro)
        for step in trainer.run(4):
            for x, y, idx in step.micro_batches():
                total, n = loss_sum(trainer.model(x), y, idx)
                step.backward(total, items=n)
        finals[micro] = model.weight.detach().clone()
    # the reference: a plain loop, one process, the global batch's loss sum over its count
    model, opt, data = _setup()
    order = ElasticSampler(dataset_size=32, global_batch_size=8, seed=0)
    for s in range(4):
        idx = order.shard(s, 0, 1)
        total, n = loss_sum(model(data.tensors[0][idx]), data.tensors[1][idx], idx)
        opt.zero_grad()
        (total / n).backward()
        opt.step()
    for micro, w in finals.items():
        torch.testing.assert_close(w, model.weight.detach(), rtol=1e-12, atol=0, msg=str(micro))
    assert not torch.allclose(finals[8], _per_sample_mean_final(loss_sum), rtol=1e-3)


def _per_sample_mean_final(loss_sum):
    """The same data with each micro-batch's item mean weighted by its samples (the form
    that depends on the split), at 2 samples per micro-batch."""
    model, opt, data = _setup()
    ids = TensorDataset(*data.tensors, torch.arange(32))
    trainer = tidal.Trainer(model, opt, ids, global_batch_size=8, micro_batch_size=2)
    for step in trainer.run(4):
        for x, y, idx in step.micro_batches():
            total, n = loss_sum(trainer.model(x), y, idx)
            step.backward(total / max(n, 1))
    return model.weight.detach().clone()


@pytest.mark.parametrize("clip", [None, 0.01])
def test_grad_norm_is_the_committed_steps_norm_before_clipping(clip):
    model, opt, data = _setup()
    x, y = data.tensors
    trainer = tidal.Trainer(model, opt, data, global_batch_size=8, clip_grad_norm=clip)
    assert trainer.grad_norm is None  # no step yet (and, unclipped, measured from now on)
    idx = trainer.sampler.shard(0, 0, 1)
    grads = torch.autograd.grad(
        torch.nn.functional.mse_loss(model(x[idx]), y[idx].double()), list(model.parameters())
    )
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
    _train(trainer, 1)
    assert trainer.grad_norm == pytest.approx(expected, rel=1e-12)
    assert expected > 0.01  # so the clipped run did clip: the norm is still the pre-clip one


def test_an_unclipped_norm_nobody_reads_is_never_measured():
    model, opt, data = _setup()
    trainer = tidal.Trainer(model, opt, data, global_batch_size=8)
    _train(trainer, 1)
    assert trainer._parts.update.grad_norm is None  # no pass over the gradients was paid
    assert trainer.grad_norm is None  # the first read turns it on ...
    _train(trainer, 2)
    assert trainer.grad_norm > 0  # ... for the steps after it
