"""Ending the job from the script: ``trainer.stop()`` and ``break`` out of ``trainer.run``.

Contracts:

- **Which step is committed.** ``trainer.stop()`` inside a step's body: that step is
  committed as usual, then the loop ends. Leaving the loop inside a step's body (``break``;
  a ``raise`` closes the loop's generator the same way): the step is committed iff its
  micro-batches were all consumed with no failure, i.e. its last ``backward`` (and under
  ``tidal run`` its all-reduce) completed on this member (``commits_on_break``): its update
  is applied, as a plain PyTorch loop's ``optimizer.step()`` before the ``break`` would have
  been. Otherwise nothing of it is kept (tracked state rewound, gradients dropped). Members
  agree: an all-reduce completes on one member only once every member's backward ran.
- **Every member ends at that step.** Under ``tidal run`` the member tells the coordinator,
  in a blocking call and before it leaves its group, at which committed step it stops
  (``Agent.report_stop``; ``tidal.coordinator.rules.stop_rules``). Its peers' next collective
  then fails (it left), or their answer says ``stop``: a member that sees the stop after a
  failed step ends there (``ScriptStop.fail_step``) instead of reporting a failure, so no generation
  is opened and nothing is replaced. Members that all break at the same step simply all
  report it; the first report fixes the stop and its checkpoint's writer.
- **The final checkpoint.** Written by the member the coordinator names (the first to
  report: it holds the stop step for certain), and by nobody else (``writes_final``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tidal.client import CoordinatorError
from tidal.protocol import StopAnswer
from tidal.worker.trainer.step import COMMITTED, Step

if TYPE_CHECKING:
    from tidal.worker.trainer.parts import Parts

log = logging.getLogger(__name__)


class LoopStep(Step):
    """The ``Step`` the loop yields: a ``Step`` that notes when its micro-batches were all
    consumed (``commits_on_break``)."""

    consumed = False  # every micro-batch was handed to the loop's body

    def micro_batches(self) -> Iterator[Any]:
        yield from super().micro_batches()
        self.consumed = True


def commits_on_break(step: Step) -> bool:
    """Whether the step whose body the loop was left in is to be committed now (module
    doc): all of its micro-batches consumed (each backward run in the loop's body), nothing
    failed, and nothing decided yet (a driven step's ``optimizer.step()`` decides in the
    body: ``ElasticLoop.finish``)."""
    return step.outcome is None and getattr(step, "consumed", False) and step.failed is None


def writes_final(
    *,
    finished: bool,
    last_rank: int | None,
    sharded: bool,
    answer: StopAnswer | None,
    stop_step: int | None,
) -> bool:
    """Whether this member writes the job's final checkpoint as its loop ends. ``answer``:
    the coordinator's answer to this member's own stop report (None: it made none);
    ``stop_step``: the newest answer says a member's script stopped the job. The writer the
    coordinator named when this member's script stopped the job; nobody else when another
    member's did; otherwise (a stop report that stopped nothing, a completed or
    ``tidal stop``-ped job) rank 0 of the last generation (never under sharding: every
    member writes its shard at the job's last step)."""
    if answer is not None and answer.step is not None:
        return answer.writer
    if stop_step is not None:
        return False
    return (finished or answer is not None) and last_rank == 0 and not sharded


class ScriptStop:
    """The Trainer's side of an early stop, as one of its parts (module doc)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        #: ``trainer.stop()`` was called, or the loop was left inside a step's body.
        self.asked = False

    def stop(self) -> None:
        """``trainer.stop()``: end the job after the current step."""
        self.asked = True

    def left_in(self, step: Step, mark: Any) -> None:
        """The loop was left inside ``step``'s body (the generator closed at its ``yield``):
        commit the step or drop it (``commits_on_break``); the job ends here."""
        self.asked = True
        if step.outcome == COMMITTED:  # committed in the body (a driven step)
            return
        if commits_on_break(step):
            self.parts.loop.commit()
            return
        if mark is not None:
            self.parts.objects.tracked.rewind(mark)
        self.parts.objects.optimizer.zero_grad(set_to_none=True)

    def report_script_stop(self) -> StopAnswer | None:
        """If this member's script ended the job, tell the coordinator (blocking) before it
        leaves its group; the answer names the stop step and the checkpoint's writer."""
        link, membership = self.parts.link, self.parts.membership
        if not self.asked or link.agent is None or membership.last_rank is None:
            return None
        step = self.parts.update.step
        try:
            answer = link.agent.report_stop(
                generation=membership.generation, step=step, writes=self.parts.sharded.fsdp is None
            )
        except CoordinatorError as exc:  # refused: it ends alone, as before
            log.warning("tidal: worker %s: the stop was refused: %s", link.worker_id, exc)
            return None
        log.info(
            "tidal: worker %s: the script stopped the job at step %s (job stops at %s)",
            link.worker_id,
            step,
            answer.step,
        )
        return answer

    def fail_step(self, error: Exception) -> bool:
        """After a failed step, the member having left its group: False if a member's
        script stopped the job (the failure is that member leaving: nothing to report, the
        job ends at this member's committed step); otherwise report the failure and join the
        next generation (``Membership.join``, given the answer fetched here: no round trip
        added)."""
        link, membership = self.parts.link, self.parts.membership
        link.notices.mark()  # before the answer, which ``join`` takes as fetched
        answer = link.agent.fetch()
        if answer.stop_step is not None:
            membership.stopping = True
            return False
        membership.report_failure(membership.generation, error)
        return membership.join(answer)

    def stop_step(self) -> int | None:
        """The step a member's script stopped the job at, per the newest answer."""
        latest = self.parts.link.latest()
        return latest.stop_step if latest is not None else None
