"""A failed step's changes to tracked tensors are undone, wherever the script made them
(``TrackedState.mark`` / ``rewind``): an EMA updated in the step body, running statistics,
a non-module object's tensors; and only what moved is copied at each mark."""

from __future__ import annotations

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tidal.tracked import AUDIT_EVERY, AUDIT_MARKS, TrackedState


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_same(module: torch.nn.Module, snap: dict[str, torch.Tensor]) -> None:
    now = module.state_dict()
    assert now.keys() == snap.keys()
    for k, v in snap.items():
        assert torch.equal(now[k], v), k


def _ema(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    ).double()
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    return model, ema


def _train_step(model: torch.nn.Module) -> None:
    """What a step does to the model: a forward in train mode (moves the BatchNorm's running
    statistics) and an SGD update."""
    model.train()
    model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None


def test_an_ema_updated_in_the_step_body_is_rewound_exactly() -> None:
    model, ema = _ema()
    tracked = TrackedState({"ema": ema})
    for _ in range(3):  # committed steps, the EMA updated in each body
        tracked.mark()
        _train_step(model)
        ema.update_parameters(model)
    before = _snapshot(ema)
    assert int(before["n_averaged"]) == 3
    mark = tracked.mark()
    _train_step(model)
    ema.update_parameters(model)  # the failed step's body
    assert not torch.equal(ema.state_dict()["module.0.weight"], before["module.0.weight"])
    assert tracked.rewind(mark) == ["ema"]
    _assert_same(ema, before)  # parameters, running stats and n_averaged, bit for bit
    # The redo and a second failure of it: the copies still hold the marked state.
    ema.update_parameters(model)
    assert tracked.rewind(mark) == ["ema"]
    _assert_same(ema, before)
    assert tracked.rewind(mark) == []  # nothing moved since: nothing rewound


def test_only_the_tensors_that_moved_are_copied_at_each_mark() -> None:
    model, ema = _ema()
    n = len(list(ema.parameters())) + len(list(ema.buffers()))
    tracked = TrackedState({"ema": ema})
    tracked.mark()
    assert tracked.last_copied == n  # the first mark copies everything once
    tracked.mark()
    assert tracked.last_copied == 0  # nothing moved
    ema.update_parameters(model)  # every parameter and buffer (use_buffers=True)
    tracked.mark()
    assert tracked.last_copied == n
    with torch.no_grad():
        ema.module[0].bias.add_(1.0)  # one tensor
    tracked.mark()
    assert tracked.last_copied == 1
    for _ in range(max(AUDIT_MARKS) + 1):  # the audited marks too: no false change
        tracked.mark()
        assert tracked.last_copied == 0


def test_a_tensor_touched_only_on_some_steps_is_rewound_on_each() -> None:
    model, ema = _ema()
    tracked = TrackedState({"ema": ema})
    ema.update_parameters(model)
    for step in range(12):
        touched = step % 3 == 1
        before = _snapshot(ema)
        mark = tracked.mark()
        if touched:
            _train_step(model)
            ema.update_parameters(model)
        # Every other step fails: some that touched the EMA, some that did not.
        if step % 2 == 0:
            assert tracked.rewind(mark) == (["ema"] if touched else [])
            _assert_same(ema, before)


def test_running_statistics_of_a_tracked_module_are_rewound() -> None:
    bn = torch.nn.BatchNorm1d(3).double()  # the buffers move in every forward in train mode
    tracked = TrackedState({"bn": bn})
    bn(torch.randn(6, 3, dtype=torch.float64))
    for _ in range(max(AUDIT_MARKS) + 1):  # steps that leave it: its copies grow old
        tracked.mark()
    before = _snapshot(bn)
    mark = tracked.mark()
    assert tracked.last_copied == 0
    bn(torch.randn(6, 3, dtype=torch.float64))
    assert int(bn.num_batches_tracked) == 2
    assert tracked.rewind(mark) == ["bn"]
    _assert_same(bn, before)
    assert int(bn.num_batches_tracked) == 1


def test_a_buffer_the_script_replaces_is_rewound() -> None:
    bn = torch.nn.BatchNorm1d(3).double()
    tracked = TrackedState({"bn": bn})
    before = _snapshot(bn)
    mark = tracked.mark()
    bn.running_mean = bn.running_mean + 1.0  # a new tensor in the slot, not in place
    assert tracked.rewind(mark) == ["bn"]
    _assert_same(bn, before)
    mark = tracked.mark()
    assert tracked.last_copied == 0  # the copy-back made the slot's tensor equal its copy
    assert tracked.rewind(mark) == []


class Stats:
    """A non-module object whose state holds tensors. ``fresh``: its ``state_dict`` hands
    out new tensors at every call (clones), as many user classes do."""

    def __init__(self, fresh: bool) -> None:
        self.fresh = fresh
        self.total = torch.zeros(3, dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.int64)
        self.seen = 0

    def state_dict(self) -> dict:
        out = {"total": self.total, "count": self.count, "seen": self.seen}
        if self.fresh:
            out |= {"total": self.total.clone(), "count": self.count.clone()}
        return out

    def load_state_dict(self, state: dict) -> None:
        self.total, self.count, self.seen = state["total"], state["count"], state["seen"]

    def add(self, x: torch.Tensor) -> None:
        self.total += x  # in place
        self.count += 1
        self.seen += 1


