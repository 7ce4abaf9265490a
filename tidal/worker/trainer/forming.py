"""Forming a generation: the group, the heal, and what this member holds after them.

Called by ``Membership.join`` once the generation's rendezvous completed. Contracts:

- A generation the coordinator made to resume from a checkpoint (``resume_from``) is
  first loaded from it by every member not already at its step (``roll_back``), so all
  continue from that step.
- With ``sharding="ddp"`` every member publishes its committed step (None without state)
  and the most advanced member's state is sent to the others (``heal``); healing never
  trains from scratch. With ``sharding="fsdp"`` the shards are assembled by
  ``fsdp.Fsdp.form``.
- The heal is bounded by the abort watch; a heal cut after its transfer ended leaves the
  receiver whole.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tidal import devices
from tidal.checkpoint import location
from tidal.checkpoint import store as checkpoints
from tidal.protocol import GenerationInfo, RecoveryPath
from tidal.worker import probes
from tidal.worker.membership import ddp
from tidal.worker.membership import group as grp
from tidal.worker.state.heal import NO_STATE, heal

if TYPE_CHECKING:
    from tidal.worker.trainer.parts import Parts


def form(parts: Parts, info: GenerationInfo) -> None:
    """Form generation ``info`` with its members and heal (module doc)."""
    link, update, objects = parts.link, parts.update, parts.objects
    membership, sharded, clock = parts.membership, parts.sharded, parts.clock
    rank = info.members.index(link.worker_id)
    link.durable.quiesce()  # the heal may overwrite what a snapshot is copying
    rolled_back = None
    if info.resume_from is not None and update.step != info.resume_step:
        before = update.step
        if sharded.fsdp is not None:
            update.restore(sharded.load_for_roll_back(location.of(info.resume_from), gen=info.id))
        else:
            roll_back(parts, info)
        rolled_back = max(0, before - update.step)
    timeout_s = link.cfg.collective_timeout_s
    held = update.step if update.has_state else None
    if sharded.fsdp is None:  # the heal reads every member's from the store
        grp.publish_step(link.store, info, rank, held)
    grp.form_group(
        link.store,
        info,
        rank,
        namespace=link.cfg.store_namespace,
        timeout_s=timeout_s,
        connect_s=grp.connect_timeout(membership.failed_forms, timeout_s),
        on_published=lambda: probes.point("connect", update.step, info.id),
        backend=link.backend,
        other_ports=link.other_ports(),
    )
    membership.grouped(info.members)
    clock.formed = time.time()
    link.debug("group formed")
    probes.point("heal", update.step, info.id)
    if sharded.fsdp is not None:
        result, membership.recovery = sharded.form(info, rank, step=held)
        if rolled_back is not None:
            membership.recovery = (RecoveryPath.CHECKPOINT, rolled_back)
    else:
        if link.watch is not None:
            link.watch.open()
        steps = grp.member_steps(link.store, info, none=NO_STATE)
        result = heal(
            steps=steps,
            module=objects.module,
            optimizer=objects.optimizer,
            step=held,
            committed_step=info.committed_step,
            tracked=objects.tracked,
            wire=devices.wire_device(link.backend, objects.device),
            waits=link.waits if link.backend == "gloo" else None,
            landing=membership.landing,
        )
        membership.landing = []  # used, or never needed: this member holds state from now
        # Whole from here: a receiver holds the source's state, even if the watch cut
        # something after the transfer ended.
        update.restore(result.step)
        if link.watch is not None and (aborted := link.watch.close()) is not None:
            raise RuntimeError(f"heal aborted: {aborted}")
        membership.recovery = (RecoveryPath.HEAL if result.sent else RecoveryPath.NONE, 0)
        if rolled_back is not None:
            membership.recovery = (RecoveryPath.CHECKPOINT, rolled_back)
        membership.ddp = ddp.wrap(objects.module, membership.control, objects.ddp_kwargs)
    clock.formed_generation(update.step)
    membership.formed(rank, info.id)
    link.agent.generation = info.id
    link.agent.step = update.step
    parts.loop.generation_formed(update.step)
    link.debug(
        f"formed gen {info.id} rank {rank}/{membership.world_size} step {update.step} "
        f"heal src={result.source} sent={result.sent}"
    )


def roll_back(parts: Parts, info: GenerationInfo) -> None:
    """Load the checkpoint the coordinator chose because no live worker held the job's
    state; every member of ``info`` does the same, so all continue from its step."""
    objects = parts.objects
    meta = checkpoints.load(
        location.of(info.resume_from), objects.module, objects.optimizer, tracked=objects.tracked
    )
    checkpoints.restore_rng(meta)
    parts.update.restore(int(meta["step"]))
    parts.link.debug(f"rolled back to checkpoint step {parts.update.step}")
