"""The FSDP generation and its step-boundary duties under ``sharding="fsdp"``, as one part
of a ``Trainer``.

Each duty is a no-op with ``sharding="ddp"`` (``fsdp`` is None). Contracts:

- The step's control all-reduce (``end_step``) runs after the last micro-batch's backward
  and decides, like DDP's control word, that every member switches or stops after the same
  step.
- Neighbour copies (``copies_taken``) are taken by every member at the same committed
  steps (``Ring.due``): a snapshot here, the exchange on the ring's thread (a failure of
  it leaves the old copy whole; the generation's failure is seen by its collectives).
- Before a planned switch that drops a member, every member gathers the whole state
  (``gather_for_leavers``): a leaver then takes no row with it and nothing is redone.
- At the job's last step the members gather the whole model onto rank 0
  (``gather_final``), for ``full_state_dict``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from tidal.checkpoint import location
from tidal.checkpoint.location import Location
from tidal.protocol import GenerationInfo, HeartbeatResponse, RecoveryPath, Role
from tidal.worker import probes
from tidal.worker.membership import group as grp
from tidal.worker.sharded.plan import Path as ShardPath
from tidal.worker.state.heal import HealResult

if TYPE_CHECKING:
    from tidal.worker.trainer.parts import Parts

#: The status's name for each way a sharded generation assembled its state.
RECOVERY_OF = {
    ShardPath.FRESH: None,
    ShardPath.LIVE: RecoveryPath.RESHARD,
    ShardPath.COPY: RecoveryPath.NEIGHBOUR_COPY,
}


class ShardedSteps:
    """The sharded side of one Trainer (module doc)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.fsdp: Any = None  # tidal.worker.sharded.fsdp.Fsdp under tidal run with sharding="fsdp"
        self.shrink = False  # this member knows the next generation drops a member
        self.checkpoint_agreed = False  # the members agreed to checkpoint this step
        self.last_checkpoint: int | None = None  # the step of the last sharded checkpoint
        #: The whole model gathered onto rank 0 at the job's last step.
        self.final_state: dict[str, torch.Tensor] | None = None

    @property
    def live(self) -> Any:
        """The FSDP side while this member is in a sharded group, else None."""
        fsdp = self.fsdp
        return fsdp if fsdp is not None and fsdp.module is not None else None

    @property
    def grad_norm(self) -> float | None:
        """The step's whole gradient norm from its control all-reduce (None with DDP)."""
        return self.fsdp.grad_norm if self.fsdp is not None else None

    def start(self) -> None:
        """The module becomes FSDP's meta-device template (after any resume)."""
        from tidal.worker.sharded.fsdp import Fsdp, warm_up
        from tidal.worker.sharded.ring import Ring

        warm_up()
        objects = self.parts.objects
        self.fsdp = Fsdp(objects.module, objects.optimizer, Ring())

    def check_world(self, world_size: int) -> None:
        """Refuse a world size the model's shards cannot take (fatal: every member alike)."""
        if self.fsdp is not None:
            self.fsdp.sharded.check_world(world_size)

    def leave(self) -> None:
        if self.fsdp is not None:
            self.fsdp.leave()

    def load_for_roll_back(self, directory: Location, *, gen: int) -> int:
        """Load the sharded checkpoint the coordinator chose; its step."""
        from tidal.worker.sharded.checkpoint import load_for_roll_back

        return load_for_roll_back(
            self.fsdp.sharded, directory, gen=gen, tracked=self.parts.objects.tracked
        )

    def form(
        self, info: GenerationInfo, rank: int, *, step: int | None
    ) -> tuple[HealResult, tuple[str | None, int]]:
        """Assemble generation ``info``'s shards (``Fsdp.form``) from this member's state at
        committed step ``step`` (None: it holds none); how it healed, and the recovery path
        the status names."""
        link, update, tracked = self.parts.link, self.parts.update, self.parts.objects.tracked
        timeout_s = link.cfg.collective_timeout_s
        failed_forms = self.parts.membership.failed_forms
        sharded = self.fsdp.form(
            members=info.members,
            gen=info.id,
            step=step,
            committed_step=info.committed_step,
            tracked=tracked,
            side_group=lambda: grp.side_group(
                link.store,
                info,
                rank,
                namespace=link.cfg.store_namespace,
                timeout_s=timeout_s,
                connect_s=grp.connect_timeout(failed_forms, timeout_s),
            ),
        )
        update.restore(sharded.step)
        self.fsdp.refresh_copies(update.step, tracked)
        result = HealResult(source=sharded.source, step=sharded.step, sent=True)
        return result, (RECOVERY_OF[sharded.path], sharded.redone)

    def word(self, newer: bool, latest: HeartbeatResponse | None) -> None:
        """The step's control flags are set: whether the next generation drops a member."""
        if self.fsdp is not None:
            members = latest.generation.members if newer and latest.role == Role.MEMBER else None
            self.shrink = newer and self.fsdp.shrinks(members)

    def checkpoint_taken(self, *, final: bool = False) -> bool:
        """Every member's part of a checkpoint of the committed step, when one is due (the
        control all-reduce carried rank 0's decision, so all agree) or at the job's last
        step (``final``); False if a collective failed (the member has left the group and
        reported it)."""
        from tidal.worker.sharded.checkpoint import save_sharded

        if self.fsdp is None:
            return True
        link, step = self.parts.link, self.parts.update.step
        cfg = link.cfg
        due = self.checkpoint_agreed or final
        self.checkpoint_agreed = False
        if cfg.checkpoint_dir is None or not due or self.last_checkpoint == step:
            return True

        def save() -> None:
            published = save_sharded(
                self.fsdp.sharded,
                directory=location.of(cfg.checkpoint_dir),
                step=step,
                position=self.parts.loader.position(step),
                tracked=self.parts.objects.tracked,
                keep=cfg.keep_checkpoints,
                agent=link.agent,
                fence=cfg.checkpoint_fence,
            )
            self.last_checkpoint = step
            link.durable.mark_saved(published=published)

        return self.parts.membership.between_steps(save)

    def end_step(self) -> None:
        """The last micro-batch's backward ran: the step's control all-reduce."""
        membership, step = self.parts.membership, self.parts.update.step
        c = membership.control
        c.comm_started = time.perf_counter()
        fsdp = self.fsdp
        fsdp.end_step(
            switch=c.flags[0],
            stop=c.flags[1],
            shrink=self.shrink,
            checkpoint=membership.rank == 0 and self.parts.link.durable.due(step + 1),
            clip=self.parts.update.clip_grad_norm is not None,
            before=c.before_allreduce,
        )
        switch, stop, shrink, checkpoint = fsdp.flags()
        c.sums = (float(switch), float(stop), 0.0)
        self.shrink, self.checkpoint_agreed = shrink, checkpoint
        c.comm_done = time.perf_counter()

    def copies_taken(self) -> bool:
        """Refresh the neighbour copies if this committed step is a copy step; False if the
        exchange failed (this member has left the group and reported it)."""
        fsdp, step = self.live, self.parts.update.step
        if fsdp is None or not fsdp.ring.due(step):
            return True
        membership = self.parts.membership

        def copy() -> None:
            probes.point("copy", step, membership.generation)
            fsdp.refresh_copies(step, self.parts.objects.tracked)

        if not membership.between_steps(copy):
            return False
        ring = fsdp.ring
        if membership.rank == 0 and ring.group is not None:  # a lone member takes no copy
            # What a copy costs: this one's snapshot here, and the last completed exchange
            # beside the training (this one's is still running).
            self.parts.link.post_metrics(
                {
                    "copy_snapshot_s": ring.snapshot_s,
                    "copy_exchange_s": ring.exchange_s,
                    "copy_failures": float(ring.failures),
                }
            )
        return True

    def gather_for_leavers(self) -> None:
        """At a planned switch: if any member knows the next generation drops a member,
        every member gathers the whole state (a collective of the old group). If it fails,
        what each member held is unchanged and the next heal finds its way (or redoes the
        steps since the neighbour copy)."""
        fsdp = self.live
        if fsdp is None:
            return
        membership = self.parts.membership
        held_at, answer = membership.hold_answer
        if held_at == self.parts.update.step:  # a scheduled switch: the releasing answer
            member = answer.role == Role.MEMBER and answer.generation is not None
            shrink = fsdp.shrinks(answer.generation.members if member else None)
        else:  # the control word's switch: every member saw the same ``shrink`` sum
            shrink = self.shrink
        if not shrink:
            return
        try:
            fsdp.before_switch(membership.generation)
        except Exception as exc:  # noqa: BLE001
            self.parts.link.debug(f"gather before the switch failed: {exc}")

    def gather_final(self) -> None:
        try:
            self.final_state = self.fsdp.full_state_dict()
        except Exception as exc:  # noqa: BLE001 - full_state_dict() then says so
            self.parts.link.debug(f"final gather failed: {exc}")
