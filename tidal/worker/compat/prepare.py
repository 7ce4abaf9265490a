"""``tidal.prepare``: the script's own training loop, elastic.

A plain PyTorch loop changes by one line (Accelerate's and Ray Train's shape)::

    model, optimizer, loader, scheduler = tidal.prepare(
        model, optimizer, loader, scheduler, epochs=3
    )
    for epoch in range(3):
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

Run alone it trains exactly as the loop without Tidal; under ``tidal run`` it gains Tidal's
guarantees: membership changes in process, at most one step lost to a failure, the same
updates at any world size. The objects returned are thin wrappers whose calls drive one
``Trainer``'s steps (``driven``): no second implementation. Contracts:

- **The loader.** Its ``batch_size`` is the GLOBAL batch: each step consumes the next
  ``batch_size`` samples of the epoch's order whatever the number of workers, each member
  its share (``ElasticSampler``; the ``n mod batch_size`` samples left at an epoch's end are
  not used, as with ``drop_last``). ``shuffle=False`` (a ``SequentialSampler``) keeps the
  dataset's order; ``shuffle=True`` a seeded order (``seed``), the same in every process.
  Its dataset, ``collate_fn``, ``num_workers``, ``pin_memory`` ... are kept
  (``pipeline.unwrap``); its own sampler or batch sampler is refused. Batches are on the
  model's device. ``micro_batch_size=m``: each step's share comes as batches of at most
  ``m`` samples, to accumulate (call ``optimizer.step()`` after every batch as before: it
  acts at the step's last one). ``len(loader)``: the steps (updates) of an epoch.
- **The model** is the module, called through the current generation's DDP wrapper; its
  ``state_dict`` and attributes are the module's own (``model.state_dict()`` saves what the
  plain loop saves). The loss given to ``loss.backward()`` is a batch's per-sample MEAN.
- **The optimizer's** ``step()`` is where a step ends, commits and is applied
  (``driven``); **the scheduler's** ``step()`` acts once the step is applied, never for a
  step that was not; both are healed, checkpointed and rewound with the model.
- **The length.** ``max_steps`` (updates) or ``epochs`` (``epochs * len(loader)`` steps):
  the job's end, which every member reaches at the same step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, SequentialSampler

from tidal.tracked import Stateful
from tidal.worker.batches.pipeline import STREAM, classify
from tidal.worker.trainer.driven import Driven
from tidal.worker.trainer.runtime import Trainer

#: The name the scheduler is carried under (``tracked``: healed, checkpointed, rewound).
SCHEDULER = "scheduler"


def _length(max_steps: int | None, epochs: int | None, steps_per_epoch: int | None) -> int:
    """The job's length in steps from ``max_steps`` or ``epochs`` (exactly one)."""
    if (max_steps is None) == (epochs is None):
        raise ValueError(
            "tidal.prepare needs the job's length, once: pass max_steps=N (updates) or "
            "epochs=E (E passes over the loader), not both"
        )
    if epochs is not None:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"epochs must be an integer >= 0, got {epochs!r}")
        if steps_per_epoch is None:
            raise ValueError(
                "epochs= needs a dataset with a length: a stream has no epochs, pass max_steps="
            )
        return epochs * steps_per_epoch
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
        raise ValueError(f"max_steps must be an integer >= 0, got {max_steps!r}")
    return max_steps


def prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    scheduler: Any | None = None,
    *,
    max_steps: int | None = None,
    epochs: int | None = None,
    micro_batch_size: int | None = None,
    seed: int = 0,
    state: Mapping[str, Stateful] | None = None,
    device: str | torch.device | None = None,
    allow_batch_norm: bool = False,
) -> tuple[PreparedModel, PreparedOptimizer, PreparedLoader, PreparedScheduler | None]:
    """The model, optimizer, loader and scheduler for the script's own loop (module doc),
    in that order (None in the scheduler's place when none is given). ``state``: more
    objects to carry (an EMA model, counters: ``Trainer(state=)``); ``device``,
    ``allow_batch_norm``: as the ``Trainer``'s."""
    if not isinstance(loader, DataLoader):
        raise ValueError(
            f"tidal.prepare takes a torch DataLoader, got a {type(loader).__name__}: make one "
            "with batch_size= the global batch (tidal.Trainer takes datasets)"
        )
    if loader.batch_size is None:
        raise ValueError(
            "the DataLoader has a batch_sampler: tidal.prepare needs batch_size= (the global "
            "batch), and decides each step's samples itself"
        )
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise ValueError(f"scheduler must have a step() method, got {type(scheduler).__name__}")
    carried = dict(state or {})
    if scheduler is not None:
        if SCHEDULER in carried:
            raise ValueError(f"state= may not use the name {SCHEDULER!r}: it is the scheduler's")
        carried[SCHEDULER] = scheduler
    size = None if classify(loader.dataset) == STREAM else len(loader.dataset)
    steps = _length(max_steps, epochs, size // loader.batch_size if size else None)
    trainer = Trainer(
        model,
        optimizer,
        loader,  # its dataset and loading settings (``pipeline.unwrap``); sampler checked
        global_batch_size=loader.batch_size,
        micro_batch_size=micro_batch_size,
        seed=seed,
        shuffle=not isinstance(loader.sampler, SequentialSampler),
        state=carried,
        device=device,
        allow_batch_norm=allow_batch_norm,
    )
    driven = trainer.drive(steps)
    return (
        PreparedModel(model, trainer),
        PreparedOptimizer(trainer.optimizer, driven),
        PreparedLoader(trainer, driven),
        PreparedScheduler(scheduler, driven) if scheduler is not None else None,
    )


class PreparedModel(torch.nn.Module):
    """The script's module, called through the current generation's DDP wrapper (module
    doc); ``module`` is the module itself."""

    def __init__(self, module: torch.nn.Module, trainer: Trainer) -> None:
        super().__init__()
        self.module = module
        self.trainer = trainer  # not a Module: kept out of the parameters and state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.trainer.model(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own (its keys as without Tidal)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)  # the module's own methods

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.nn.Module:
        """A copy of the module (``AveragedModel(model)`` copies what it averages), never
        of the job."""
        return copy.deepcopy(self.module, memo)


class PreparedOptimizer(torch.optim.Optimizer):
    """The optimizer, whose ``step()`` ends the step in flight (``Driven.end_step``). Its
    state, groups and defaults are the optimizer's own (no ``Optimizer.__init__``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, driven: Driven) -> None:
        self.optimizer = optimizer
        self.driven = driven

    @property
    def state(self) -> Any:  # noqa: D102 - the optimizer's
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, except inside a step (they accumulate until its end)."""
        if self.driven.zero_grad_may_act():
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """End the step in flight: committed, it is applied before this returns."""
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported under tidal.prepare: the step's "
                "gradients are the loop's one backward per batch"
            )
        self.driven.end_step()

    def __repr__(self) -> str:
        return f"Prepared{self.optimizer!r}"


class PreparedScheduler:
    """The LR scheduler, whose ``step()`` moves it only once the step in flight is applied
    (``Driven.scheduler_may_step``); everything else is the scheduler's own."""

    def __init__(self, scheduler: Any, driven: Driven) -> None:
        self.scheduler = scheduler
        self.driven = driven

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.driven.scheduler_may_step():
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "driven"):  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class PreparedLoader:
    """The loader: each iterator the rest of the job's current epoch (``Driven.next_batch``)."""

    def __init__(self, trainer: Trainer, driven: Driven) -> None:
        self.driven = driven
        self.dataset = trainer.dataset
        self.batch_size = trainer.sampler.global_batch_size
        self.steps_per_epoch = trainer.sampler.steps_per_epoch  # None: a stream

    def __iter__(self) -> Iterator[Any]:
        return _Epoch(self.driven)

    def __len__(self) -> int:
        if self.steps_per_epoch is None:
            raise TypeError("a prepared loader of a stream has no length")
        return self.steps_per_epoch


class _Epoch:
    """One iterator of a prepared loader: its epoch is its first batch's step's."""

    def __init__(self, driven: Driven) -> None:
        self.driven = driven
        self.epoch: int | None = None

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        batch, self.epoch = self.driven.next_batch(self.epoch)
        return batch
