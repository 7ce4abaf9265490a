"""Joining, forming and leaving generations: the worker's half of the membership protocol.

A mixin of ``Trainer`` (which holds the state it heals and the loop that calls these at step
boundaries). Contracts:

- A member joins the newest generation that names it; it never forms a group with a member
  that did not arrive (``group.rendezvous``), and gives up forming as soon as the coordinator
  opens a newer generation (``group.Superseded``). A rendezvous that times out is reported
  (naming how many arrived): the coordinator sees every member heartbeat and would
  otherwise wait for it forever.
- Every failure to form, heal or communicate is reported with the generation it happened
  in, so the coordinator can tell a fresh fact from one a newer generation already answers.
- A value read from the store that the job's key does not authenticate (a peer's address,
  step, the rendezvous state, the settings: ``store_auth.ForgedValue``) is never acted on:
  the member leaves the generation and reports it as ``FailureKind.FORGED_STORE``, naming
  the key; the coordinator records a security event and re-forms.
- Healing never trains from scratch: a generation that holds nobody with the job's state
  raises ``StateLost``, and only a coordinator-chosen checkpoint (``resume_from``) restores
  it. A member whose heal was cut while it received (``HealInterrupted``) holds a mix of
  two steps and forgets its state: it is never a source of that mix.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist

from tidal import devices
from tidal.checkpoint import store as checkpoints
from tidal.protocol import FailureKind, GenerationInfo, HeartbeatResponse, RecoveryPath, Role
from tidal.store_auth import ForgedValue
from tidal.worker import ddp, identity, probes
from tidal.worker import group as grp
from tidal.worker.heal import (
    NO_STATE,
    HealInterrupted,
    HealResult,
    ModelMismatch,
    StateLost,
    heal,
)
from tidal.worker.leaving import leave_uncommitted
from tidal.worker.reasons import failure_reason
from tidal.worker.shard_plan import Path as ShardPath

#: The status's name for each way a sharded generation assembled its state.
RECOVERY_OF = {
    ShardPath.FRESH: None,
    ShardPath.LIVE: RecoveryPath.RESHARD,
    ShardPath.COPY: RecoveryPath.NEIGHBOUR_COPY,
}

#: How often a worker waiting outside the group asks for its answer when no change is
#: published (``Notices.wait``): what a retire, which moves no counter, waits at most.
STANDBY_FETCH_S = 0.25


class Membership:
    def _report_failure(
        self, generation: int, exc: Exception, kind: FailureKind = FailureKind.COLLECTIVE
    ) -> None:
        """Tell the coordinator this member left ``generation`` (the one it was training or
        forming in: a report naming an older one would be ignored as already answered)."""
        what = {FailureKind.COLLECTIVE: "collective", FailureKind.FORGED_STORE: "store read"}.get(
            kind, "healing"
        )
        print(
            f"tidal: worker {self.worker_id}: {what} failed in generation "
            f"{generation} at step {self.step}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        self.optimizer.zero_grad(set_to_none=True)
        # Sent without waiting for the answer (``Agent.report_failure``); a report that
        # never arrives costs the grace the coordinator gives a failure it sees itself.
        self._agent.report_failure(generation, self.step, failure_reason(exc), kind=kind)

    def _between_steps(self, collective: Callable[[], object]) -> bool:
        """Run ``collective`` of the current group between steps, where its failure is a
        membership change like any other; False if it failed (the member has left the
        group and reported it). On gloo these collectives (DDP's bucket rebuild, sharded
        checkpoints and copies) are not watched: they do not wait through ``waits``, and a
        cut would fail a long sharded save that a planned shrink overlaps."""
        try:
            if self._backend == "nccl":  # bounded like the step's all-reduce
                self._watch.open()
                collective()
                torch.cuda.synchronize(self.device)
                if (aborted := self._watch.close()) is not None:
                    raise RuntimeError(f"collective aborted: {aborted}")
            else:
                collective()
            return True
        except Exception as exc:  # noqa: BLE001 - a failed collective surfaces as any error
            self._leave_group(failed=True)
            self._report_failure(self.generation, exc)
            return False

    def _settle_buckets(self) -> bool:
        """Make DDP's one-time bucket rebuild (a broadcast) now, between steps
        (``_between_steps``)."""
        self._buckets_pending = False
        return self._between_steps(self._ddp.reducer._rebuild_buckets)

    def _leave_group(self, *, failed: bool = False) -> None:
        """Leave the current group (``group.destroy_group``): ``failed`` after a failure;
        parked if the watch cut a wait on it (a collective may still be blocked in gloo)."""
        self._ddp = None
        self._control.release()
        if self._fsdp is not None:
            self._fsdp.leave()
        if self._watch is not None:
            self._watch.close()
        grp.destroy_group(self._backend, failed=failed, park=self._waits.aborted)
        self._waits.reset()

    def _newest_answer(self) -> HeartbeatResponse | None:
        """The newest heartbeat's answer; on rank 0, fetched at once when the coordinator
        published a change since (``worker.notice``)."""
        if self._agent is None:
            return None
        if self.rank == 0 and self._notices.changed():
            return self._agent.fetch()
        return self._agent.latest()

    def _hold_soon(self, step: int, max_steps: int) -> Future[HeartbeatResponse] | None:
        """Send the holding heartbeat of scheduled step ``step`` now, as the step whose
        commit reaches it is committed (its gradients are reduced, its update not applied
        yet): the round trip, and the coordinator's pass that settles the step, overlap the
        update instead of following it. None when ``step`` is not one (or the job ends
        there, or a switch or stop already decides what follows it).

        At the step before a scheduled one (``step + 1`` is), an approaching heartbeat
        instead, answered by nobody's wait: the coordinator applies the change now
        (``rules.schedule_ahead``), and its answer tells this member, while it runs its
        last step before the change, whether it stays (``_leaves_uncommitted``)."""
        if self._agent is None or step >= max_steps or self._control.switch or self._control.stop:
            return None
        if step + 1 in self._cfg.hold_steps and step + 1 < max_steps:
            self._agent.beat_soon(step=step, approaching=True)
        if step not in self._cfg.hold_steps:
            return None
        self._notices.mark()  # before the answer, which ``_join`` may take as fetched
        return self._agent.beat_soon(step=step)

    def _leaves_uncommitted(self, step: int, max_steps: int) -> str | None:
        """Why this member leaves now with its step (the one whose commit reaches ``step``)
        uncommitted, or None (``leaving.leave_uncommitted``); from the newest answer it
        holds, without asking."""
        latest = self._agent.latest() if self._agent is not None else None
        excluded = latest is not None and (
            latest.role == Role.EXIT
            or (
                latest.role == Role.STANDBY
                and latest.generation is not None
                and latest.generation.id > self.generation
            )
        )
        if not excluded:  # every step but a leaver's last: nothing more to look at
            return None
        return leave_uncommitted(
            excluded=excluded,
            at_change=self._control.switch or step in self._cfg.hold_steps,
            sharded=self._fsdp is not None,
            hooks=bool(self._update.hooks),
            checkpoint_due=self.rank == 0 and self._durable.due(step),
            stop=self._control.stop,
            last=step >= max_steps,
        )

    def _hold(self, step: int, sent: Future[HeartbeatResponse] | None = None) -> bool:
        """Wait at a scheduled step until the coordinator has settled its membership;
        True if this member must switch generation (every member holds at the same step,
        so all see the same answer without a control word). ``sent``: the holding
        heartbeat ``_hold_soon`` sent for this step, answered first."""
        assert self._agent is not None
        self._debug(f"hold at {step}")
        self._send_report()  # the coordinator settles the step once its generation formed
        while True:  # the coordinator keeps each answer back until it settles the step
            if sent is not None:
                resp, sent = sent.result(), None
            else:
                self._notices.mark()  # before the answer, which ``_join`` may take as fetched
                resp = self._agent.beat_now(holding=True)
            if resp.stop or resp.settled_step >= step or resp.role != Role.MEMBER:
                break
            self._agent.wait_change(0.005)
        self._hold_answer = (step, resp)  # what it was told (sharding gathers on a shrink)
        newer = resp.generation is not None and resp.generation.id > self.generation
        self._debug(f"hold released (newer={newer})")
        return resp.stop or resp.role != Role.MEMBER or newer

    def _join(self, answer: HeartbeatResponse | None = None) -> bool:
        """Wait for, and form, the newest generation that has this worker as a member.

        ``answer``: the coordinator's answer this member was just given, asked after a
        ``Notices.mark`` (a hold's: ``_hold`` marks before each beat), taken for the first
        attempt instead of fetching again, a round trip (~2.5 ms on two busy cores) off
        every scheduled change's pause; an answer already outdated only costs that attempt
        (its rendezvous finds the generation abandoned, and the next attempt fetches).
        Returns False when the coordinator wants this worker to exit or the job to stop.
        """
        assert self._agent is not None and self._store is not None
        self._send_report()  # the next generation opens once this one formed
        tried = self.generation  # the newest generation tried
        self._t_join = time.time()
        while True:
            before = tried  # what was tried before this attempt
            self._notices.follow(self._agent.config)
            if answer is not None:
                resp, answer = answer, None
            else:
                self._notices.mark()  # before the answer: a change after it is news
                resp = self._agent.fetch()
            if resp.stop:
                self._stopping = True
                return False
            if resp.role != Role.MEMBER:
                self._last_rank = None  # removed: no longer speaks for the job's state
            if resp.role == Role.EXIT:
                return False
            if self._store_epoch != self._agent.registered_epoch():  # a new coordinator
                self._connect_store()
            info = resp.generation
            try:
                if resp.role != Role.MEMBER or info is None or info.id <= tried:
                    # Until the coordinator publishes a change (``Notices.wait``); a retire
                    # moves no counter: it is heard at the next answer, STANDBY_FETCH_S on.
                    if not self._notices.wait(STANDBY_FETCH_S):
                        newest = max(tried, info.id if info else 0)
                        grp.wait_for_generation(
                            self._store, self._cfg.store_namespace, newest + 1, timeout_s=0.05
                        )
                    continue
                tried = info.id
                self._debug(f"join gen {info.id}")
                # Fatal, not a failure to heal from: every member would refuse the same way.
                self.sampler.check_world_size(len(info.members))
                if self._fsdp is not None:
                    self._fsdp.sharded.check_world(len(info.members))
                if not self._agreed:  # once, before this process first trains with others
                    try:
                        identity.agree(
                            self._store, f"{self._cfg.store_namespace}/settings", self._identity
                        )
                    except identity.ScriptMismatch as exc:  # the coordinator fails the job
                        self._report_failure(info.id, exc, kind=FailureKind.SCRIPT_MISMATCH)
                        continue
                    self._agreed = True
                probes.point("join", self.step, info.id)
                outcome = grp.rendezvous(
                    self._store, info, timeout_s=self._cfg.collective_timeout_s
                )
                if outcome == grp.Arrival.TIMED_OUT:
                    self._report_failure(info.id, grp.RendezvousTimeout(info, self._store))
                if outcome != grp.Arrival.FORMED:
                    continue
            except ForgedValue as exc:  # refused, never acted on: the coordinator re-forms
                self._report_failure(info.id, exc, kind=FailureKind.FORGED_STORE)
                continue
            except dist.DistError as exc:
                # The store went away with its coordinator: wait for the next one (the
                # heartbeat registers with it), then join what it decides. That may be a
                # generation of the same id (the new coordinator's, answered before this
                # worker knew its store; or one the dead one announced and never recorded):
                # not tried yet, or its other members would wait the rendezvous timeout.
                self._debug(f"store lost while joining: {exc}")
                tried = before
                self._agent.beat_now()
                self._connect_store()
                continue
            self._t_rendezvous = time.time()
            self._debug(f"rendezvous gen {info.id} done")
            probes.point("rendezvous", self.step, info.id)
            try:
                self._form(info)
                self._failed_forms = 0
                return True
            except grp.Superseded:  # the coordinator already opened the next one
                self._debug(f"gen {info.id} superseded while forming")
                self._leave_group(failed=True)
            except StateLost as exc:
                self._leave_group()
                self._report_failure(info.id, exc, kind=FailureKind.STATE_LOST)
            except ModelMismatch as exc:  # the job cannot go on: the coordinator fails it
                self._leave_group(failed=True)
                self._report_failure(info.id, exc, kind=FailureKind.SCRIPT_MISMATCH)
            except ForgedValue as exc:  # a peer's address or step, refused (``store_auth``)
                self._failed_forms += 1
                self._leave_group(failed=True)
                self._report_failure(info.id, exc, kind=FailureKind.FORGED_STORE)
            except Exception as exc:  # noqa: BLE001 - a peer failed while we formed
                if isinstance(exc, HealInterrupted):  # a mix of two steps: never a source
                    self._has_state = False
                self._failed_forms += 1
                self._leave_group(failed=True)
                self._report_failure(info.id, exc)

    def _form(self, info: GenerationInfo) -> None:
        rank = info.members.index(self._env.worker_id)
        self._durable.quiesce()  # the heal may overwrite what a snapshot is copying
        rolled_back = None
        if info.resume_from is not None and self.step != info.resume_step:
            before = self.step
            if self._fsdp is not None:
                from tidal.worker.sharded_ckpt import load_for_roll_back

                self.step = load_for_roll_back(
                    self._fsdp.sharded, Path(info.resume_from), gen=info.id, tracked=self._tracked
                )
                self._has_state = True
            else:
                self._roll_back(info)
            rolled_back = max(0, before - self.step)
        timeout_s = self._cfg.collective_timeout_s
        if self._fsdp is None:  # the heal reads every member's from the store
            grp.publish_step(self._store, info, rank, self.step if self._has_state else None)
        grp.form_group(
            self._store,
            info,
            rank,
            namespace=self._cfg.store_namespace,
            timeout_s=timeout_s,
            connect_s=grp.connect_timeout(self._failed_forms, timeout_s),
            on_published=lambda: probes.point("connect", self.step, info.id),
            backend=self._backend,
            other_ports=self._other_ports(),
        )
        self._members = list(info.members)
        self._t_formed = time.time()
        self._debug("group formed")
        probes.point("heal", self.step, info.id)
        if self._fsdp is not None:
            sharded = self._fsdp.form(
                members=info.members,
                gen=info.id,
                step=self.step if self._has_state else None,
                committed_step=info.committed_step,
                tracked=self._tracked,
                side_group=lambda: grp.side_group(
                    self._store,
                    info,
                    rank,
                    namespace=self._cfg.store_namespace,
                    timeout_s=timeout_s,
                    connect_s=grp.connect_timeout(self._failed_forms, timeout_s),
                ),
            )
            self.step, self._has_state = sharded.step, True
            self._recovery = (RECOVERY_OF[sharded.path], sharded.redone)
            if rolled_back is not None:
                self._recovery = (RecoveryPath.CHECKPOINT, rolled_back)
            self._fsdp.refresh_copies(self.step, self._tracked)
            result = HealResult(source=sharded.source, step=sharded.step, sent=True)
        else:
            if self._watch is not None:
                self._watch.open()
            steps = grp.member_steps(self._store, info, none=NO_STATE)
            result = heal(
                steps=steps,
                module=self.module,
                optimizer=self.optimizer,
                step=self.step if self._has_state else None,
                committed_step=info.committed_step,
                tracked=self._tracked,
                wire=devices.wire_device(self._backend, self.device),
                waits=self._waits if self._backend == "gloo" else None,
                landing=self._landing,
            )
            self._landing = []  # used, or never needed: this member holds state from now
            # Whole from here: a receiver holds the source's state, even if the watch cut
            # something after the transfer ended.
            self.step, self._has_state = result.step, True
            if self._watch is not None and (aborted := self._watch.close()) is not None:
                raise RuntimeError(f"heal aborted: {aborted}")
            self._recovery = (RecoveryPath.HEAL if result.sent else RecoveryPath.NONE, 0)
            if rolled_back is not None:
                self._recovery = (RecoveryPath.CHECKPOINT, rolled_back)
            self._ddp = ddp.wrap(self.module, self._control, self._ddp_kwargs)
        self._t_healed = time.time()
        self.rank, self.world_size, self.generation = rank, len(info.members), info.id
        self._last_rank = rank
        self._agent.generation = info.id
        self._agent.step = self.step
        self._gen_prev_time = self._last_step_time
        self._gen_prev_gen = self._last_step_gen
        self._gen_first_pending = True
        self._next_word = self.step  # a generation's first step carries a control word
        self._rate_mark = (time.monotonic(), self.step)
        self._split = [0.0, 0.0]
        self._debug(
            f"formed gen {info.id} rank {rank}/{self.world_size} step {self.step} "
            f"heal src={result.source} sent={result.sent}"
        )

    def _roll_back(self, info: GenerationInfo) -> None:
        """Load the checkpoint the coordinator chose because no live worker held the job's
        state; every member of ``info`` does the same, so all continue from its step."""
        meta = checkpoints.load(
            Path(info.resume_from), self.module, self.optimizer, tracked=self._tracked
        )
        checkpoints.restore_rng(meta)
        self.step, self._has_state = int(meta["step"]), True
        self._debug(f"rolled back to checkpoint step {self.step}")
