"""Joining, forming and leaving generations: the worker's half of the membership protocol.

One part of a ``Trainer`` (``parts``): it owns the generation this member is in (rank, world
size, members, the DDP wrapper and its control word) and is called by the loop at step
boundaries; forming a generation is ``forming``'s. Contracts:

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

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tidal.protocol import FailureKind, HeartbeatResponse, Role
from tidal.store_auth import ForgedValue
from tidal.worker import probes
from tidal.worker.batches import identity
from tidal.worker.membership import ddp
from tidal.worker.membership import group as grp
from tidal.worker.membership.leaving import leave_uncommitted
from tidal.worker.membership.reasons import failure_reason
from tidal.worker.state.heal import HealInterrupted, ModelMismatch, StateLost
from tidal.worker.trainer.forming import form

if TYPE_CHECKING:
    from tidal.worker.trainer.parts import Parts


log = logging.getLogger(__name__)
#: How often a worker waiting outside the group asks for its answer when no change is
#: published (``Notices.wait``): what a retire, which moves no counter, waits at most.
STANDBY_FETCH_S = 0.25


class Membership:
    """The generation this member is in, and the ways in and out of one (module doc)."""

    def __init__(self, parts: Parts, *, identity_settings: dict[str, Any]) -> None:
        self.parts = parts
        self.rank = 0
        self.world_size = 1
        self.generation = 0
        self.members: list[int] = []  # the worker ids of the generation this one formed
        self.last_rank: int | None = None  # rank in the last generation this worker formed
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self.control = ddp.ControlWord(parts.objects.device)
        #: How the last forming healed: (``RecoveryPath`` or None, steps redone).
        self.recovery: tuple[str | None, int] = (None, 0)
        self.failed_forms = 0  # in a row: widens the connect window (group.connect_timeout)
        #: What every worker must agree on (``identity``), and whether this process did
        #: with the job's current store.
        self.identity = identity_settings
        self.agreed = False
        #: (step, answer) of the last hold: the answer that released it.
        self.hold_answer: tuple[int | None, HeartbeatResponse | None] = (None, None)
        self.landing: list[torch.Tensor] = []  # until the first forming (``landing``)
        self.stopping = False  # the coordinator stopped the job
        # DDP broadcasts its rebuilt bucket order inside the first forward after its first
        # backward: a peer lost right then would raise in the user's forward. The loop
        # makes that collective itself, at the step boundary (``settle_buckets``).
        self.buckets_pending = False

    def store_changed(self) -> None:
        """The job's store is a new one: it holds no settings yet, agree again."""
        self.agreed = False

    def report_failure(
        self, generation: int, exc: Exception, kind: FailureKind = FailureKind.COLLECTIVE
    ) -> None:
        """Tell the coordinator this member left ``generation`` (the one it was training or
        forming in: a report naming an older one would be ignored as already answered)."""
        what = {FailureKind.COLLECTIVE: "collective", FailureKind.FORGED_STORE: "store read"}.get(
            kind, "healing"
        )
        link, step = self.parts.link, self.parts.update.step
        log.warning(
            "worker %s: %s failed in generation %s at step %s: %s: %s",
            link.worker_id,
            what,
            generation,
            step,
            type(exc).__name__,
            exc,
        )
        self.parts.objects.optimizer.zero_grad(set_to_none=True)
        # Sent without waiting for the answer (``Agent.report_failure``); a report that
        # never arrives costs the grace the coordinator gives a failure it sees itself.
        link.agent.report_failure(generation, step, failure_reason(exc), kind=kind)

    def between_steps(self, collective: Callable[[], object]) -> bool:
        """Run ``collective`` of the current group between steps, where its failure is a
        membership change like any other; False if it failed (the member has left the
        group and reported it). On gloo these collectives (DDP's bucket rebuild, sharded
        checkpoints and copies) are not watched: they do not wait through ``waits``, and a
        cut would fail a long sharded save that a planned shrink overlaps."""
        link = self.parts.link
        try:
            if link.backend == "nccl":  # bounded like the step's all-reduce
                link.watch.open()
                collective()
                torch.cuda.synchronize(self.parts.objects.device)
                if (aborted := link.watch.close()) is not None:
                    raise RuntimeError(f"collective aborted: {aborted}")
            else:
                collective()
            return True
        except Exception as exc:  # noqa: BLE001 - a failed collective surfaces as any error
            self.leave_group(failed=True)
            self.report_failure(self.generation, exc)
            return False

    def settle_buckets(self) -> bool:
        """Make DDP's one-time bucket rebuild (a broadcast) now, between steps
        (``between_steps``)."""
        self.buckets_pending = False
        return self.between_steps(ddp.rebuild_buckets(self.ddp))

    def leave_group(self, *, failed: bool = False) -> None:
        """Leave the current group (``group.destroy_group``): ``failed`` after a failure;
        parked if the watch cut a wait on it (a collective may still be blocked in gloo)."""
        link = self.parts.link
        self.ddp = None
        self.control.release()
        self.parts.sharded.leave()
        if link.watch is not None:
            link.watch.close()
        grp.destroy_group(link.backend, failed=failed, park=link.waits.aborted)
        link.waits.reset()

    def hold_soon(self, step: int, max_steps: int) -> Future[HeartbeatResponse] | None:
        """Send the holding heartbeat of scheduled step ``step`` now, as the step whose
        commit reaches it is committed (its gradients are reduced, its update not applied
        yet): the round trip, and the coordinator's pass that settles the step, overlap the
        update instead of following it. None when ``step`` is not one (or the job ends
        there, or a switch or stop already decides what follows it).

        At the step before a scheduled one (``step + 1`` is), an approaching heartbeat
        instead, answered by nobody's wait: the coordinator applies the change now
        (``scale_rules.schedule_ahead``), and its answer tells this member, while it runs its
        last step before the change, whether it stays (``leaves_uncommitted``)."""
        link = self.parts.link
        if link.agent is None or step >= max_steps or self.control.switch or self.control.stop:
            return None
        if step + 1 in link.cfg.hold_steps and step + 1 < max_steps:
            link.agent.beat_soon(step=step, approaching=True)
        if step not in link.cfg.hold_steps:
            return None
        link.notices.mark()  # before the answer, which ``join`` may take as fetched
        return link.agent.beat_soon(step=step)

    def leaves_uncommitted(self, step: int, max_steps: int) -> str | None:
        """Why this member leaves now with its step (the one whose commit reaches ``step``)
        uncommitted, or None (``leaving.leave_uncommitted``); from the newest answer it
        holds, without asking."""
        link = self.parts.link
        latest = link.latest()
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
            at_change=self.control.switch or step in link.cfg.hold_steps,
            sharded=self.parts.sharded.fsdp is not None,
            hooks=bool(self.parts.update.hooks),
            checkpoint_due=self.rank == 0 and link.durable.due(step),
            stop=self.control.stop,
            last=step >= max_steps,
        )

    def hold(self, step: int, sent: Future[HeartbeatResponse] | None = None) -> bool:
        """Wait at a scheduled step until the coordinator has settled its membership;
        True if this member must switch generation (every member holds at the same step,
        so all see the same answer without a control word). ``sent``: the holding
        heartbeat ``hold_soon`` sent for this step, answered first."""
        link = self.parts.link
        assert link.agent is not None
        link.debug(f"hold at {step}")
        self.parts.clock.send_report(link.agent)  # settled once its generation formed
        while True:  # the coordinator keeps each answer back until it settles the step
            if sent is not None:
                resp, sent = sent.result(), None
            else:
                link.notices.mark()  # before the answer, which ``join`` may take as fetched
                resp = link.agent.beat_now(holding=True)
            settled = resp.settled_step is not None and resp.settled_step >= step
            if resp.stop or settled or resp.role != Role.MEMBER:
                break
            link.agent.wait_change(0.005)
        self.hold_answer = (step, resp)  # what it was told (sharding gathers on a shrink)
        newer = resp.generation is not None and resp.generation.id > self.generation
        link.debug(f"hold released (newer={newer})")
        return resp.stop or resp.role != Role.MEMBER or newer

    def join(self, answer: HeartbeatResponse | None = None) -> bool:
        """Wait for, and form, the newest generation that has this worker as a member.

        ``answer``: the coordinator's answer this member was just given, asked after a
        ``Notices.mark`` (a hold's: ``hold`` marks before each beat), taken for the first
        attempt instead of fetching again, a round trip (~2.5 ms on two busy cores) off
        every scheduled change's pause; an answer already outdated only costs that attempt
        (its rendezvous finds the generation abandoned, and the next attempt fetches).
        Returns False when the coordinator wants this worker to exit or the job to stop.
        """
        link, update, sharded = self.parts.link, self.parts.update, self.parts.sharded
        assert link.agent is not None and link.store is not None
        self.parts.clock.send_report(link.agent)  # the next generation opens once it formed
        tried = self.generation  # the newest generation tried
        self.parts.clock.joined = time.time()
        while True:
            before = tried  # what was tried before this attempt
            link.notices.follow(link.agent.config)
            if answer is not None:
                resp, answer = answer, None
            else:
                link.notices.mark()  # before the answer: a change after it is news
                resp = link.agent.fetch()
            if resp.stop:
                self.stopping = True
                return False
            if resp.role != Role.MEMBER:
                self.last_rank = None  # removed: no longer speaks for the job's state
            if resp.role == Role.EXIT:
                return False
            if link.store_epoch != link.agent.registered_epoch():  # a new coordinator
                link.connect_store()
            info = resp.generation
            try:
                if resp.role != Role.MEMBER or info is None or info.id <= tried:
                    # Until the coordinator publishes a change (``Notices.wait``); a retire
                    # moves no counter: it is heard at the next answer, STANDBY_FETCH_S on.
                    if not link.notices.wait(STANDBY_FETCH_S):
                        newest = max(tried, info.id if info else 0)
                        grp.wait_for_generation(
                            link.store, link.cfg.store_namespace, newest + 1, timeout_s=0.05
                        )
                    continue
                tried = info.id
                link.debug(f"join gen {info.id}")
                # Fatal, not a failure to heal from: every member would refuse the same way.
                self.parts.loader.sampler.check_world_size(len(info.members))
                sharded.check_world(len(info.members))
                if not self.agreed:  # once, before this process first trains with others
                    try:
                        identity.agree(
                            link.store, f"{link.cfg.store_namespace}/settings", self.identity
                        )
                    except identity.ScriptMismatch as exc:  # the coordinator fails the job
                        self.report_failure(info.id, exc, kind=FailureKind.SCRIPT_MISMATCH)
                        continue
                    self.agreed = True
                probes.point("join", update.step, info.id)
                outcome = grp.rendezvous(link.store, info, timeout_s=link.cfg.collective_timeout_s)
                if outcome == grp.Arrival.TIMED_OUT:
                    self.report_failure(info.id, grp.RendezvousTimeout(info, link.store))
                if outcome != grp.Arrival.FORMED:
                    continue
            except ForgedValue as exc:  # refused, never acted on: the coordinator re-forms
                self.report_failure(info.id, exc, kind=FailureKind.FORGED_STORE)
                continue
            except dist.DistError as exc:
                # The store went away with its coordinator: wait for the next one (the
                # heartbeat registers with it), then join what it decides. That may be a
                # generation of the same id (the new coordinator's, answered before this
                # worker knew its store; or one the dead one announced and never recorded):
                # not tried yet, or its other members would wait the rendezvous timeout.
                link.debug(f"store lost while joining: {exc}")
                tried = before
                link.agent.beat_now()
                link.connect_store()
                continue
            self.parts.clock.met = time.time()
            link.debug(f"rendezvous gen {info.id} done")
            probes.point("rendezvous", update.step, info.id)
            try:
                form(self.parts, info)
                self.failed_forms = 0
                return True
            except grp.Superseded:  # the coordinator already opened the next one
                link.debug(f"gen {info.id} superseded while forming")
                self.leave_group(failed=True)
            except StateLost as exc:
                self.leave_group()
                self.report_failure(info.id, exc, kind=FailureKind.STATE_LOST)
            except ModelMismatch as exc:  # the job cannot go on: the coordinator fails it
                self.leave_group(failed=True)
                self.report_failure(info.id, exc, kind=FailureKind.SCRIPT_MISMATCH)
            except ForgedValue as exc:  # a peer's address or step, refused (``store_auth``)
                self.failed_forms += 1
                self.leave_group(failed=True)
                self.report_failure(info.id, exc, kind=FailureKind.FORGED_STORE)
            except Exception as exc:  # noqa: BLE001 - a peer failed while we formed
                if isinstance(exc, HealInterrupted):  # a mix of two steps: never a source
                    update.forget()
                self.failed_forms += 1
                self.leave_group(failed=True)
                self.report_failure(info.id, exc)

    def grouped(self, members: list[int]) -> None:
        """The group of ``members`` (worker ids by rank) formed; healing follows."""
        self.members = list(members)

    def formed(self, rank: int, generation: int) -> None:
        """This member is rank ``rank`` of ``generation``, healed (``forming``)."""
        self.rank, self.world_size, self.generation = rank, len(self.members), generation
        self.last_rank = rank
