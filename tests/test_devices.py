"""The device and backend rules (``tidal.devices``), as tables; moving batches and modules."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

from tidal import devices
from tidal.devices import resolve_comm, resolve_device, wire_device

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("requested", "cuda", "expected"),
    [
        (None, False, "cpu"),
        ("cpu", False, "cpu"),
        ("cpu", True, "cpu"),
        (torch.device("cpu"), False, "cpu"),
    ],
)
def test_device_rule(requested, cuda, expected):
    assert resolve_device(requested, cuda_available=cuda) == torch.device(expected)


@pytest.mark.parametrize(
    ("requested", "fix"),
    [
        ("cuda", "no CUDA device"),
        ("cuda:1", "no CUDA device"),
        ("nope", "not a torch device"),
        ("meta", "'cpu' or 'cuda'"),
    ],
)
def test_device_refusals_name_the_fix(requested, fix):
    with pytest.raises(ValueError, match=fix):
        resolve_device(requested, cuda_available=False)


@pytest.mark.parametrize(
    ("comm", "device", "backend"),
    [
        ("auto", "cpu", "gloo"),
        ("auto", "cuda:0", "nccl"),
        ("gloo", "cpu", "gloo"),
        ("gloo", "cuda:0", "gloo"),
        ("nccl", "cuda:0", "nccl"),
    ],
)
def test_comm_rule(comm, device, backend):
    assert resolve_comm(comm, torch.device(device)) == backend


def test_nccl_on_the_cpu_and_unknown_backends_are_refused():
    with pytest.raises(ValueError, match="--comm nccl needs a CUDA device.*use --comm gloo"):
        resolve_comm("nccl", CPU)
    with pytest.raises(ValueError, match="one of auto, nccl, gloo"):
        resolve_comm("mpi", CPU)


@pytest.mark.parametrize(
    ("backend", "device", "wire"),
    [("gloo", "cpu", "cpu"), ("gloo", "cuda:0", "cpu"), ("nccl", "cuda:0", "cuda:0")],
)
def test_wire_device_rule(backend, device, wire):
    assert wire_device(backend, torch.device(device)) == torch.device(wire)


Pair = namedtuple("Pair", "x y")


class Moves:
    def __init__(self) -> None:
        self.to_called_with = None

    def to(self, device):
        self.to_called_with = device
        return self


def test_batches_move_with_their_structure(device):
    dev = torch.device(device)
    moved = devices.to_device(
        {
            "a": torch.ones(2),
            "b": [torch.zeros(1), (torch.ones(1), 3)],
            "c": Pair(torch.ones(1), "text"),
            "d": OrderedDict(e=torch.ones(1)),
        },
        dev,
    )
    assert isinstance(moved["c"], Pair) and moved["c"].y == "text"
    assert isinstance(moved["b"], list) and isinstance(moved["b"][1], tuple)
    assert moved["b"][1][1] == 3 and isinstance(moved["d"], OrderedDict)
    tensors = [moved["a"], moved["b"][0], moved["b"][1][0], moved["c"].x, moved["d"]["e"]]
    assert all(t.device.type == dev.type for t in tensors)
    obj = Moves()
    assert devices.to_device(obj, dev) is obj and obj.to_called_with == dev


def test_a_tensor_already_there_is_not_copied(device):
    t = torch.ones(3, device=device)
    assert devices.to_device(t, t.device) is t


def test_place_module_keeps_the_optimizers_parameters(device):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    devices.place_module(model, opt, torch.device(device))
    assert [p.device.type for p in model.parameters()] == [device, device]
    assert opt.param_groups[0]["params"][0] is model.weight  # the optimizer steps the model


def test_a_move_that_replaces_parameters_is_refused():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="before building the optimizer"):
        devices.place_module(model, opt, torch.device("meta"))  # meta cannot take .data


def test_optimizer_state_elsewhere_is_refused():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.state[model.weight]["momentum_buffer"] = torch.zeros(2, 3, device="meta")
    with pytest.raises(ValueError, match="already holds state on meta"):
        devices.place_module(model, opt, CPU)


def test_trainer_trains_on_the_device_it_was_given(device):
    import tidal

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [
        (torch.randn(4, dtype=torch.float64), torch.randn(1, dtype=torch.float64))
        for _ in range(16)
    ]
    trainer = tidal.Trainer(model, opt, data, global_batch_size=8, seed=0, device=device)
    assert trainer.device.type == device and model.weight.device.type == device
    seen = set()
    for step in trainer.run(max_steps=3):
        for x, y in step.micro_batches():
            seen.add(x.device.type)
            step.backward(torch.nn.functional.mse_loss(trainer.model(x), y))
    assert seen == {device} and trainer.step == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_sharded_training_off_the_cpu_is_refused():
    import tidal

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="sharding='fsdp' trains on the CPU only"):
        tidal.Trainer(model, opt, [0], global_batch_size=1, sharding="fsdp", device="cuda")
