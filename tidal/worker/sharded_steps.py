"""The elastic loop's step-boundary duties under ``sharding="fsdp"`` (a mixin of ``Trainer``).

Each is a no-op with ``sharding="ddp"``. Contracts:

- The step's control all-reduce (``_end_sharded_step``) runs after the last micro-batch's
  backward and decides, like DDP's control word, that every member switches or stops after
  the same step.
- Neighbour copies (``_copies_taken``) are taken by every member at the same committed
  steps (``Ring.due``): a snapshot here, the exchange on the ring's thread (a failure of
  it leaves the old copy whole; the generation's failure is seen by its collectives).
- Before a planned switch that drops a member, every member gathers the whole state
  (``_gather_for_leavers``): a leaver then takes no row with it and nothing is redone.
- At the job's last step the members gather the whole model onto rank 0
  (``_gather_final``), for ``full_state_dict``.
"""

from __future__ import annotations

import time

from tidal.protocol import Role, WorkerConfig
from tidal.worker import probes


class ShardedSteps:
    def _start_sharded(self, cfg: WorkerConfig) -> None:
        from tidal.worker.fsdp import Fsdp, warm_up
        from tidal.worker.ring import Ring

        warm_up()
        self._fsdp = Fsdp(self.module, self.optimizer, Ring())

    def _sharded_checkpoint_taken(self, *, final: bool = False) -> bool:
        """Every member's part of a checkpoint of the committed step, when one is due (the
        control all-reduce carried rank 0's decision, so all agree) or at the job's last
        step (``final``); False if a collective failed (the member has left the group and
        reported it)."""
        from pathlib import Path

        from tidal.worker.sharded_ckpt import save_sharded

        if self._fsdp is None:
            return True
        cfg = self._cfg
        due = self._ckpt_agreed or final
        self._ckpt_agreed = False
        if cfg.checkpoint_dir is None or not due or self._last_sharded_ckpt == self.step:
            return True

        def save() -> None:
            save_sharded(
                self._fsdp.sharded,
                directory=Path(cfg.checkpoint_dir),
                step=self.step,
                position=self._position(),
                tracked=self._tracked,
                keep=cfg.keep_checkpoints,
                agent=self._agent,
                fence=cfg.checkpoint_fence,
            )
            self._last_sharded_ckpt = self.step
            self._durable.mark_saved()

        return self._between_steps(save)

    def _end_sharded_step(self) -> None:
        c = self._control
        c.before_allreduce()
        c.comm_started = time.perf_counter()
        fsdp = self._fsdp
        fsdp.end_step(
            switch=c.flags[0],
            stop=c.flags[1],
            shrink=self._shrink,
            checkpoint=self.rank == 0 and self._durable.due(self.step + 1),
            clip=self._update.clip_grad_norm is not None,
        )
        switch, stop, shrink, checkpoint = fsdp.flags()
        c.sums = (float(switch), float(stop), 0.0)
        self._shrink, self._ckpt_agreed = shrink, checkpoint
        c.comm_done = time.perf_counter()

    def _copies_taken(self) -> bool:
        """Refresh the neighbour copies if this committed step is a copy step; False if the
        exchange failed (this member has left the group and reported it)."""
        fsdp = self._fsdp
        if fsdp is None or fsdp.module is None or not fsdp.ring.due(self.step):
            return True

        def copy() -> None:
            probes.point("copy", self.step, self.generation)
            fsdp.refresh_copies(self.step, self._tracked)

        if not self._between_steps(copy):
            return False
        ring = fsdp.ring
        if self.rank == 0 and ring.group is not None:  # a lone member takes no copy
            # What a copy costs: this one's snapshot here, and the last completed exchange
            # beside the training (this one's is still running).
            self._agent.post_metrics(
                {
                    "copy_snapshot_s": ring.snapshot_s,
                    "copy_exchange_s": ring.exchange_s,
                    "copy_failures": float(ring.failures),
                }
            )
        return True

    def _gather_for_leavers(self) -> None:
        """At a planned switch: if any member knows the next generation drops a member,
        every member gathers the whole state (a collective of the old group). If it fails,
        what each member held is unchanged and the next heal finds its way (or redoes the
        steps since the neighbour copy)."""
        fsdp = self._fsdp
        if fsdp is None or fsdp.module is None:
            return
        held_at, answer = getattr(self, "_hold_answer", (None, None))
        if held_at == self.step:  # a scheduled switch: the answer that released the hold
            member = answer.role == Role.MEMBER and answer.generation is not None
            shrink = fsdp.shrinks(answer.generation.members if member else None)
        else:  # the control word's switch: every member saw the same ``shrink`` sum
            shrink = self._shrink
        if not shrink:
            return
        try:
            fsdp.before_switch(self.generation)
        except Exception as exc:  # noqa: BLE001
            self._debug(f"gather before the switch failed: {exc}")

    def _gather_final(self) -> None:
        try:
            self._final_state = self._fsdp.full_state_dict()
        except Exception as exc:  # noqa: BLE001 - full_state_dict() then says so
            self._debug(f"final gather failed: {exc}")
