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
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from tidal import devices
from tidal.protocol import Role, StepReport
from tidal.tracked import Stateful, TrackedState
from tidal.worker import ddp, evaluation, identity, norms, optimizers, probes
from tidal.worker.agent import Agent, WorkerEnv
from tidal.worker.data import ElasticSampler
from tidal.worker.durable import Durable
from tidal.worker.elastic import ElasticLoop
from tidal.worker.membership import Membership
from tidal.worker.notice import Notices
from tidal.worker.pipeline import (
    STREAM,
    LoaderOptions,
    Pipeline,
    check_loader,
    classify,
    unwrap,
)
from tidal.worker.reports import Reports
from tidal.worker.sharded_steps import ShardedSteps
from tidal.worker.step import Step
from tidal.worker.stopping import LoopStep, commits_on_break
from tidal.worker.update import Update
from tidal.worker.waits import Waits
from tidal.worker.watch import AbortWatch

_current: Trainer | None = None

#: The values of ``Trainer(sharding=...)``.
SHARDINGS = ("ddp", "fsdp")


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
        _current._log(values, reduce)


class Trainer(ElasticLoop, Membership, ShardedSteps, Reports):
    """Elastic data-parallel training of ``model`` with ``optimizer`` over ``dataset``.

    Under ``tidal run`` it joins the job's coordinator; run as a plain script it trains
    alone with the same mathematics, which makes the script easy to debug.
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
    ) -> None:
        """``optimizer``: one, or a list (a GAN's generator's and discriminator's, each over
        its own parameters: ``optimizers``), each stepped once per committed step and each
        state carried. ``data``: a map-style dataset, a torch ``IterableDataset`` or a stream with
        ``iter_from(position)``, or a ``DataLoader`` standing for its dataset and loading
        settings (``pipeline``). ``collate_fn`` ... ``worker_init_fn`` have DataLoader's
        meanings; the samples each step consumes never depend on them. ``lr_scheduler`` is stepped once after each committed step; ``grad_scaler`` scales
        each micro-batch's loss in ``step.backward`` and unscales, checks and steps
        (``update.Update``); ``clip_grad_norm`` clips the synchronised gradients to that
        norm; ``state`` names more objects to carry (an EMA model, your own counters): see
        ``tracked``. All of them are healed, checkpointed, resumed, and rewound when a step
        fails. ``sharding``: ``"ddp"`` (every member holds the whole model) or ``"fsdp"``
        (parameters and optimizer state sharded across the members with FSDP2, resharded in
        process at every membership change: ``tidal.worker.fsdp``; call ``trainer.model``,
        never the module you passed, which becomes the meta-device template). ``device``:
        where to train (``tidal.devices.resolve_device``: None is the worker's GPU where CUDA
        exists, else the CPU); the model is moved there in place (build the optimizer from
        its parameters before or after: they keep their identity) and every micro-batch is
        moved there before the loop sees it. ``allow_batch_norm``: under ``tidal run`` a
        BatchNorm layer in training mode is refused (``norms``: it would make the updates
        depend on the number of workers); True accepts per-member statistics, as DDP has
        them. ``ddp_kwargs``: DDP's ``find_unused_parameters``, ``static_graph``,
        ``bucket_cap_mb``, ``gradient_as_bucket_view`` (``ddp.DDP_KWARGS``)."""
        self._ddp_kwargs = ddp.check_kwargs(ddp_kwargs)
        optimizer = optimizers.combine(optimizer)  # a list of them: carried as one
        self._env = WorkerEnv.from_environ()
        if self._env is not None and not allow_batch_norm:  # elastic: under tidal run
            norms.check(model)  # now, in one line, before this worker joins anyone
            norms.guard(model)  # and at any later forward in training mode
        self.device = devices.resolve_device(device, cuda_available=torch.cuda.is_available())
        if sharding == "fsdp" and self.device.type != "cpu":
            raise ValueError(
                "sharding='fsdp' trains on the CPU only so far (its resharding and neighbour "
                "copies move host tensors over gloo): pass device='cpu', or sharding='ddp'"
            )
        if sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
        if sharding == "fsdp" and isinstance(optimizer, optimizers.Optimizers):
            raise ValueError("sharding='fsdp' takes one optimizer so far: use sharding='ddp'")
        if sharding == "fsdp" and grad_scaler is not None:
            raise ValueError(
                "grad_scaler= is not supported with sharding='fsdp' yet (its inf/NaN check "
                "would see only this member's shard): use bf16, or sharding='ddp'"
            )
        self._sharding = sharding
        if sharding == "fsdp":  # refused now, not when the job first forms a group
            from tidal.worker.shards import check_shardable

            check_shardable({n: tuple(p.shape) for n, p in model.named_parameters()}, 1)
        devices.place_module(model, optimizer, self.device)
        devices.check_tracked_devices(dict(state or {}), self.device)
        check_loader(data, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
        self.module = model
        self.optimizer = optimizer
        data, loading = unwrap(
            data,
            LoaderOptions(
                collate_fn=collate_fn,
                num_workers=num_workers,
                pin_memory=pin_memory,
                prefetch_factor=prefetch_factor,
                persistent_workers=persistent_workers,
                worker_init_fn=worker_init_fn,
            ),
        )
        self.dataset = data
        self.lr_scheduler = lr_scheduler
        self.grad_scaler = grad_scaler
        self._update = Update(
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            grad_scaler=grad_scaler,
            clip_grad_norm=clip_grad_norm,
        )
        self._tracked = TrackedState(self._update.tracked(state))
        self._tracked.check()  # what cannot be carried is refused now, not at a checkpoint
        self.sampler = ElasticSampler(
            dataset_size=None if classify(data) == STREAM else len(data),
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            seed=seed,
        )
        self.step = 0  # committed steps
        self.rank = 0
        self.world_size = 1
        self.generation = 0
        self.completed = False
        self._has_state = False
        self._agreed = False  # its settings checked against the job's (``identity``)
        # What every worker must agree on (``identity``): fixed once the Trainer is made.
        self._identity = (
            identity.settings(self.sampler, sharding, clip_grad_norm)
            | identity.origin(sys.argv[0] if sys.argv else "")
            | identity.kinds(optimizer, self._tracked.objects)
        )
        self._landing: list[torch.Tensor] = []  # until the first forming (``landing``)
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self._fsdp: Any = None  # tidal.worker.fsdp.Fsdp under tidal run with sharding="fsdp"
        self._shrink = False  # this member knows the next generation drops a member
        self._final_state: dict[str, torch.Tensor] | None = None
        self._recovery: tuple[str | None, int] = (None, 0)  # how the last forming healed
        self._ckpt_agreed = False  # fsdp: the members agreed to checkpoint this step
        self._last_sharded_ckpt: int | None = None
        self._control = ddp.ControlWord(self.device)
        self._backend = "gloo"  # the process groups' backend, chosen when the job is joined
        self._watch: AbortWatch | None = None  # bounds a collective a peer left (joined)
        self._waits = Waits()  # gloo: the waits the watch can cut (``waits``)
        self._members: list[int] = []  # the worker ids of the generation this one formed
        self._step_s: float | None = None  # a recent step's time (the watch's grace)
        #: The index of the next step that carries a control word (``_before_sync``); None
        #: while a word's sums are awaited. Every generation starts with one (``_form``).
        self._next_word: int | None = 0
        self._items_mode = False  # the steps count items (``Step.backward(items=)``)
        #: ((generation, step), calls) of ``evaluate`` in the step in flight (``evaluation``)
        self._eval_calls: tuple[tuple[int, int] | None, int] = (None, 0)
        self._debug_on = bool(os.environ.get("TIDAL_DEBUG"))
        self._agent: Agent | None = None
        self._store: dist.Store | None = None  # an ``AuthStore`` (``_connect_store``)
        self._notices = Notices()  # rank 0's view of the coordinator's change counter
        self._stopping = False
        self._last_rank: int | None = None  # rank in the last generation this worker formed
        self._durable: Durable | None = None
        self._stall_pending = False
        self._split = [0.0, 0.0]  # compute and communication seconds since the last report
        self._last_step_time: float | None = None
        self._last_step_gen: int | None = None
        self._gen_prev_gen: int | None = None
        self._gen_prev_time: float | None = None
        self._gen_first_pending = False
        # DDP broadcasts its rebuilt bucket order inside the first forward after its first
        # backward: a peer lost right then would raise in the user's forward. The trainer
        # makes that collective itself, at the step boundary (``_settle_buckets``).
        self._buckets_pending = False
        self._failed_forms = 0  # in a row: widens the connect window (group.connect_timeout)
        # When this worker began joining, met its peers, formed the group, and healed: the
        # phases of its pause, reported with its first step in the generation.
        self._t_join = self._t_rendezvous = self._t_formed = self._t_healed = 0.0
        self._report_pending = False
        self._rate_mark = (time.monotonic(), 0)
        self._pipeline = Pipeline(data, self.sampler, loading)
        self._non_blocking = loading.pin_memory and self.device.type == "cuda"

    # -- user surface ----------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The module to call in the loop: the DDP wrapper or the FSDP module of the current
        generation (the module itself when training alone)."""
        if self._fsdp is not None and self._fsdp.module is not None:
            return self._fsdp.module
        return self._ddp if self._ddp is not None else self.module

    @property
    def grad_norm(self) -> float | None:
        """The total norm of the last committed step's synchronised gradients, before
        clipping (unscaled, divided by the item count with ``items=``): the same on every
        member. Log it with ``tidal.log(grad_norm=...)``. With ``clip_grad_norm`` it is a
        by-product of clipping; without, the first read turns its measuring on (a pass over
        the gradients per step, which no script that never reads it pays), and it is None
        until a step has been measured."""
        self._update.measure_norm = True
        norm = self._update.grad_norm
        return None if norm is None else float(norm)

    @property
    def job_name(self) -> str | None:
        """The job's name under ``tidal run`` (the same in every worker, through every
        resize and ``tidal resume``: a tracker's run id), known once ``run()`` has joined
        the job; None when training alone."""
        cfg = getattr(self, "_cfg", None)
        return cfg.name if cfg is not None else None

    @property
    def worker_id(self) -> int | None:
        return self._env.worker_id if self._env else None

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """On rank 0, the whole model's state as plain tensors (copies), e.g. to save the
        final model after ``run()``; None on the other ranks. With ``sharding="fsdp"`` the
        members gather it onto rank 0 when the job's last step is done."""
        if self._fsdp is not None:
            if self._final_state is None and self._last_rank == 0:
                raise RuntimeError(
                    "full_state_dict() with sharding='fsdp' is available once run() has "
                    "finished the job (the members gather it at the job's last step)"
                )
            return self._final_state if self._last_rank == 0 else None
        if self.rank != 0:
            return None
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def evaluate(
        self, fn: Callable[[Any], Mapping[str, Any]], dataset: Any, *, batch_size: int
    ) -> dict[str, float]:
        """The means of ``fn``'s metrics over ``dataset``, its batches split across the
        current members: the same values at any world size, alone included, and after a
        member is lost during it (``evaluation``). Call it alike on every member."""
        return evaluation.evaluate(self, fn, dataset, batch_size)

    def after_step(self, fn: Callable[[int], None]) -> Callable[[int], None]:
        """Register ``fn(index)`` to run once after each committed step's optimizer step (and
        the scheduler's), the place for EMA updates and anything else that must happen once
        per step; usable as a decorator. Whatever it changes must be tracked (``state=``)
        to survive membership changes."""
        self._update.hooks.append(fn)
        return fn

    def run(self, max_steps: int) -> Iterator[Step]:
        """Yield a ``Step`` for each global step this worker takes part in, until the job
        has done ``max_steps`` steps (``completed`` is then True), the job is stopped (by
        ``tidal stop``, ``trainer.stop()`` or a ``break`` out of this loop on any member:
        ``stopping``), or the coordinator asks this worker to leave."""
        global _current
        if max_steps < 0:
            raise ValueError(f"max_steps must be at least 0, got {max_steps}")
        _current = self  # stays set after the loop: ``log`` after it still reports
        try:
            if self._env is None:
                yield from self._run_alone(max_steps)
            else:
                yield from self._run_elastic(max_steps)
        finally:
            self._pipeline.close()  # the loader's worker processes, if any

    # -- standalone ------------------------------------------------------------------
    def _run_alone(self, max_steps: int) -> Iterator[Step]:
        while self.step < max_steps and not self._stop_asked:
            step = LoopStep(self, self.step, self.sampler.shard(self.step, 0, 1))
            self._update.begin()
            try:
                yield step
            except GeneratorExit:  # left in the body: as under tidal run (``stopping``)
                if commits_on_break(step):
                    self._commit()
                raise
            self._commit()
        self.completed = self.step >= max_steps

    def _checkpoint(self) -> None:
        self._durable.save(
            step=self.step,
            module=self.module,
            optimizer=self.optimizer,
            tracked=self._tracked,
            meta={"world_size": self.world_size, **self._position()},
        )
        self._stall_pending = True

    def _position(self) -> dict[str, object]:
        """Where the data stands after the committed steps, for a checkpoint's meta: the
        position and what fixes it (``identity.check_resume`` compares it at resume)."""
        order = identity.data_order(self.sampler)
        return {**vars(self.sampler.position(self.step)), "data_order": order}

    def _before_sync(self, step: Step) -> None:
        """Set the control word for this step's all-reduce from the newest answer, if the
        step carries one (``ddp`` module doc: a generation's first step, then every
        ``ControlWord.every`` steps; a sharded step always carries its flags)."""
        if self._ddp is None and (self._fsdp is None or self._fsdp.module is None):
            return
        index, gen = step.index, self.generation
        self._control.before_allreduce = lambda: probes.point("allreduce", index, gen)
        if self._ddp is not None and not self._word_due(index):
            self._control.skip()
            return
        latest = self._newest_answer()
        newer = latest is not None and (
            latest.role != Role.MEMBER
            or (latest.generation is not None and latest.generation.id > self.generation)
        )
        if newer and index + 1 in self._cfg.hold_steps:
            # The commit reaches a --schedule step: every member holds there and forms from
            # the hold's answer (no second round trip), even when it already knows the
            # change (applied a step ahead: ``rules.schedule_ahead``) as this word is set.
            newer = False
        stop = latest is not None and latest.stop
        every = ddp.control_every(self._step_s) if self.rank == 0 else 0
        self._control.set(switch=newer, stop=stop, every=every)
        if self._ddp is not None:  # started by the last micro-batch's ``backward``
            self._next_word = None  # known from the sums, once the step is committed
        if self._fsdp is not None:
            members = latest.generation.members if newer and latest.role == Role.MEMBER else None
            self._shrink = newer and self._fsdp.shrinks(members)

    def _word_due(self, index: int) -> bool:
        """Whether step ``index`` carries a control word (``ddp`` module doc): a job whose
        steps use ``items=`` sums its item count on every step's word."""
        return self._items_mode or self._next_word is None or index >= self._next_word

    def _commit(self) -> None:
        if self._durable is not None:
            self._durable.quiesce()  # a snapshot may still be copying what the step changes
            if self._stall_pending and self._agent is not None:
                self._stall_pending = False
                self._agent.post_metrics({"checkpoint_stall_s": self._durable.last_stall_s})
        self._update.apply(
            self.step, grad_norm=self._fsdp.grad_norm if self._fsdp is not None else None
        )
        self.step += 1
        self._has_state = True
        now = time.time()
        if self._last_step_gen == self.generation and self._last_step_time is not None:
            self._step_s = now - self._last_step_time
        self._send_report()  # the generation's first step's, one step on
        if self._gen_first_pending and self._agent is not None:
            self._debug(f"first step {self.step} in gen {self.generation}")
            self._gen_first_pending = False
            self._buckets_pending = self._ddp is not None
            probes.point("first", self.step - 1, self.generation)
            self._agent.post_report(
                StepReport(
                    generation=self.generation,
                    start_step=self.step - 1,
                    prev_generation=self._gen_prev_gen,
                    prev_last_step_time=self._gen_prev_time,
                    first_step_time=now,
                    phases=self._pause_phases(now),
                    recovery=self._recovery[0],
                    redone_steps=self._recovery[1],
                )
            )
            self._report_pending = True
        self._last_step_time = now
        self._last_step_gen = self.generation
        if self._agent is not None:
            self._agent.step = self.step
            self._maybe_report_rate()

    def _log(self, metrics: dict[str, float], reduce: str | None = None) -> None:
        """Record ``metrics`` for ``self.step``: the step in flight inside the loop (committed
        after the loop body), the final count after it. Only a member of its last generation
        speaks (a worker removed from the job does not), and only rank 0 unless ``reduce``."""
        rank = self._last_rank
        if self._agent is None or rank is None or (reduce is None and rank != 0):
            return
        self._agent.post_step_metrics(self.step, self.generation, metrics)

    def _debug(self, msg: str) -> None:
        if self._debug_on:
            print(f"tidal-debug {time.time():.4f} w{self.worker_id}: {msg}", flush=True)
