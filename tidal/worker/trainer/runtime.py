"""The training-script side of Tidal: ``Trainer`` and the ``Step`` it yields.

A plain PyTorch loop changes by a few lines::

    trainer = tidal.Trainer(model, optimizer, dataset, global_batch_size=64, seed=0)
    for step in trainer.run(max_steps=300):
        for x, y in step.micro_batches():
            step.backward(loss_fn(trainer.model(x), y))

Contracts:

- Step ``s`` consumes the samples ``ElasticSampler`` assigns it, whatever the world size; each
  micro-batch's mean loss is scaled by its share of the global batch and gradients are
  summed across members, so the update is the mean gradient over exactly those samples.
- The optimizer steps only if this member's gradient all-reduce completed; a step whose
  collective failed is not applied here and is redone in the next generation (after healing
  from the most advanced member, so it is never applied twice).
- A membership change takes effect after a step that every member completed: the members
  agree through the control word carried by that step's all-reduce (a generation's first
  step carries one, then about every 0.2 s of training: ``ddp``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from tidal.tracked import Stateful, TrackedState
from tidal.worker.agent.client import WorkerEnv
from tidal.worker.batches import identity
from tidal.worker.batches.loader import Loader
from tidal.worker.batches.pipeline import LoaderOptions, check_loader, unwrap
from tidal.worker.trainer.clock import PauseClock
from tidal.worker.trainer.driven import Driven
from tidal.worker.trainer.elastic import ElasticLoop
from tidal.worker.trainer.evaluation import Evaluator
from tidal.worker.trainer.link import JobLink
from tidal.worker.trainer.membership import Membership
from tidal.worker.trainer.objects import SHARDINGS, Objects, place
from tidal.worker.trainer.parts import Parts
from tidal.worker.trainer.sharded_steps import ShardedSteps
from tidal.worker.trainer.step import Step
from tidal.worker.trainer.stopping import ScriptStop
from tidal.worker.trainer.update import Update

__all__ = ["SHARDINGS", "LOG_REDUCTIONS", "Step", "Trainer", "log"]

_current: Trainer | None = None
#: Where ``log`` reports when no Trainer runs in this process (``set_log_sink``).
_sink: Callable[[dict[str, float], str | None], None] | None = None


def set_log_sink(sink: Callable[[dict[str, float], str | None], None] | None) -> None:
    """Report ``log``'s values to ``sink(values, reduce)`` while no Trainer runs here: the
    ``--torchrun`` launcher's (``worker.torchrun``), for a script that is no Trainer's."""
    global _sink
    _sink = sink


#: The values of ``tidal.log(..., reduce=...)``: None keeps rank 0's value, "mean" averages.
LOG_REDUCTIONS = (None, "mean")


def log(*, reduce: str | None = None, **metrics: float) -> None:
    """Record metrics (e.g. ``loss``, ``accuracy``) for the step in flight: inside the loop the
    index of the step being run (``step.index``), after it the final step count. The job keeps
    one value per (step, name): rank 0's, or with ``reduce="mean"`` the mean over the members
    that logged it; a step redone after a failure records again and its last value wins.
    The latest values are the job's ``metrics`` (``tidal status``); the per-step series
    go to the dashboard, TensorBoard and ``tidal status --json --history``."""
    if reduce not in LOG_REDUCTIONS:
        raise ValueError(
            f"tidal.log: reduce must be None (rank 0's value) or 'mean', got {reduce!r}"
        )
    values = {k: float(v) for k, v in metrics.items()}
    if _current is not None:
        _current._parts.loop.log(values, reduce)
    elif _sink is not None:
        _sink(values, reduce)


class Trainer:
    """Elastic data-parallel training of ``model`` with ``optimizer`` over ``dataset``.

    Under ``tidal run`` it joins the job's coordinator; run as a plain script it trains
    alone with the same mathematics, which makes the script easy to debug. It is made of
    parts (``parts``), each owning its state: the user's objects, the loader, the update,
    the pause clock, the link to the job, the membership, the sharded steps, the stop and
    the loop.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        data: Any,
        *,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        seed: int = 0,
        lr_scheduler: Any | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        clip_grad_norm: float | None = None,
        state: Mapping[str, Stateful] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        sharding: str = "ddp",
        device: str | torch.device | None = None,
        allow_batch_norm: bool = False,
        ddp_kwargs: dict[str, Any] | None = None,
        shuffle: bool = True,
    ) -> None:
        """``optimizer``: one, or a list (a GAN's generator's and discriminator's, each over
        its own parameters: ``optimizers``), each stepped once per committed step and each
        state carried. ``data``: a map-style dataset, a torch ``IterableDataset`` or a stream with
        ``iter_from(position)``, or a ``DataLoader`` standing for its dataset and loading
        settings (``pipeline``). ``collate_fn`` ... ``worker_init_fn`` have DataLoader's
        meanings, kept and checked as one ``pipeline.LoaderOptions``; the samples each step
        consumes never depend on them. ``lr_scheduler`` is stepped once after each
        committed step; ``grad_scaler`` scales
        each micro-batch's loss in ``step.backward`` and unscales, checks and steps
        (``update.Update``); ``clip_grad_norm`` clips the synchronised gradients to that
        norm; ``state`` names more objects to carry (an EMA model, your own counters): see
        ``tracked``. All of them are healed, checkpointed, resumed, and rewound when a step
        fails. ``sharding``: ``"ddp"`` (every member holds the whole model) or ``"fsdp"``
        (parameters and optimizer state sharded across the members with FSDP2, resharded in
        process at every membership change: ``tidal.worker.sharded.fsdp``; call ``trainer.model``,
        never the module you passed, which becomes the meta-device template). ``device``:
        where to train (``tidal.devices.resolve_device``: None is the worker's GPU where CUDA
        exists, else the CPU); the model is moved there in place (build the optimizer from
        its parameters before or after: they keep their identity) and every micro-batch is
        moved there before the loop sees it. ``allow_batch_norm``: under ``tidal run`` a
        BatchNorm layer in training mode is refused (``norms``: it would make the updates
        depend on the number of workers); True accepts per-member statistics, as DDP has
        them. ``ddp_kwargs``: DDP's ``find_unused_parameters``, ``static_graph``,
        ``bucket_cap_mb``, ``gradient_as_bucket_view`` (``ddp.DDP_KWARGS``). ``shuffle``:
        each epoch in a seeded order (``seed``), or with False in the dataset's own."""
        loading = LoaderOptions(  # checked once, here: the one source of these settings
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            worker_init_fn=worker_init_fn,
        )
        env = WorkerEnv.from_environ()
        optimizer, where, kwargs = place(
            model,
            optimizer,
            elastic=env is not None,
            allow_batch_norm=allow_batch_norm,
            device=device,
            sharding=sharding,
            grad_scaler=grad_scaler,
            state=state,
            ddp_kwargs=ddp_kwargs,
        )
        check_loader(data, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
        dataset, loading = unwrap(data, loading)
        update = Update(
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            grad_scaler=grad_scaler,
            clip_grad_norm=clip_grad_norm,
        )
        tracked = TrackedState(update.tracked(state))
        tracked.check()  # what cannot be carried is refused now, not at a checkpoint
        parts = self._parts = Parts()
        parts.objects = Objects(
            module=model,
            optimizer=optimizer,
            dataset=dataset,
            lr_scheduler=lr_scheduler,
            grad_scaler=grad_scaler,
            tracked=tracked,
            device=where,
            sharding=sharding,
            ddp_kwargs=kwargs,
        )
        parts.loader = Loader(
            dataset,
            loading,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            seed=seed,
            device=where,
            shuffle=shuffle,
        )
        parts.update = update
        parts.clock = PauseClock()
        parts.link = JobLink(parts, env, debug=bool(os.environ.get("TIDAL_DEBUG")))
        # What every worker must agree on (``identity``): fixed once the Trainer is made.
        settings = (
            identity.settings(parts.loader.sampler, sharding, clip_grad_norm)
            | identity.origin(sys.argv[0] if sys.argv else "")
            | identity.kinds(optimizer, tracked.objects)
        )
        parts.membership = Membership(parts, identity_settings=settings)
        parts.sharded = ShardedSteps(parts)
        parts.stop = ScriptStop(parts)
        parts.loop = ElasticLoop(parts, self)
        parts.evaluator = Evaluator(parts)
        parts.driven = Driven(parts, self)

    # -- user surface ----------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The module to call in the loop: the DDP wrapper or the FSDP module of the current
        generation (the module itself when training alone)."""
        parts = self._parts
        if (fsdp := parts.sharded.live) is not None:
            return fsdp.module
        ddp = parts.membership.ddp
        return ddp if ddp is not None else parts.objects.module

    @property
    def module(self) -> torch.nn.Module:
        """The module passed in (with ``sharding="fsdp"``, the meta-device template)."""
        return self._parts.objects.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (several passed in: ``optimizers.Optimizers``, carried as one)."""
        return self._parts.objects.optimizer

    @property
    def dataset(self) -> Any:
        """The dataset trained on (a DataLoader passed in stands for its dataset)."""
        return self._parts.objects.dataset

    @property
    def lr_scheduler(self) -> Any | None:
        return self._parts.objects.lr_scheduler

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        return self._parts.objects.grad_scaler

    @property
    def device(self) -> torch.device:
        """Where the model trains and every micro-batch is moved."""
        return self._parts.objects.device

    @property
    def sampler(self) -> Any:
        """The ``ElasticSampler`` fixing which samples each step consumes."""
        return self._parts.loader.sampler

    @property
    def step(self) -> int:
        """Committed steps: the index of the next step."""
        return self._parts.update.step

    @property
    def rank(self) -> int:
        """This member's rank in its generation (0 alone)."""
        return self._parts.membership.rank

    @property
    def world_size(self) -> int:
        """The members of this member's generation (1 alone)."""
        return self._parts.membership.world_size

    @property
    def generation(self) -> int:
        """The generation this member formed last (0 alone)."""
        return self._parts.membership.generation

    @property
    def completed(self) -> bool:
        """``run()`` ended because the job did its ``max_steps`` steps."""
        return self._parts.loop.completed

    @property
    def grad_norm(self) -> float | None:
        """The total norm of the last committed step's synchronised gradients, before
        clipping (unscaled, divided by the item count with ``items=``): the same on every
        member. Log it with ``tidal.log(grad_norm=...)``. With ``clip_grad_norm`` it is a
        by-product of clipping; without, the first read turns its measuring on (a pass over
        the gradients per step, which no script that never reads it pays), and it is None
        until a step has been measured."""
        update = self._parts.update
        update.measure_norm = True
        norm = update.grad_norm
        return None if norm is None else float(norm)

    @property
    def job_name(self) -> str | None:
        """The job's name under ``tidal run`` (the same in every worker, through every
        resize and ``tidal resume``: a tracker's run id), known once ``run()`` has joined
        the job; None when training alone."""
        cfg = self._parts.link.cfg
        return cfg.name if cfg is not None else None

    @property
    def worker_id(self) -> int | None:
        return self._parts.link.worker_id

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """On rank 0, the whole model's state as plain tensors (copies), e.g. to save the
        final model after ``run()``; None on the other ranks. With ``sharding="fsdp"`` the
        members gather it onto rank 0 when the job's last step is done."""
        parts = self._parts
        sharded, last_rank = parts.sharded, parts.membership.last_rank
        if sharded.fsdp is not None:
            if sharded.final_state is None and last_rank == 0:
                raise RuntimeError(
                    "full_state_dict() with sharding='fsdp' is available once run() has "
                    "finished the job (the members gather it at the job's last step)"
                )
            return sharded.final_state if last_rank == 0 else None
        if self.rank != 0:
            return None
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def evaluate(
        self, fn: Callable[[Any], Mapping[str, Any]], dataset: Any, *, batch_size: int
    ) -> dict[str, float]:
        """The means of ``fn``'s metrics over ``dataset``, its batches split across the
        current members: the same values at any world size, alone included, and after a
        member is lost during it (``evaluation``). Call it alike on every member."""
        return self._parts.evaluator.evaluate(fn, dataset, batch_size)

    def after_step(self, fn: Callable[[int], None]) -> Callable[[int], None]:
        """Register ``fn(index)`` to run once after each committed step's optimizer step (and
        the scheduler's), the place for EMA updates and anything else that must happen once
        per step; usable as a decorator. Whatever it changes must be tracked (``state=``)
        to survive membership changes."""
        self._parts.update.hooks.append(fn)
        return fn

    def stop(self) -> None:
        """End the job after the current step: called in a step's body, that step is
        committed and ``run()`` returns instead of yielding the next one. Under ``tidal run``
        it ends the whole job, on every member at the same committed step (final checkpoint
        included when checkpointing is on); the job succeeds if the script then exits 0.
        Leaving the loop with ``break`` does the same, the step in whose body it happened
        committed iff all its micro-batches' backwards completed (``stopping``)."""
        self._parts.stop.stop()

    def drive(self, max_steps: int) -> Driven:
        """The steps of ``run(max_steps)``, driven from a loop the script owns instead of
        iterated (``tidal.prepare``'s objects call it: ``driven``). Once per Trainer."""
        return self._parts.driven.start(max_steps)

    def run(self, max_steps: int) -> Iterator[Step]:
        """Yield a ``Step`` for each global step this worker takes part in, until the job
        has done ``max_steps`` steps (``completed`` is then True), the job is stopped (by
        ``tidal stop``, ``trainer.stop()`` or a ``break`` out of this loop on any member:
        ``stopping``), or the coordinator asks this worker to leave."""
        global _current
        if max_steps < 0:
            raise ValueError(f"max_steps must be at least 0, got {max_steps}")
        _current = self  # stays set after the loop: ``log`` after it still reports
        loop = self._parts.loop
        try:
            if self._parts.link.env is None:
                yield from loop.run_alone(max_steps)
            else:
                yield from loop.run_elastic(max_steps)
        finally:
            self._parts.loader.close()  # the loader's worker processes, if any
