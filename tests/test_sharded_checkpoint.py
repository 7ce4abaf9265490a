"""Sharded checkpoints (``sharding="fsdp"``) on disk: written by a real 1-rank gloo group in
this process, verified as the ``sharded`` layout (any tampering refused in one line), and
loaded into an unsharded model and optimizer (a DDP job resumes an FSDP job's checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tidal.checkpoint import store
from tidal.checkpoint.layout import MANIFEST, shard_file
from tidal.worker.sharded.checkpoint import load_for_roll_back, save_sharded
from tidal.worker.sharded.guard import Guard
from tidal.worker.sharded.module import ShardedModel
from tidal.worker.sharded.plan import Layout


class Posted:
    """What the worker would post to the coordinator."""

    def __init__(self) -> None:
        self.written, self.failed = [], []

    def post_checkpoint(self, view) -> None:  # noqa: ANN001
        self.written.append(view)

    def post_checkpoint_failure(self, step: int, error: str) -> None:
        self.failed.append((step, error))


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))
    return m.double()


def _trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return opt


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def written(tmp_path: Path, group):
    """A checkpoint of step 7 of a trained model, as sharding='fsdp' writes it, and the model
    and optimizer state it holds (copies, taken before the model became a template)."""
    model = _model()
    opt = _trained(model)
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = {
        n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()
    }
    sm = ShardedModel(model, opt)
    held = sm.held()
    sm.build(
        layout=Layout(gen=1, world=1, rank=0),
        rows=held.rows,
        replicated={
            "buffers": held.buffers,
            "scalars": held.scalars,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
            ],
        },
        guard=Guard(),
    )
    posted = Posted()
    save_sharded(
        sm, directory=tmp_path, step=7, position={"epoch": 0}, tracked=None, keep=2, agent=posted
    )
    assert not posted.failed and [v.step for v in posted.written] == [7]
    return Path(posted.written[0].path), want_model, want_opt, sm


def test_it_verifies_and_loads_into_an_unsharded_model(written) -> None:
    path, want_model, want_opt, _ = written
    manifest = store.verify(path)
    assert manifest["layout"] == "sharded" and manifest["shards"] == 1
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    meta = store.load(path, model, opt)
    assert meta["step"] == 7
    for k, v in model.state_dict().items():
        assert torch.equal(v, want_model[k]), k  # parameters and BatchNorm's buffers
    for n, p in model.named_parameters():
        for k, v in want_opt[n].items():
            assert torch.equal(opt.state[p][k], v), (n, k)
    assert opt.param_groups[0]["lr"] == 0.01  # the hyper-parameters are the checkpoint's


def test_a_roll_back_holds_the_checkpoints_whole_state(written) -> None:
    path, want_model, _, sm = written
    assert load_for_roll_back(sm, path, gen=5, tracked=None) == 7
    held = sm.held()
    assert held.layout == Layout(gen=5, world=1, rank=0)
    assert torch.equal(held.rows[("p", "0.weight")], want_model["0.weight"])
    assert torch.equal(held.buffers["1.running_mean"], want_model["1.running_mean"])


def _edit_manifest(path: Path, change) -> None:  # noqa: ANN001
    m = json.loads((path / MANIFEST).read_text())
    change(m)
    (path / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize(
    "tamper, why",
    [
        (
            lambda p: (p / shard_file(0, 1)).write_bytes(
                (p / shard_file(0, 1)).read_bytes()[:-1] + b"x"
            ),
            "mismatch",
        ),
        (
            lambda p: _edit_manifest(p, lambda m: m["files"].pop(shard_file(0, 1))),
            "does not list shard-00000",
        ),
        (
            lambda p: _edit_manifest(p, lambda m: m.update(shards=2)),
            "does not list shard-00000-of-00002",
        ),
        (lambda p: _edit_manifest(p, lambda m: m.pop("shards")), "gives no number of shards"),
        (lambda p: (p / "replicated.safetensors").unlink(), "replicated.safetensors is missing"),
    ],
    ids=["bit flip", "shard unlisted", "a shard missing", "no shard count", "file deleted"],
)
def test_tampering_is_refused_in_one_line(written, tamper, why) -> None:
    path = written[0]
    tamper(path)
    with pytest.raises(store.CheckpointError, match=why) as info:
        store.verify(path)
    assert "\n" not in str(info.value)
