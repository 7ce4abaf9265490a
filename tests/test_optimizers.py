"""More than one optimizer carried as one (``tidal.worker.trainer.optimizers``): the standard state
layout, numbered across them, through a real checkpoint on disk and back; a parameter in two
of them, and each one's own ``step()`` in the script, refused. A GAN through resizes and a
kill: ``test_script_forms_e2e.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import tidal
from tidal.checkpoint import store
from tidal.worker.trainer.optimizers import Optimizers, combine
from tidal.worker.trainer.update import OptimizerStepRefused


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    g, d = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    model = torch.nn.ModuleDict({"g": g, "d": d})
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-2)
    opt_d = torch.optim.SGD(
        [{"params": [d.weight]}, {"params": [d.bias], "lr": 0.5}], lr=0.1, momentum=0.9
    )
    return model, opt_g, opt_d


def _train_once(model, both) -> None:
    loss = model["d"](model["g"](torch.randn(4, 3))).sum()
    loss.backward()
    both.step()
    both.zero_grad()


def test_the_state_is_the_standard_layout_numbered_across_the_optimizers():
    model, opt_g, opt_d = _pair()
    both = Optimizers([opt_g, opt_d])
    _train_once(model, both)
    sd = both.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2], [3]]
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # Adam's
    assert set(sd["state"][3]) == {"momentum_buffer"}  # SGD's
    assert both.kind == "Optimizers(Adam, SGD)" and len(both.param_groups) == 3


def test_a_checkpoint_carries_every_optimizers_state(tmp_path):
    model, opt_g, opt_d = _pair()
    both = Optimizers([opt_g, opt_d])
    _train_once(model, both)
    written = store.write(
        store.take_snapshot(step=1, module=model, optimizer=both, meta={}), tmp_path
    )
    model2, opt_g2, opt_d2 = _pair(seed=1)
    store.load(Path(written.path), model2, Optimizers([opt_g2, opt_d2]))
    for a, b in ((opt_g, opt_g2), (opt_d, opt_d2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        for pid, entries in sa["state"].items():
            for key, value in entries.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][pid][key]))


def test_a_state_of_other_optimizers_is_refused():
    model, opt_g, opt_d = _pair()
    sd = Optimizers([opt_g, opt_d]).state_dict()
    with pytest.raises(ValueError, match="3 parameter groups, these optimizers 1"):
        Optimizers([opt_g]).load_state_dict(sd)


def test_a_parameter_in_two_optimizers_is_refused():
    model, opt_g, _ = _pair()
    again = torch.optim.SGD(model["g"].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="a parameter is in two of the optimizers"):
        Optimizers([opt_g, again])
    with pytest.raises(ValueError, match="non-empty list"):
        Optimizers([])
    assert combine([opt_g]) is opt_g and combine(opt_g) is opt_g


def test_each_optimizers_own_step_in_the_script_is_refused():
    model, opt_g, opt_d = _pair()
    data = TensorDataset(torch.randn(8, 3))
    trainer = tidal.Trainer(model, [opt_g, opt_d], data, global_batch_size=4)
    with pytest.raises(OptimizerStepRefused, match=r"called optimizer.step\(\)"):
        for step in trainer.run(2):
            for (x,) in step.micro_batches():
                step.backward(model["d"](model["g"](x)).mean())
            opt_d.step()  # left over from a plain GAN loop
            raise AssertionError("the script's step was not refused")