@pytest.mark.parametrize("fresh", [False, True])
def test_a_non_module_object_with_tensors_is_rewound(fresh: bool) -> None:
    stats = Stats(fresh)
    tracked = TrackedState({"stats": stats})
    stats.add(torch.ones(3, dtype=torch.float64))
    tracked.mark()
    stats.add(torch.full((3,), 2.0, dtype=torch.float64))  # committed
    mark = tracked.mark()
    assert tracked.last_copied == 2  # both tensors moved (or are new clones)
    stats.add(torch.full((3,), 5.0, dtype=torch.float64))  # the failed step
    assert tracked.rewind(mark) == ["stats"]
    assert stats.total.tolist() == [3.0, 3.0, 3.0] and int(stats.count) == 2 and stats.seen == 2
    # The object keeps what it was given: a clone, not the copy that the next rewind needs.
    stats.add(torch.full((3,), 7.0, dtype=torch.float64))
    assert tracked.rewind(mark) == ["stats"]
    assert stats.total.tolist() == [3.0, 3.0, 3.0] and int(stats.count) == 2
    tracked.mark()
    assert tracked.last_copied == 2  # the rewind gave it new tensors
    tracked.mark()
    # The same tensors at every call: unmoved, not copied again; new clones: copied.
    assert tracked.last_copied == (2 if fresh else 0)


def test_a_change_through_data_is_seen_at_the_first_steps_and_rewound() -> None:
    model, ema = _ema()
    tracked = TrackedState({"ema": ema})
    weight = ema.module[0].weight

    def update() -> None:  # an old-style EMA: through .data, no version bump
        weight.data.mul_(0.5)

    tracked.mark()
    for _ in range(max(AUDIT_MARKS)):
        update()
        tracked.mark()
    before = _snapshot(ema)
    mark = tracked.mark()
    assert tracked.last_copied == 1  # that tensor is copied at every mark now
    update()
    assert tracked.rewind(mark) == ["ema"]
    _assert_same(ema, before)


def test_a_change_through_data_in_the_first_step_is_rewound() -> None:
    _, ema = _ema()
    tracked = TrackedState({"ema": ema})
    before = _snapshot(ema)
    mark = tracked.mark()  # every copy taken at this mark: a difference is the step's
    ema.module[2].bias.data.add_(1.0)
    assert tracked.rewind(mark) == ["ema"]
    _assert_same(ema, before)
    tracked.mark()
    assert tracked.last_copied == 1  # copied at every mark from now on


def test_a_change_through_data_after_the_first_steps_is_refused_naming_the_tensor() -> None:
    _, ema = _ema()
    tracked = TrackedState({"ema": ema})
    for _ in range(max(AUDIT_MARKS) + 1):
        tracked.mark()
    mark = tracked.mark()
    ema.module[2].bias.data.add_(1.0)
    with pytest.raises(RuntimeError, match=r"'ema': module\.2\.bias changed without its version"):
        tracked.rewind(mark)


def test_a_change_through_data_that_starts_later_is_found_by_a_periodic_audit() -> None:
    _, ema = _ema()
    tracked = TrackedState({"ema": ema})
    for _ in range(AUDIT_EVERY - 1):
        tracked.mark()
    ema.module[2].bias.data.add_(1.0)  # from step AUDIT_EVERY - 1 on, every step
    tracked.mark()  # mark AUDIT_EVERY: audited
    assert tracked.last_copied == 1
    before = _snapshot(ema)
    mark = tracked.mark()
    assert tracked.last_copied == 1  # copied at every mark now
    ema.module[2].bias.data.add_(1.0)
    assert tracked.rewind(mark) == ["ema"]
    _assert_same(ema, before)


def test_a_change_through_data_in_a_step_that_an_audit_marked_is_rewound() -> None:
    _, ema = _ema()
    tracked = TrackedState({"ema": ema})
    for _ in range(AUDIT_EVERY - 1):
        tracked.mark()
    before = _snapshot(ema)
    mark = tracked.mark()  # audited: every copy is known to be this mark's
    ema.module[0].weight.data.mul_(2.0)
    assert tracked.rewind(mark) == ["ema"]
    _assert_same(ema, before)


def test_only_the_latest_mark_can_be_rewound_to() -> None:
    tracked = TrackedState({"bn": torch.nn.BatchNorm1d(2)})
    old = tracked.mark()
    tracked.mark()
    with pytest.raises(ValueError, match="latest"):
        tracked.rewind(old)


def test_the_bench_row_times_a_loop_whose_marks_copy_the_ema() -> None:
    """``tracked_copy_overhead`` measures what it says: every mark of its loop copies the
    EMA's parameters and ``n_averaged`` (the body moved them), nothing else. No speed is
    asserted."""
    import math

    from bench.tracked_copy import DEPTH, measure

    res = measure(steps=4)
    assert res["copied_per_mark"] == 2 * (DEPTH + 1) + 1
    assert res["copied_bytes_per_mark"] > 4 * 32 * 256
    for key in ("tidal", "peer", "mark_s_p50"):
        assert math.isfinite(res[key]) and res[key] > 0, res
