"""Steps driven from a loop the script owns (``tidal.prepare``), as one part of a ``Trainer``.

The script keeps its own loop (``for batch in loader: loss.backward(); optimizer.step();
scheduler.step(); optimizer.zero_grad()``) and the prepared objects (``tidal.worker.compat.prepare``)
turn its calls into the moves of the same generator ``Trainer.run`` yields from
(``ElasticLoop``): one implementation of steps, membership, healing and commits. Contracts:

- **Batches.** A step's share is handed out as the loader's batches: one per step, or its
  micro-batches (``micro_batch_size``), all but the last inside DDP's ``no_sync``
  (``Step.micro_batches``). A loader iterator is the rest of the job's current epoch: it
  ends before a step of another epoch (that step waits for the next iterator), and ends for
  good once the job's loop has ended on this member.
- **Weights.** The script calls ``loss.backward()`` on each micro-batch's per-sample MEAN
  loss; a hook on every parameter's gradient multiplies it by the micro-batch's share of
  the global batch (``Step.weight``) before it is accumulated and before DDP reduces it, so
  the summed update is the mean over the global batch at any world size. A weight of 1 (one
  micro-batch per step in one process) multiplies nothing: alone, the loop trains exactly
  as it does without Tidal.
- **Accumulation out of sight.** Between a step's micro-batches the gradients accumulate
  aside (``_stow``), not in ``.grad``, and join the last micro-batch's gradient before DDP
  reduces it (the same sums, in the same order, as accumulating in ``.grad``). So the
  unchanged loop's ``clip_grad_norm_`` after each batch finds no gradient until the step's
  last batch, and clips the step's whole synchronised gradient once, as the plain loop does.
- **The step's end.** ``optimizer.step()`` after the step's last micro-batch settles the
  step (``Step.end_sync``: a failed all-reduce was kept by the gradients' hook, never raised
  in the script's ``loss.backward()``) and decides it (``ElasticLoop.finish``): committed,
  it is applied there (the parameters are updated when ``step()`` returns); failed, or left
  by a member leaving the job, it is not. After an earlier micro-batch ``step()`` does
  nothing (the gradients accumulate), and so does ``zero_grad()`` inside a step (each
  step's end drops the gradients anyway). A step whose last micro-batch gets no
  ``optimizer.step()`` before the next batch is asked for is refused (``StepNotEnded``).
- **The boundary.** The loop's next request for a batch resumes the generator: after a
  committed step, the checkpoint, a membership change and its heal; after a failed one, the
  rewind, the re-form, the heal, and the step again. So whatever the script does after
  ``optimizer.step()`` (``scheduler.step()``, an EMA update, a log line) belongs to that
  step on every member, and a joiner is healed with it.
- **The scheduler** steps when the script calls it, if this member is between steps or at
  the end of a committed step (``scheduler_may_step``): never between micro-batches, after a
  step that was not applied (the step comes again), or before a step the loop has not
  taken a batch of (a step that came after a heal, of an epoch not reached yet).
- **The end.** The job's loop ends when the script asks for a batch after the job's last
  step. A script that stops asking earlier (a ``break`` out of every loop, an exception)
  ends it when the process exits (``close``), as ``trainer.stop()`` would: the job stops at
  this member's committed step. A worker the job no longer needs (a scale-down) exits 0
  when it next asks for a batch, so the script's code after its loop (a save) runs on the
  members that finished the job only.
"""

from __future__ import annotations

import atexit
import logging
from typing import TYPE_CHECKING, Any

import torch

from tidal.worker.trainer.step import COMMITTED, Step

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tidal.worker.trainer.parts import Parts
    from tidal.worker.trainer.runtime import Trainer

log = logging.getLogger(__name__)


class StepNotEnded(RuntimeError):
    """The loop asked for the next batch before calling ``optimizer.step()`` on a step's
    last micro-batch (module doc)."""


