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

import atexit
import datetime
import os
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from tidal import devices
from tidal.protocol import Role, StepReport
from tidal.tracked import Stateful, TrackedState
from tidal.worker import ddp, identity, landing, norms, probes
from tidal.worker import group as grp
from tidal.worker.agent import Agent, WorkerEnv
from tidal.worker.data import ElasticSampler
from tidal.worker.durable import Durable
from tidal.worker.membership import Membership
from tidal.worker.notice import Notices
from tidal.worker.pipeline import STREAM, LoaderOptions, Pipeline, classify, unwrap
from tidal.worker.reports import Reports
from tidal.worker.sharded_steps import ShardedSteps
from tidal.worker.step import Step
from tidal.worker.update import Update
from tidal.worker.waits import Waits
from tidal.worker.watch import AbortWatch, Facts

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


class Trainer(Membership, ShardedSteps, Reports):
    """Elastic data-parallel training of ``model`` with ``optimizer`` over ``dataset``.

    Under ``tidal run`` it joins the job's coordinator; run as a plain script it trains
    alone with the same mathematics, which makes the script easy to debug.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
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
    ) -> None:
        """``data``: a map-style dataset, a torch ``IterableDataset`` or a stream with
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
        them."""
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
        self._debug_on = bool(os.environ.get("TIDAL_DEBUG"))
        self._agent: Agent | None = None
        self._store: dist.TCPStore | None = None
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

    def after_step(self, fn: Callable[[int], None]) -> Callable[[int], None]:
        """Register ``fn(index)`` to run once after each committed step's optimizer step (and
        the scheduler's), the place for EMA updates and anything else that must happen once
        per step; usable as a decorator. Whatever it changes must be tracked (``state=``)
        to survive membership changes."""
        self._update.hooks.append(fn)
        return fn

    def run(self, max_steps: int) -> Iterator[Step]:
        """Yield a ``Step`` for each global step this worker takes part in, until the job
        has done ``max_steps`` steps (``completed`` is then True), the job is stopped, or
        the coordinator asks this worker to leave."""
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
        while self.step < max_steps:
            step = Step(self, self.step, self.sampler.shard(self.step, 0, 1))
            self._update.begin()
            yield step
            self._commit()
        self.completed = True

    # -- elastic ---------------------------------------------------------------------
    def _run_elastic(self, max_steps: int) -> Iterator[Step]:
        assert self._env is not None
        ddp.warm_up(self.module)
        if self._sharding == "ddp":  # memory a heal's optimizer state lands in, touched now
            self._landing = landing.prepare(self.optimizer)
        self._agent = Agent(self._env)
        self._agent.install_preemption_handler()
        cfg = self._agent.register(max_steps=max_steps).config
        self._cfg = cfg
        self._start_comm(cfg.comm)
        self._durable = Durable(cfg, self._agent)
        self._agent.post_metrics(  # the coordinator's cost projection and policy need these
            {"max_steps": max_steps, "global_batch_size": self.sampler.global_batch_size}
        )
        resumed = self._durable.resume(
            self.module, self.optimizer, self._tracked, data_order=identity.data_order(self.sampler)
        )
        if resumed is not None:
            self.step, self._has_state = resumed, True
            self._landing = []  # its own state, loaded, is the landing now: not twice
            self._agent.step = resumed
        if self._sharding == "fsdp":  # the module becomes the template: after any resume
            self._start_sharded(cfg)
        self._connect_store()
        finished = False
        try:
            member = self._join()
            while member and self.step < max_steps and not self._stopping:
                if self._buckets_pending and not self._settle_buckets():
                    member = self._join()
                    continue
                index = self.step
                probes.point("step", index, self.generation)
                step = Step(self, index, self.sampler.shard(index, self.rank, self.world_size))
                mark = self._tracked.mark() if self._tracked else None
                self._update.begin()
                yield step
                if step._failed is not None:
                    if mark is not None:  # the step is redone: what it moved moves back
                        self._tracked.rewind(mark)
                    self._leave_group(failed=True)
                    self._report_failure(self.generation, step._failed)
                    member = self._join()
                    continue
                self._time_split(step)
                held = self._hold_soon(index + 1, max_steps)
                self._commit()
                if self._next_word is None:  # the step carried a word: when the next rides
                    self._next_word = index + self._control.every
                if self._fsdp is None and self._durable.due(self.step) and self.rank == 0:
                    self._checkpoint()
                if not (self._sharded_checkpoint_taken() and self._copies_taken()):
                    member = self._join()
                    continue
                if self._control.stop:
                    self._stopping = True
                elif self.step >= max_steps:
                    break
                elif self._control.switch or (
                    self.step in self._cfg.hold_steps and self._hold(self.step, held)
                ):
                    # Held at this step (no switch): form from the answer that released it.
                    answer = None if self._control.switch else self._hold_answer[1]
                    self._gather_for_leavers()
                    self._leave_group()
                    member = self._join(answer)
            if member and self._fsdp is not None:  # the job's last step, while the group lives
                self._sharded_checkpoint_taken(final=True)
                self._gather_final()
            self.completed = self.step >= max_steps
            finished = member or self._stopping
        finally:
            self._send_report()  # before the done report, as a later step would have sent it
            self._leave_group()
            if finished and self._last_rank == 0 and self._fsdp is None:  # completion or stop
                self._checkpoint()
            self._durable.wait()
            if self._watch is not None:
                self._watch.stop()
            self._notices.close()
            try:
                self._agent.report_done(step=self.step, completed=self.completed)
            finally:
                atexit.register(self._agent.close)

    def _start_comm(self, comm: str) -> None:
        """Choose the process groups' backend (``devices.resolve_comm``) and start the abort
        watch (``watch``). On gloo the watch fails the waits it gives up on and cuts the
        group's connections (``waits``); on NCCL it aborts the communicators, and the worker
        takes its device, torch's watchdog told to do nothing."""
        self._backend = devices.resolve_comm(comm, self.device)
        if self._backend != "nccl":
            self._control.waits = self._waits
            self._watch = AbortWatch(self._watch_facts, self._cut_group)
            return
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # the watch handles errors
        torch.cuda.set_device(self.device)
        self._watch = AbortWatch(self._watch_facts, grp.abort_group)

    def _cut_group(self) -> None:
        """The gloo watch's abort: the training thread's wait fails, the peers' see the
        connections close."""
        self._waits.abort("the abort watch cut a collective a peer left")
        grp.cut_group()

    def _other_ports(self) -> tuple[int, ...]:
        """The ports of this worker's connections besides its group's: the coordinator's
        API (the store's is known to ``form_group``)."""
        port = urllib.parse.urlsplit(self._env.url).port
        return (port,) if port is not None else ()

    def _watch_facts(self, open_s: float | None) -> Facts:
        latest = self._agent.latest() if self._agent else None
        dropped = False
        if latest is not None and latest.generation is not None:
            gen = latest.generation
            dropped = gen.id > self.generation and not set(self._members) <= set(gen.members)
        return Facts(
            open_s=open_s,
            step_s=self._step_s,
            dropped=dropped,
            timeout_s=self._cfg.collective_timeout_s,
        )

    def _connect_store(self) -> None:
        """A client of the store named by the newest registration (a restarted coordinator
        serves a new one: ``Agent.epoch`` tells)."""
        cfg = self._agent.config
        self._store_epoch = self._agent.epoch
        self._cfg = cfg
        self._agreed = False  # a new store holds no settings yet: agree again (``identity``)
        self._store = dist.TCPStore(
            cfg.store_host,
            cfg.store_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=cfg.collective_timeout_s),
        )

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
        if self._ddp is not None and self._next_word is not None and index < self._next_word:
            self._control.skip()
            return
        latest = self._newest_answer()
        newer = latest is not None and (
            latest.role != Role.MEMBER
            or (latest.generation is not None and latest.generation.id > self.generation)
        )
        stop = latest is not None and latest.stop
        every = ddp.control_every(self._step_s) if self.rank == 0 else 0
        self._control.set(switch=newer, stop=stop, every=every)
        if self._ddp is not None:
            self._control.start()  # summed beside the forward and backward
            self._next_word = None  # known from the sums, once the step is committed
        if self._fsdp is not None:
            members = latest.generation.members if newer and latest.role == Role.MEMBER else None
            self._shrink = newer and self._fsdp.shrinks(members)

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
