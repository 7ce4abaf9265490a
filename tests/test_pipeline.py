"""Input pipelines without a job: what each kind of input yields for a step, and what
prefetching does when the membership changes (``tidal.worker.batches.pipeline``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import tidal
from tidal.worker.batches.pipeline import LoaderOptions, Pipeline, classify
from tidal.worker.batches.sampler import ElasticSampler


class Ids(Dataset):
    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int) -> dict:
        return {"id": i, "x": torch.full((1 + i % 3,), float(i))}  # ragged


def ids_of(samples: list[dict]) -> list[int]:
    return [s["id"] for s in samples]


def sampler(n: int | None = 60) -> ElasticSampler:
    return ElasticSampler(dataset_size=n, global_batch_size=12, micro_batch_size=4, seed=1)


def step_ids(pipe: Pipeline, s: ElasticSampler, step: int, rank: int, world: int) -> list[int]:
    pieces = s.micro_batches(s.shard(step, rank, world))
    return [i for batch in pipe.batches(step, rank, world, pieces) for i in batch]


@pytest.mark.parametrize("workers", [0, 2])
def test_map_style_yields_each_step_share_even_after_a_resize_and_a_redo(workers: int) -> None:
    s = sampler()
    opts = LoaderOptions(collate_fn=ids_of, num_workers=workers)
    pipe = Pipeline(Ids(), s, opts)
    plan = [(0, 0, 2), (1, 0, 2), (2, 1, 3), (3, 1, 3), (3, 1, 3), (4, 0, 1), (5, 0, 1)]
    for step, rank, world in plan:  # a resize at 2 and 4, step 3 redone
        want = s.shard(step, rank, world).tolist()
        assert step_ids(pipe, s, step, rank, world) == want, (step, rank, world)
    # Prefetched batches of the old split were dropped three times (resize, redo, resize).
    assert pipe.restarts == (3 if workers else 0)
    pipe.close()


def test_stream_positions_whether_it_seeks_or_not() -> None:
    class Seek:
        opened = 0

        def iter_from(self, p):
            Seek.opened += 1
            while True:
                yield {"id": p}
                p += 1

    class FromStart(IterableDataset):
        def __iter__(self):
            return Seek().iter_from(0)

    for stream in (Seek(), FromStart()):
        s = sampler(None)
        pipe = Pipeline(stream, s, LoaderOptions(collate_fn=ids_of))
        assert step_ids(pipe, s, 0, 1, 2) == list(range(6, 12))
        assert step_ids(pipe, s, 1, 1, 2) == list(range(18, 24))  # skips rank 0's share
        assert step_ids(pipe, s, 1, 0, 3) == list(range(12, 16))  # back: reopened
        assert step_ids(pipe, s, 7, 2, 3) == list(range(92, 96))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (object(), "cannot train on a object"),
        ([1, 2, 3].__iter__(), "cannot train on a list_iterator"),
    ],
)
def test_an_input_that_is_no_dataset_is_one_line(data, match) -> None:
    with pytest.raises(ValueError, match=match):
        classify(data)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_workers": -1}, "num_workers"),
        ({"num_workers": 1.5}, "num_workers"),
        ({"prefetch_factor": 2}, "need num_workers > 0"),
        ({"persistent_workers": True}, "need num_workers > 0"),
        ({"num_workers": 1, "prefetch_factor": 0}, "prefetch_factor"),
        ({"collate_fn": 3}, "collate_fn"),
        ({"worker_init_fn": "seed"}, "worker_init_fn must be callable"),
        ({"pin_memory": 1}, "pin_memory must be True or False"),
        ({"num_workers": 1, "prefetch_factor": 2.5}, "prefetch_factor must be an integer"),
    ],
)
def test_loader_options_are_checked_once(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        LoaderOptions(**kw)


def test_the_trainers_loading_keywords_are_the_loader_options_fields() -> None:
    """One source: the Trainer's DataLoader keywords are exactly ``LoaderOptions``' fields,
    with the same defaults, and a bad one is refused by the Trainer in the same words."""
    import dataclasses
    import inspect

    params = inspect.signature(tidal.Trainer.__init__).parameters
    for field in dataclasses.fields(LoaderOptions):
        assert params[field.name].kind is inspect.Parameter.KEYWORD_ONLY, field.name
        assert params[field.name].default == field.default, field.name
    model = torch.nn.Linear(2, 1)
    data = TensorDataset(torch.zeros(8, 2), torch.zeros(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="need num_workers > 0"):
        tidal.Trainer(model, opt, data, global_batch_size=4, persistent_workers=True)


def test_a_stream_with_loader_workers_is_refused() -> None:
    class S(IterableDataset):
        def __iter__(self):
            return iter(range(10**6))

    with pytest.raises(ValueError, match="num_workers > 0 needs a map-style dataset"):
        Pipeline(S(), sampler(None), LoaderOptions(num_workers=2))


def test_a_dataloader_stands_for_its_dataset_and_settings() -> None:
    model = torch.nn.Linear(1, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Ids(), batch_size=4, shuffle=True, collate_fn=ids_of)
    trainer = tidal.Trainer(model, opt, loader, global_batch_size=12, micro_batch_size=4)
    assert trainer.dataset is loader.dataset and trainer._parts.loader.pipeline.collate is ids_of
    seen = []
    for step in trainer.run(max_steps=5):  # one epoch: every id once, in Tidal's order
        for batch in step.micro_batches():
            seen += batch
            step.backward(model(torch.ones(1, 1).double()).sum() * 0)
    assert sorted(seen) == list(range(60))


def test_tensor_datasets_keep_their_fast_path_unless_collated() -> None:
    data = TensorDataset(torch.arange(24.0))
    assert Pipeline(data, sampler(24), LoaderOptions()).kind == "tensors"
    assert Pipeline(data, sampler(24), LoaderOptions(collate_fn=list)).kind == "map"
