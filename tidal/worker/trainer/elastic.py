"""The elastic loop: a ``Trainer`` under ``tidal run``, from registration to its done report.

One part of a ``Trainer`` (``parts``): the step boundary (``before_sync``, ``commit``), alone
or not, and the loop under ``tidal run``; joining, forming and leaving generations are
``membership``'s. Contracts:

- A step is committed only when this member's all-reduce completed (``Step.failed`` is
  None); a failed step's tracked state is rewound, the member leaves the generation,
  reports the failure and joins the next one, where the step is redone after healing.
- What becomes of a step is decided once (``finish``): after its body, or inside it when
  the script's own loop ends the step with ``optimizer.step()`` (``driven``, for
  ``tidal.prepare``); the boundary (checkpoint, change, heal) always comes after the body,
  when the loop asks for the next step.
- A change takes effect only at a step boundary every member reached: after a step whose
  control word said ``switch`` or ``stop``, or at a --schedule step the member holds at
  (``hold_steps``). A member that knows, before its update, that the generation after the
  step leaves it out leaves with the step uncommitted, as after a failed step
  (``leaving``).
- However the loop ends (completed, stopped, told to leave, an exception in the script),
  the member sends its pending report, leaves its group, writes the final checkpoint when
  it is the last generation's rank 0 and the job finished or stopped, waits for any
  checkpoint in flight, and reports done. When the script ended the loop (``trainer.stop()``,
  ``break``) the member first reports the stop, and the coordinator names the checkpoint's
  writer (``stopping``).
- Every collective is bounded by the abort watch (``watch``): on gloo it fails the waits it
  gives up on and cuts the group's connections; on NCCL it aborts the communicators.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tidal.protocol import Departure, Role
from tidal.worker import probes
from tidal.worker.membership import busy, ddp
from tidal.worker.state import landing
from tidal.worker.trainer.step import COMMITTED, FAILED, LEFT, Step
from tidal.worker.trainer.stopping import LoopStep, commits_on_break, writes_final

if TYPE_CHECKING:
    from tidal.worker.agent.client import Agent
    from tidal.worker.trainer.parts import Parts
    from tidal.worker.trainer.runtime import Trainer


def post_step_metrics(
    agent: Agent | None,
    *,
    last_rank: int | None,
    step: int,
    generation: int,
    metrics: dict[str, float],
    reduce: str | None,
) -> None:
    """Record ``metrics`` for ``step``: the step in flight inside the loop (committed after
    the loop body), the final count after it. Only a member of its last generation speaks
    (a worker removed from the job does not), and only rank 0 unless ``reduce``."""
    if agent is None or last_rank is None or (reduce is None and last_rank != 0):
        return
    agent.post_step_metrics(step, generation, metrics)


class ElasticLoop:
    """The step boundary and the elastic loop of one Trainer (module doc)."""

    def __init__(self, parts: Parts, trainer: Trainer) -> None:
        self.parts = parts
        self.trainer = trainer  # what each ``Step`` hands the script
        self.completed = False  # the job did its ``max_steps`` steps
        #: The index of the next step that carries a control word (``before_sync``); None
        #: while a word's sums are awaited. Every generation starts with one
        #: (``generation_formed``).
        self.next_word: int | None = 0
        self.items_mode = False  # the steps count items (``Step.backward(items=)``)
        self.timeout_gen: int | None = None  # the generation given ``busy.long_timeout``
        self.max_steps = 0  # the job's length (``run_alone``, ``run_elastic``)
        #: The index of the step whose body runs (``tidal.log``'s step), None outside one.
        self.in_body: int | None = None

    def step(self, index: int) -> LoopStep:
        """The ``Step`` the loop yields for step ``index``."""
        m = self.parts.membership
        indices = self.parts.loader.shard(index, m.rank, m.world_size)
        return LoopStep(self.trainer, index, indices, parts=self.parts)

    # -- the step boundary ------------------------------------------------------------
    def generation_formed(self, step: int) -> None:
        """A generation formed at committed step ``step``: its first step carries a word."""
        self.next_word = step

    def word_sent(self) -> None:
        """The step's control word rides on its all-reduce: the next one's step is known
        from its sums, once the step is committed."""
        self.next_word = None

    def counts_items(self) -> None:
        """A step counted items (``items=``): every later step carries a word."""
        self.items_mode = True

    def word_due(self, index: int) -> bool:
        """Whether step ``index`` carries a control word (``ddp`` module doc): a job whose
        steps use ``items=`` sums its item count on every step's word."""
        return self.items_mode or self.next_word is None or index >= self.next_word

    def before_sync(self, step: Step) -> None:
        """Set the control word for this step's all-reduce from the newest answer, if the
        step carries one (``ddp`` module doc: a generation's first step, then every
        ``ControlWord.every`` steps; a sharded step always carries its flags)."""
        parts = self.parts
        m, link = parts.membership, parts.link
        if m.ddp is None and parts.sharded.live is None:
            return
        index, gen = step.index, m.generation
        control = m.control
        control.before_allreduce = lambda: probes.point("allreduce", index, gen)
        if m.ddp is not None and not self.word_due(index):
            control.skip()
            return
        latest = link.newest_answer(m.rank)
        newer = latest is not None and (
            latest.role != Role.MEMBER
            or (latest.generation is not None and latest.generation.id > m.generation)
        )
        if newer and index + 1 in link.cfg.hold_steps:
            # The commit reaches a --schedule step: every member holds there and forms from
            # the hold's answer (no second round trip), even when it already knows the
            # change (applied a step ahead: ``scale_rules.schedule_ahead``) as this word is set.
            newer = False
        stop = latest is not None and latest.stop
        every = ddp.control_every(parts.clock.step_s) if m.rank == 0 else 0
        control.set(switch=newer, stop=stop, every=every)
        if m.ddp is not None:  # started by the last micro-batch's ``backward``
            self.next_word = None  # known from the sums, once the step is committed
        parts.sharded.word(newer, latest)

    def finish(self, step: Step) -> str:
        """Decide what becomes of ``step`` once its last backward ran, and apply it if it
        commits: ``FAILED`` (its collective failed), ``LEFT`` (this member leaves before
        its update: ``leaving``) or ``COMMITTED``. Called once per step, by the loop after
        the body or earlier by the script's own ``optimizer.step()`` (``driven``); later
        calls return the outcome decided."""
        if step.outcome is not None:
            return step.outcome
        parts = self.parts
        m = parts.membership
        if step.failed is not None:
            step.outcome = FAILED
            return FAILED
        if parts.link.env is None:  # alone: no group, no generation to leave
            self.commit()
            step.outcome = COMMITTED
            return COMMITTED
        parts.clock.time_split(step.started, m.control)
        why = m.leaves_uncommitted(step.index + 1, self.max_steps)
        if why is not None:
            step.outcome, step.left_why = LEFT, why
            return LEFT
        step.held = m.hold_soon(step.index + 1, self.max_steps)
        self.commit()
        if self.next_word is None:  # the step carried a word: when the next rides
            self.next_word = step.index + m.control.every
        step.outcome = COMMITTED
        return COMMITTED

    def commit(self) -> None:
        """Apply the step in flight and do what follows a committed step: the generation's
        first step's report, the rate, the checkpoint's stall."""
        parts = self.parts
        link, update, clock, m = parts.link, parts.update, parts.clock, parts.membership
        if link.durable is not None:
            link.durable.quiesce()  # a snapshot may still be copying what the step changes
            if link.durable.stall_pending and link.agent is not None:
                link.agent.post_metrics({"checkpoint_stall_s": link.durable.take_stall()})
        update.commit(grad_norm=parts.sharded.grad_norm)
        now = clock.committed(m.generation)
        clock.send_report(link.agent)  # the generation's first step's, one step on
        if clock.first_pending and link.agent is not None:
            link.debug(f"first step {update.step} in gen {m.generation}")
            m.buckets_pending = m.ddp is not None
            probes.point("first", update.step - 1, m.generation)
            link.agent.post_report(
                clock.first_report(
                    generation=m.generation, step=update.step, now=now, recovery=m.recovery
                )
            )
        clock.ended(now, m.generation)
        if link.agent is not None:
            link.agent.step = update.step
            rate = clock.rate(
                step=update.step,
                rank=m.rank,
                world_size=m.world_size,
                global_batch_size=parts.loader.global_batch_size,
            )
            if rate is not None:
                link.agent.post_metrics(rate)

    def log(self, metrics: dict[str, float], reduce: str | None = None) -> None:
        """``tidal.log``: record ``metrics`` for the step in flight (``post_step_metrics``)."""
        m = self.parts.membership
        post_step_metrics(
            self.parts.link.agent,
            last_rank=m.last_rank,
            step=self.in_body if self.in_body is not None else self.parts.update.step,
            generation=m.generation,
            metrics=metrics,
            reduce=reduce,
        )

    def checkpoint(self) -> None:
        """Rank 0's checkpoint of the committed step (``durable``)."""
        parts = self.parts
        objects, step = parts.objects, parts.update.step
        parts.link.durable.save(
            step=step,
            module=objects.module,
            optimizer=objects.optimizer,
            tracked=objects.tracked,
            meta={"world_size": parts.membership.world_size, **parts.loader.position(step)},
        )

    # -- standalone -------------------------------------------------------------------
    def run_alone(self, max_steps: int) -> Iterator[Step]:
        """Train alone, with the same mathematics (no group, no coordinator)."""
        parts = self.parts
        update, stop = parts.update, parts.stop
        self.max_steps = max_steps
        while update.step < max_steps and not stop.asked:
            step = self.step(update.step)
            update.begin()
            self.in_body = step.index
            try:
                yield step
            except GeneratorExit:  # left in the body: as under tidal run (``stopping``)
                if commits_on_break(step):
                    self.commit()
                raise
            finally:
                self.in_body = None
            self.finish(step)
        self.completed = update.step >= max_steps

    # -- under tidal run --------------------------------------------------------------
    def run_elastic(self, max_steps: int) -> Iterator[Step]:
        """Register, join, train and leave (module doc)."""
        parts = self.parts
        objects, link, update, m = parts.objects, parts.link, parts.update, parts.membership
        sharded, stop, tracked = parts.sharded, parts.stop, objects.tracked
        self.max_steps = max_steps
        ddp.warm_up(objects.module)
        if objects.sharding == "ddp":  # memory a heal's optimizer state lands in, touched now
            m.landing = landing.prepare(objects.optimizer)
        link.register(max_steps)
        link.agent.post_metrics(  # the coordinator's cost projection and policy need these
            {"max_steps": max_steps, "global_batch_size": parts.loader.global_batch_size}
        )
        resumed = link.durable.resume(
            objects.module, objects.optimizer, tracked, data_order=parts.loader.data_order()
        )
        if resumed is not None:
            update.restore(resumed)
            m.landing = []  # its own state, loaded, is the landing now: not twice
            link.agent.step = resumed
        if objects.sharding == "fsdp":  # the module becomes the template: after any resume
            sharded.start()
        link.connect_store()
        finished = False
        try:
            member = m.join()
            while member and update.step < max_steps and not m.stopping:
                if m.buckets_pending and not m.settle_buckets():
                    member = m.join()
                    continue
                if self.timeout_gen != m.generation and sharded.fsdp is None:
                    busy.long_timeout(link.backend)  # the watch bounds the steps (``busy``)
                    self.timeout_gen = m.generation
                index = update.step
                probes.point("step", index, m.generation)
                step = self.step(index)
                mark = tracked.mark() if tracked else None
                update.begin()
                self.in_body = index
                try:
                    yield step
                except GeneratorExit:  # the script left the loop in the body (``stopping``)
                    stop.left_in(step, mark)
                    raise
                finally:
                    self.in_body = None
                outcome = self.finish(step)
                if outcome == FAILED:
                    if mark is not None:  # the step is redone: what it moved moves back
                        tracked.rewind(mark)
                    m.leave_group(failed=True)
                    member = stop.fail_step(step.failed)
                    continue
                if outcome == LEFT:
                    if link.agent is not None:  # an event of the job's (``Departure``)
                        link.agent.post_departure(
                            Departure(step=index, generation=m.generation, why=step.left_why)
                        )
                    if mark is not None:  # as after a failed step: the step is not applied
                        tracked.rewind(mark)
                    objects.optimizer.zero_grad(set_to_none=True)
                    m.leave_group()
                    member = m.join()
                    continue
                held = step.held
                if sharded.fsdp is None and link.durable.due(update.step) and m.rank == 0:
                    self.checkpoint()
                if not (sharded.checkpoint_taken() and sharded.copies_taken()):
                    member = m.join()
                    continue
                if stop.asked:  # ``trainer.stop()`` in this step's body
                    break
                if m.control.stop:
                    m.stopping = True
                elif update.step >= max_steps:
                    break
                elif m.control.switch or (
                    update.step in link.cfg.hold_steps and m.hold(update.step, held)
                ):
                    # Held at this step (no switch): form from the answer that released it.
                    answer = None if m.control.switch else m.hold_answer[1]
                    sharded.gather_for_leavers()
                    m.leave_group()
                    member = m.join(answer)
            if member and sharded.fsdp is not None and not stop.asked:  # the group lives
                sharded.checkpoint_taken(final=True)
                sharded.gather_final()
            self.completed = update.step >= max_steps
            finished = member or m.stopping
        finally:
            parts.clock.send_report(link.agent)  # before the done report, as a later step would
            stopped = stop.report_script_stop()  # before leaving: peers find it as they fail
            m.leave_group()
            if writes_final(
                finished=finished,
                last_rank=m.last_rank,
                sharded=sharded.fsdp is not None,
                answer=stopped,
                stop_step=stop.stop_step(),
            ):
                self.checkpoint()
            link.durable.close()
            link.stop_watchers()
            try:
                link.agent.report_done(step=update.step, completed=self.completed)
            finally:
                atexit.register(link.agent.close)
