"""Tracked state without processes: what is carried, what is refused, what a failed step
rewinds (``tidal.tracked``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tidal.tracked import TrackedState, UnsupportedState, flatten, unflatten


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.history: list[float] = []

    def state_dict(self) -> dict:
        return {"n": self.n, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.n, self.history = state["n"], list(state["history"])


def _objects(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    counter = Counter()
    return model, opt, {"lr_scheduler": sched, "grad_scaler": scaler, "ema": ema, "c": counter}


def _advance(model, opt, objs, steps: int) -> None:
    for _ in range(steps):
        objs["grad_scaler"].scale(model(torch.randn(2, 4).double()).sum()).backward()
        objs["grad_scaler"].step(opt)
        objs["grad_scaler"].update()
        opt.zero_grad()
        objs["lr_scheduler"].step()
        objs["ema"].update_parameters(model)
        objs["c"].n += 1
        objs["c"].history.append(float("nan") if objs["c"].n == 2 else 0.5 * objs["c"].n)


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        3,
        -2.5,
        "s",
        [1, (2, 3), {"a": [4.0]}],
        {0: "int key", 1: (None,)},
        {"__tensor__": 1, "x": 2},  # looks like a tag: written as pairs
        {"f": [float("inf"), float("-inf")]},
        (torch.arange(3.0), {"t": torch.ones(2, 2, dtype=torch.float64)}),
    ],
)
def test_flatten_round_trips_through_json(value) -> None:
    tensors: list[torch.Tensor] = []
    skeleton = json.loads(json.dumps(flatten(value, tensors)))
    back = unflatten(skeleton, tensors)
    assert repr(back) == repr(value)


def test_nan_round_trips() -> None:
    tensors: list[torch.Tensor] = []
    back = unflatten(json.loads(json.dumps(flatten([float("nan")], tensors))), tensors)
    assert math.isnan(back[0])


@pytest.mark.parametrize("bad", [lambda: 1, object(), {1.5: "float key ok"}, {"x": {"y": set()}}])
def test_values_that_need_pickle_are_refused_naming_the_path(bad) -> None:
    if isinstance(bad, dict) and 1.5 in bad:  # float keys are plain values: allowed
        assert unflatten(flatten(bad, []), []) == bad
        return
    with pytest.raises(UnsupportedState, match="cannot be saved without pickle"):
        flatten(bad, [], "obj")


def test_a_tracked_object_whose_state_needs_pickle_is_refused_at_once() -> None:
    class Bad:
        def state_dict(self):
            return {"fn": print}

        def load_state_dict(self, s):
            pass

    with pytest.raises(UnsupportedState, match=r"tracked state bad\['fn'\] is a builtin"):
        TrackedState({"bad": Bad()}).check()
    with pytest.raises(ValueError, match="has no state_dict"):
        TrackedState({"x": object()})


def test_capture_and_restore_carry_every_object_exactly() -> None:
    model_a, opt_a, a = _objects(0)
    _advance(model_a, opt_a, a, 5)
    model_b, opt_b, b = _objects(1)
    cap = TrackedState(a).capture()
    wire = json.loads(cap.to_json())  # what travels in a heal blob
    # A receiver allocates from the layout alone, then the tensors arrive into it.
    received = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in wire["tensors"]]
    for dst, src in zip(received, cap.tensors, strict=True):
        dst.copy_(src)
    assert len(received) == 3  # the EMA's n_averaged, weight and bias; the rest is JSON
    TrackedState(b).restore(wire["skeleton"], received)
    assert b["lr_scheduler"].state_dict() == a["lr_scheduler"].state_dict()
    assert b["grad_scaler"].state_dict() == a["grad_scaler"].state_dict()
    for x, y in zip(b["ema"].state_dict().values(), a["ema"].state_dict().values(), strict=True):
        assert torch.equal(x, y)
    assert b["c"].n == 5 and repr(b["c"].history) == repr(a["c"].history)


def test_restore_refuses_other_names() -> None:
    _, _, a = _objects(0)
    cap = TrackedState({"c": a["c"]}).capture()
    with pytest.raises(ValueError, match="holds \\['c'\\] but this Trainer tracks"):
        TrackedState({"c": a["c"], "ema": a["ema"]}).restore(cap.skeleton, cap.tensors)


def test_rewind_undoes_what_a_failed_step_did() -> None:
    model, opt, objs = _objects(0)
    _advance(model, opt, objs, 3)
    tracked = TrackedState(objs)
    before = {k: repr(v.state_dict()) for k, v in objs.items() if k != "ema"}
    mark = tracked.mark()
    objs["c"].n += 10  # the user's counter moved inside the step
    objs["lr_scheduler"].step()  # and a scheduler stepped
    assert sorted(tracked.rewind(mark)) == ["c", "lr_scheduler"]
    assert {k: repr(v.state_dict()) for k, v in objs.items() if k != "ema"} == before
    assert tracked.rewind(tracked.mark()) == []  # nothing moved: nothing rewound
    # Tensors changed in place: tests/test_tracked_rewind.py.


def _trainer(**kw):
    import tidal

    model, opt, _ = _objects(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4).double())
    return tidal.Trainer(model, opt, data, global_batch_size=4, **kw)


class _Unsaveable:
    def state_dict(self):
        return {"callback": print}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"state": {"x": _Unsaveable()}}, UnsupportedState, r"x\['callback'\]"),
        ({"state": {"lr_scheduler": Counter()}}, ValueError, "lr_scheduler= and grad_scaler="),
        ({"state": {"": Counter()}}, ValueError, "non-empty"),
        ({"clip_grad_norm": -1.0}, ValueError, "clip_grad_norm"),
        ({"clip_grad_norm": float("nan")}, ValueError, "clip_grad_norm"),
        ({"grad_scaler": object()}, ValueError, "GradScaler"),
        ({"lr_scheduler": 3}, ValueError, "step()"),
    ],
)
def test_the_trainer_refuses_what_it_cannot_carry_when_it_is_made(kw, error, match) -> None:
    with pytest.raises(error, match=match):
        _trainer(**kw)


def test_a_trainer_alone_applies_scaler_clip_scheduler_and_hooks_once_per_step() -> None:
    model, opt, objs = _objects(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4).double())
    import tidal

    trainer = tidal.Trainer(
        model,
        opt,
        data,
        global_batch_size=8,
        micro_batch_size=4,
        lr_scheduler=objs["lr_scheduler"],
        grad_scaler=objs["grad_scaler"],
        clip_grad_norm=1e-3,
        state={"c": objs["c"]},
    )
    seen = []
    trainer.after_step(seen.append)
    norms = []
    for step in trainer.run(max_steps=3):
        for (x,) in step.micro_batches():
            step.backward(trainer.model(x).pow(2).sum())
        norms.append([p.detach().clone() for p in model.parameters()])
    assert seen == [0, 1, 2]
    assert objs["lr_scheduler"].last_epoch == 3
    assert objs["grad_scaler"].state_dict()["_growth_tracker"] == 3
    # The last step: gradients clipped to norm 1e-3, lr 0.1 / (1 + 2): the update is at most
    # 1e-3 * 0.1 / 3 (unclipped, these gradients are of order 1).
    moved = torch.cat(
        [(a - b).flatten() for a, b in zip(model.parameters(), norms[-1], strict=True)]
    )
    assert 0 < moved.norm() <= 1e-3 * 0.1 / 3 * (1 + 1e-9)


def test_full_state_dict_is_a_copy_of_the_model_on_rank_0() -> None:
    trainer = _trainer()
    for step in trainer.run(max_steps=1):
        for (x,) in step.micro_batches():
            step.backward(trainer.model(x).sum())
    full = trainer.full_state_dict()
    assert full.keys() == trainer.module.state_dict().keys()
    for name, t in trainer.module.state_dict().items():
        assert torch.equal(full[name], t) and full[name].data_ptr() != t.data_ptr()
