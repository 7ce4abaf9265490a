"""A DataLoader worker process that dies (SIGKILL, as the OOM killer sends) costs a refetch,
never the job or a sample (``tidal.worker.batches.loader_loss``, issue 50 finding 5).

The Trainer trains alone here, in this process, over 2 loader processes; the consumed
sample ids of every step and the final float64 parameters must equal a run without the
kill, exactly (same ids, same order, same micro-batches)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import tidal
from tidal.worker.batches.loader_loss import LOSSES_PER_STEP, lost_pids, restart_after

STEPS, GLOBAL, MICRO, N = 12, 12, 4, 96


def children() -> set[int]:
    """This process's live child processes (the loader's workers among them)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids |= {int(p) for p in (task / "children").read_text().split()}
        except OSError:
            continue
    return pids


def kill(pid: int) -> None:
    """SIGKILL ``pid`` and wait until it is dead (not reaped: its parent still finds it)."""
    os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


class Ids(Dataset):
    """Sample ``i`` is its id and a float64 feature; ``die_on``: the loader process that
    first fetches that id kills itself (once in the whole test: ``marker``), or every time
    (``marker`` None)."""

    def __init__(self, die_on: int | None = None, marker: Path | None = None) -> None:
        self.die_on, self.marker = die_on, marker

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        if i == self.die_on and (self.marker is None or _first(self.marker)):
            os.kill(os.getpid(), signal.SIGKILL)
        return {"id": i, "x": torch.tensor([float(i) / N, 1.0], dtype=torch.float64)}


def _first(marker: Path) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def train(data: Dataset, *, persistent: bool, kill_at: tuple[int, int] | None = None):
    """Train alone; ``kill_at=(step, micro)``: SIGKILL a loader process from the loop body
    after that micro-batch. Returns (ids per step, parameters, the pipeline)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = tidal.Trainer(
        model,
        opt,
        data,
        global_batch_size=GLOBAL,
        micro_batch_size=MICRO,
        seed=5,
        num_workers=2,
        persistent_workers=persistent,
    )
    before = children()
    seen: dict[int, list[int]] = {}
    steps = trainer.run(max_steps=STEPS)
    try:
        for step in steps:
            seen[step.index] = []
            for m, batch in enumerate(step.micro_batches()):
                seen[step.index] += batch["id"].tolist()
                step.backward(((trainer.model(batch["x"]) - 1.0) ** 2).mean())
                if kill_at == (step.index, m):
                    (victim, *_) = sorted(children() - before)
                    kill(victim)
    finally:
        steps.close()  # as the loop's end would, even when it raised
        assert children() <= before, "a loader process outlived the run"
    params = [p.detach().clone() for p in model.parameters()]
    return seen, params, trainer._parts.loader.pipeline


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
@pytest.mark.parametrize("how", ["killed-from-the-loop", "killed-while-fetching"])
def test_a_killed_loader_process_costs_no_sample_and_no_step(
    tmp_path: Path, persistent: bool, how: str
) -> None:
    want, want_params, _ = train(Ids(), persistent=persistent)
    assert sorted(want) == list(range(STEPS))
    if how == "killed-from-the-loop":  # mid-step: after micro-batch 1 of 3 of step 5
        got, params, pipe = train(Ids(), persistent=persistent, kill_at=(5, 1))
    else:  # a sample of step 7 (its second micro-batch): the first fetch of it dies
        victim = want[7][5]
        got, params, pipe = train(Ids(victim, tmp_path / "died"), persistent=persistent)
        assert (tmp_path / "died").exists()
    assert got == want  # every step the same ids in the same order: none lost, none twice
    for p, q in zip(params, want_params, strict=True):
        assert torch.equal(p, q)
    assert pipe.losses == 1


def test_a_loader_process_that_dies_on_every_fetch_fails_in_one_line() -> None:
    with pytest.raises(RuntimeError, match=r"died 4 times in step \d+ \(DataLoader worker"):
        train(Ids(die_on=17), persistent=False)


@pytest.mark.parametrize("error", [ValueError, RuntimeError])
def test_a_dataset_error_in_a_loader_process_is_not_a_loss(error: type[Exception]) -> None:
    class Broken(Ids):
        def __getitem__(self, i: int) -> dict:
            if i == 17:
                raise error("sample 17 is corrupt")
            return super().__getitem__(i)

    with pytest.raises(error, match="sample 17 is corrupt"):
        train(Broken(), persistent=True)


@pytest.mark.parametrize(
    ("losses", "restart"),
    [(1, True), (2, True), (LOSSES_PER_STEP, True), (LOSSES_PER_STEP + 1, False), (99, False)],
)
def test_restart_or_give_up(losses: int, restart: bool) -> None:
    assert restart_after(losses) is restart


def test_restart_or_give_up_counts_the_loss_found() -> None:
    assert restart_after(1, limit=0) is False
    with pytest.raises(ValueError, match="at least 1"):
        restart_after(0)


@pytest.mark.parametrize(
    ("message", "pids"),
    [
        ("DataLoader worker (pid 4242) is killed by signal: Killed. ", {4242}),
        ("DataLoader worker (pid 17) exited unexpectedly with exit code 1. Details", {17}),
        ("DataLoader worker (pid(s) 12, 13) exited unexpectedly", {12, 13}),
        ("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback", set()),
        ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer", set()),
    ],
)
def test_which_messages_name_a_dead_loader_process(message: str, pids: set[int]) -> None:
    assert lost_pids(message) == pids