class Driven:
    """The steps of one Trainer, driven from the script's own loop (module doc)."""

    def __init__(self, parts: Parts, trainer: Trainer) -> None:
        self.parts = parts
        self.trainer = trainer  # whose ``run`` is the generator driven here
        self.max_steps: int | None = None  # the job's length, once ``start``-ed
        #: The step in flight: handed out by the generator, its batches being taken (or
        #: none yet: it waits for the next loader iterator), or ended.
        self.step: Step | None = None
        self.ended = False  # the step in flight's ``optimizer.step()`` was called
        self.done = False  # the job's loop has ended on this member
        self._run: Iterator[Step] | None = None
        self._batches: Iterator[Any] | None = None  # the step in flight's micro-batches
        self._weight: float | None = None  # the micro-batch in flight's (``_weigh``)
        self._last = False  # the micro-batch in flight is its step's last
        self._weighed = False  # the micro-batch in flight's backward reached a gradient
        #: The step's gradients so far, by parameter, while its micro-batches accumulate.
        self._stash: dict[torch.Tensor, torch.Tensor] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    # -- set up --------------------------------------------------------------------
    def start(self, max_steps: int) -> Driven:
        """Drive the Trainer's steps until the job has done ``max_steps``: the gradients'
        weights and the hook's catching armed, the end at exit registered."""
        if self.max_steps is not None:
            raise RuntimeError("this Trainer's steps are already driven by a prepared loop")
        if max_steps < 0:
            raise ValueError(f"max_steps must be at least 0, got {max_steps}")
        self.max_steps = max_steps
        self.parts.membership.control.catching = True
        for p in self.parts.objects.module.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_hook(lambda g, p=p: self._weigh(p, g)))
                self._hooks.append(p.register_post_accumulate_grad_hook(self._stow))
        atexit.register(self.close)
        return self

    def _weigh(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """``param``'s gradient from the script's backward, weighted, and at the step's last
        micro-batch joined by the step's earlier ones (module doc); outside a micro-batch (a
        backward of the script's own between steps) left as it is."""
        weight = self._weight
        if weight is None:
            return None
        if not self._weighed:  # this micro-batch's backward, counted once (``Update``)
            self._weighed = True
            update = self.parts.update
            update.backwards = (update.backwards or 0) + 1
        out = grad if weight == 1.0 else grad * weight
        if self._last and param in self._stash:
            out = self._stash.pop(param) + out
        return None if out is grad else out

    def _stow(self, param: torch.Tensor) -> None:
        """After an earlier micro-batch's accumulation: ``param``'s gradient goes aside."""
        if self._weight is None or self._last or param.grad is None:
            return
        grad, param.grad = param.grad, None
        kept = self._stash.get(param)
        self._stash[param] = grad if kept is None else kept.add_(grad)

    # -- the loader's side -------------------------------------------------------------
    def epoch_of(self, index: int) -> int:
        """The job's epoch step ``index`` is in (0 for a stream)."""
        return self.parts.loader.sampler.position(index).epoch

    def next_batch(self, epoch: int | None) -> tuple[Any, int]:
        """The next batch for a loader iterator of the job's epoch ``epoch`` (None: its
        first batch), and the epoch of its step; ``StopIteration`` at the epoch's end or
        once the job's loop has ended (module doc)."""
        if self.done:
            raise StopIteration
        step = self.step
        if step is not None and self._batches is not None:
            if not self.ended:
                if not step.in_last:
                    return self._hand(step), self.epoch_of(step.index)
                raise StepNotEnded(
                    f"step {step.index}: the loop asked for the next batch without calling "
                    "optimizer.step() after the step's last batch: under tidal.prepare every "
                    "global batch ends with optimizer.step() (the step's update; to "
                    "accumulate gradients pass micro_batch_size= to tidal.prepare)"
                )
            after = self.parts.update.step  # the step the boundary leads to, but for a heal
            if epoch is not None and after < self.max_steps and self.epoch_of(after) != epoch:
                raise StopIteration  # the job's epoch ends: the boundary waits for the next
            self._advance()
        elif step is None:
            self._advance()
        step = self.step
        at = self.epoch_of(step.index)
        if epoch is not None and at != epoch:
            raise StopIteration  # healed into another epoch: the step waits for the next
        return self._hand(step), at

    def _hand(self, step: Step) -> Any:
        """The step's next micro-batch, its weight set for the script's backward."""
        if self._batches is None:
            self._batches = iter(step.micro_batches())
        batch = next(self._batches)
        self._weight, self._last, self._weighed = step.weight, step.in_last, False
        return batch

    def _advance(self) -> None:
        """Resume the generator past the step in flight (its boundary) to the next step;
        at the loop's end, ``StopIteration`` (or the exit of a worker no longer needed)."""
        if self._batches is not None:
            for _ in self._batches:  # nothing is left: the step's share is closed
                pass
        self._batches, self._weight = None, None
        self._stash.clear()  # a step that failed before its last micro-batch's backward
        if self._run is None:
            self._run = self.trainer.run(self.max_steps)
        try:
            step = next(self._run)
        except StopIteration:
            self._loop_ended()
            raise
        step.driven = True
        self.step, self.ended = step, False

    def _loop_ended(self) -> None:
        """The job's loop ended here: completed or stopped, the script goes on after its
        loop; told to leave, the worker exits (module doc)."""
        self.done, self.step = True, None
        parts = self.parts
        if self.trainer.completed or parts.membership.stopping or parts.stop.asked:
            return
        log.info(
            "tidal: worker %s left the job at step %d (not needed): exiting",
            parts.link.worker_id,
            parts.update.step,
        )
        raise SystemExit(0)

    # -- the optimizer's and scheduler's side ------------------------------------------
    def end_step(self) -> None:
        """``optimizer.step()``: end the step in flight at its last micro-batch (module
        doc); after an earlier one, nothing."""
        step = self.step
        if step is None or self._batches is None:
            raise RuntimeError(
                "optimizer.step() before the loop took a batch of the step from the prepared "
                "loader: under tidal.prepare the optimizer steps once per global batch, in the "
                "loop over the loader"
            )
        if self.ended:
            raise RuntimeError(
                f"optimizer.step() twice in step {step.index}: a global batch is one update"
            )
        if not step.in_last:
            return  # accumulating: the step ends at its last micro-batch
        self.ended, self._weight = True, None
        self._unstash(step)
        step.end_sync()
        self.parts.loop.finish(step)

    def _unstash(self, step: Step) -> None:
        """Gradients still aside at the step's end: of parameters left out of its last
        micro-batch. Alone they join ``.grad``; under DDP they would miss the all-reduce."""
        stash, self._stash = self._stash, {}
        if stash and self.parts.membership.ddp is not None:
            raise RuntimeError(
                f"step {step.index}: {len(stash)} parameter(s) had gradients in an earlier "
                "micro-batch but none in the step's last, so the step's all-reduce would miss "
                "them: under tidal.prepare every parameter takes part in every micro-batch"
            )
        for param, grad in stash.items():
            param.grad = grad if param.grad is None else param.grad.add_(grad)

    def scheduler_may_step(self) -> bool:
        """Whether the script's ``scheduler.step()`` moves the scheduler now (module doc)."""
        step = self.step
        if step is None:
            return True
        return self.ended and step.outcome == COMMITTED

    def zero_grad_may_act(self) -> bool:
        """Whether the script's ``optimizer.zero_grad()`` clears now: not inside a step,
        whose gradients accumulate until its end (module doc)."""
        return self.step is None or self._batches is None or self.ended

    # -- the end -----------------------------------------------------------------------
    def close(self) -> None:
        """At exit: end the job's loop if the script stopped asking for batches (module
        doc). After the job's last step it ends as if asked once more; earlier, the
        generator is closed in its step's body, as a ``break`` out of ``trainer.run``."""
        run = self._run
        if run is None or self.done:
            return
        self.done = True
        if self.ended and self.parts.update.step >= self.max_steps:
            for _ in run:  # the boundary after the last step ends the loop: nothing comes
                break
        run.close()
