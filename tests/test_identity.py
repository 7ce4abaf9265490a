"""What every worker must agree on before training with the others (``tidal.worker.batches.identity``):
the first worker's settings, set once in a real store; a worker whose settings differ is
refused with one line naming each difference."""

import hashlib

import pytest
import torch
import torch.distributed as dist

from tidal.worker.batches.identity import (
    DataOrderMismatch,
    ScriptMismatch,
    agree,
    check_resume,
    data_order,
    differences,
    kinds,
    origin,
    settings,
)
from tidal.worker.batches.sampler import ElasticSampler


def sampler(**kw) -> ElasticSampler:
    return ElasticSampler(**{"dataset_size": 256, "global_batch_size": 16, "seed": 0, **kw})


@pytest.mark.parametrize(
    ("mine", "first", "expected"),
    [
        (settings(sampler(), "ddp"), settings(sampler(), "ddp"), []),
        # micro-batches only change how a member splits its share: not compared
        (settings(sampler(micro_batch_size=4), "ddp"), settings(sampler(), "ddp"), []),
        (
            settings(sampler(global_batch_size=32), "ddp"),
            settings(sampler(), "ddp"),
            ["global_batch_size: 32 here, 16 in the first worker"],
        ),
        (
            settings(sampler(dataset_size=300, seed=1), "fsdp"),
            settings(sampler(), "ddp"),
            [
                "dataset length: 300 here, 256 in the first worker",
                "seed: 1 here, 0 in the first worker",
                "sharding: 'fsdp' here, 'ddp' in the first worker",
            ],
        ),
        (
            settings(sampler(dataset_size=None), "ddp"),  # a stream has no length
            settings(sampler(), "ddp"),
            ["dataset length: None here, 256 in the first worker"],
        ),
        (
            settings(sampler(), "ddp", 1.0),
            settings(sampler(), "ddp"),
            ["clip_grad_norm: 1.0 here, None in the first worker"],
        ),
    ],
    ids=["same", "micro-batches", "global-batch", "three", "stream", "clip"],
)
def test_differences(mine, first, expected):
    assert differences(mine, first) == expected


def test_the_first_worker_sets_them_and_a_different_one_is_refused():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = settings(sampler(), "ddp")
    agree(store, "job/settings", first)  # sets them
    agree(store, "job/settings", dict(first))  # the same: agreed
    with pytest.raises(ScriptMismatch, match=r"global_batch_size: 32 here, 16 in the first"):
        agree(store, "job/settings", settings(sampler(global_batch_size=32), "ddp"))
    agree(store, "other/settings", settings(sampler(global_batch_size=32), "ddp"))  # per key


def test_origin_is_the_scripts_content_and_torchs_version(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    mine = origin(str(script))
    assert mine == {
        "script (sha256 of the file)": hashlib.sha256(b"print(1)\n").hexdigest()[:16],
        "torch": torch.__version__,
    }
    assert origin(str(script)) == mine  # the same file: the same origin
    script.write_text("print(2)\n")  # edited: another origin
    (line,) = differences(origin(str(script)), mine)
    assert line.startswith("script (sha256 of the file): '") and "in the first worker" in line
    # no file to read (``python -c``, an interactive session): the content is not compared
    assert origin("-c")["script (sha256 of the file)"] is None
    assert origin("")["script (sha256 of the file)"] is None


def test_another_torch_is_refused():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = settings(sampler(), "ddp") | {"torch": "2.13.0+cpu"}
    agree(store, "job/settings", first)
    with pytest.raises(ScriptMismatch, match=r"torch: '2\.11\.0' here, '2\.13\.0\+cpu' in the"):
        agree(store, "job/settings", settings(sampler(), "ddp") | {"torch": "2.11.0"})


def test_a_resume_with_another_data_order_is_refused_and_the_same_one_accepted():
    mine = data_order(sampler())
    assert mine == {"dataset length": 256, "global_batch_size": 16, "seed": 0}
    check_resume("ckpt", dict(mine), mine)  # the same: resumed
    check_resume("ckpt", None, mine)  # a checkpoint from before the record: resumed
    with pytest.raises(
        DataOrderMismatch,
        match=r"^checkpoint ckpt was written with another data order: global_batch_size: 32 "
        r"here, 16 in the checkpoint; seed: 1 here, 0 in the checkpoint; resumed",
    ):
        check_resume("ckpt", mine, data_order(sampler(global_batch_size=32, seed=1)))


def test_kinds_name_the_optimizer_and_each_tracked_objects_class():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    mine = kinds(opt, {"lr_scheduler": sched, "ema": model})
    assert mine == {"optimizer": "SGD", "tracked state": "ema: Linear, lr_scheduler: StepLR"}
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)
    assert differences(kinds(opt, {"lr_scheduler": cosine, "ema": model}), mine) == [
        "tracked state: 'ema: Linear, lr_scheduler: CosineAnnealingLR' here, "
        "'ema: Linear, lr_scheduler: StepLR' in the first worker"
    ]
    assert differences(kinds(opt, {}), kinds(opt, {"ema": model})) == [
        "tracked state: '' here, 'ema: Linear' in the first worker"
    ]
