"""Bad input to ``sharding="fsdp"`` is refused in one line that says what to change: when the
Trainer is made (no processes), and through ``tidal run`` for a world the model cannot be
sharded across."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import Home
from torch.utils.data import TensorDataset

import tidal

DATA = TensorDataset(torch.randn(8, 3))


def _trainer(model, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return tidal.Trainer(model, opt, DATA, global_batch_size=4, **kw)


def test_a_scalar_parameter_is_refused_when_the_trainer_is_made() -> None:
    model = torch.nn.Linear(3, 2)
    model.scale = torch.nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="'scale' is a scalar: .* 1-element tensor"):
        _trainer(model, sharding="fsdp")
    _trainer(model)  # DDP replicates it: fine


def test_an_unknown_sharding_and_a_grad_scaler_are_refused() -> None:
    with pytest.raises(ValueError, match="sharding must be one of"):
        _trainer(torch.nn.Linear(3, 2), sharding="zero3")
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="grad_scaler= is not supported with sharding='fsdp'"):
        _trainer(torch.nn.Linear(3, 2), sharding="fsdp", grad_scaler=scaler)


def test_sharding_alone_trains_the_module_itself() -> None:
    """Run as a plain script there is one member: nothing to shard, the same mathematics."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    for model, sharding in ((a, "fsdp"), (b, "ddp")):
        t = _trainer(model, sharding=sharding)
        for step in t.run(3):
            for (x,) in step.micro_batches():
                step.backward(t.model(x).pow(2).sum())
        assert t.full_state_dict() is not None
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


SCRIPT = """
import torch, tidal
from torch.utils.data import TensorDataset
m = torch.nn.Linear(3, 2)  # 2 rows at most: 3 workers cannot all hold a shard
t = tidal.Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), TensorDataset(torch.randn(8, 3)),
                  global_batch_size=4, sharding="fsdp")
for step in t.run(2):
    for (x,) in step.micro_batches():
        step.backward(t.model(x).sum())
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_more_workers_than_rows_fails_the_job_in_one_line(tidal_home: Home, tmp_path) -> None:
    script = tmp_path / "wide.py"
    script.write_text(SCRIPT)
    proc, job = tidal_home.run("wide", "--workers", "3", script=script, timeout=100)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "3 workers is more than the largest first dimension" in last, proc.stderr
    assert "use --max-workers 2 or fewer, or sharding='ddp'" in last
    assert job.status()["state"] == "failed"
