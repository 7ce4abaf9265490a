"""The parts a ``Trainer`` is made of, named once so that they can reach each other.

Each part is a class in its own module that owns its attributes; a part reads or calls
another only through that one's public attributes and methods:

- ``objects`` (``objects.Objects``): the user's model, optimizer, data, scheduler, scaler
  and tracked state, on their device;
- ``loader`` (``loader.Loader``): the sampler and the input pipeline;
- ``update`` (``update.Update``): the committed step count and what a commit applies;
- ``clock`` (``clock.PauseClock``): the pause phases, step times and rates reported;
- ``link`` (``link.JobLink``): the coordinator, the store, checkpoints, the abort watch;
- ``membership`` (``membership.Membership``): joining, forming, holding and leaving
  generations; rank, world size, the generation and its DDP wrapper;
- ``sharded`` (``sharded_steps.ShardedSteps``): the FSDP generation and its step-boundary
  duties (none with ``sharding="ddp"``);
- ``stop`` (``stopping.ScriptStop``): ``trainer.stop()`` and ``break``;
- ``loop`` (``elastic.ElasticLoop``): the step boundary, and the loop under ``tidal run``;
- ``evaluator`` (``evaluation.Evaluator``): ``trainer.evaluate``;
- ``driven`` (``driven.Driven``): the steps driven from a loop the script owns
  (``tidal.prepare``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.worker.batches.loader import Loader
    from tidal.worker.trainer.clock import PauseClock
    from tidal.worker.trainer.driven import Driven
    from tidal.worker.trainer.elastic import ElasticLoop
    from tidal.worker.trainer.evaluation import Evaluator
    from tidal.worker.trainer.link import JobLink
    from tidal.worker.trainer.membership import Membership
    from tidal.worker.trainer.objects import Objects
    from tidal.worker.trainer.sharded_steps import ShardedSteps
    from tidal.worker.trainer.stopping import ScriptStop
    from tidal.worker.trainer.update import Update


class Parts:
    """One Trainer's parts (module doc). Filled once by the Trainer's constructor, in the
    order above; a part's constructor keeps this object and reads only the parts made
    before it."""

    objects: Objects
    loader: Loader
    update: Update
    clock: PauseClock
    link: JobLink
    membership: Membership
    sharded: ShardedSteps
    stop: ScriptStop
    loop: ElasticLoop
    evaluator: Evaluator
    driven: Driven
