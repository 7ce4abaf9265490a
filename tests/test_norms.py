"""Normalisation layers that would make the result depend on the membership
(``tidal.worker.trainer.norms``): which are refused, when, and in what words."""

import pytest
import torch
from torch.utils.data import TensorDataset

import tidal
from tidal.protocol import ENV_URL, ENV_WORKER_ID
from tidal.worker.trainer import norms


def _layers() -> dict[str, torch.nn.Module]:
    return {
        "bn1d": torch.nn.BatchNorm1d(4),
        "bn2d": torch.nn.BatchNorm2d(4),
        "bn-untracked": torch.nn.BatchNorm1d(4, track_running_stats=False),
        "sync": torch.nn.SyncBatchNorm(4),
        "lazy": torch.nn.LazyBatchNorm1d(),
        "in-tracked": torch.nn.InstanceNorm1d(4, track_running_stats=True),
        "in": torch.nn.InstanceNorm1d(4),
        "gn": torch.nn.GroupNorm(2, 4),
        "ln": torch.nn.LayerNorm(4),
        "linear": torch.nn.Linear(4, 4),
    }


# Whether each layer makes the result depend on the members' shares: in training mode, in
# eval mode. A BatchNorm without running statistics still normalises with the micro-batch's.
EXPECTED = {
    "bn1d": (True, False),
    "bn2d": (True, False),
    "bn-untracked": (True, False),
    "sync": (True, False),
    "lazy": (True, False),
    "in-tracked": (True, False),
    "in": (False, False),
    "gn": (False, False),
    "ln": (False, False),
    "linear": (False, False),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_which_layers_use_batch_statistics(name):
    layer = _layers()[name]
    assert norms.uses_batch_statistics(layer.train()) is EXPECTED[name][0]
    assert norms.uses_batch_statistics(layer.eval()) is EXPECTED[name][1]
    assert bool(norms.watched(layer)) is EXPECTED[name][0]  # watched: could be, in some mode


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )


def test_check_names_the_layers_and_the_ways_out():
    with pytest.raises(norms.BatchNormRefused, match=r"^'1' normalises with each member's"):
        norms.check(_model())
    norms.check(_model().eval())  # frozen: the same running statistics on every member
    many = torch.nn.Sequential(*[torch.nn.BatchNorm1d(2) for _ in range(5)])
    line = norms.refusal([n for n, _ in norms.watched(many)])
    assert line.startswith("'0', '1', '2' and 2 more normalise with")
    assert "GroupNorm" in line and "allow_batch_norm=True" in line and "\n" not in line


def test_the_guard_refuses_a_forward_in_training_mode_only():
    model = _model().eval()
    handles = norms.guard(model)
    x = torch.randn(4, 8)
    model(x)  # eval mode: allowed
    model.train()  # a loop's model.train() un-freezes it
    with pytest.raises(norms.BatchNormRefused, match="'1' normalises"):
        model(x)
    for h in handles:
        h.remove()
    model(x)  # nothing watches it any more


def _trainer(model: torch.nn.Module, **kw) -> tidal.Trainer:
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return tidal.Trainer(model, opt, data, global_batch_size=8, device="cpu", **kw)


def test_the_trainer_refuses_batch_norm_under_tidal_run_only(monkeypatch):
    _trainer(_model())  # alone (no ``tidal run``): the world is one process, nothing changes
    monkeypatch.setenv(ENV_URL, "http://127.0.0.1:9")
    monkeypatch.setenv(ENV_WORKER_ID, "0")
    with pytest.raises(norms.BatchNormRefused, match="allow_batch_norm=True"):
        _trainer(_model())
    _trainer(_model(), allow_batch_norm=True)  # accepted, as DDP has it
    frozen = _model().eval()
    _trainer(frozen)  # frozen at construction: accepted, and guarded
    with pytest.raises(norms.BatchNormRefused):
        frozen.train()(torch.randn(4, 8))
