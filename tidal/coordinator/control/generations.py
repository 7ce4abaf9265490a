"""Generations opened: the member list in rank order, its rendezvous, and what opening one
settles (members held at a scheduled step) or decides (an empty one: every member lost).

A part of ``Coordinator``; every method runs under the coordinator's lock. The loop, the
workers' lives (``lifecycle``) and scaling open generations through ``open``; the rendezvous
goes through the executor (``actions.OpenGeneration``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tidal.checkpoint.layout import newest_usable
from tidal.checkpoint.location import Location
from tidal.coordinator.actions import OpenGeneration, RecordGeneration
from tidal.coordinator.records.records import GenerationRecord
from tidal.coordinator.rules.reform_rules import every_member_lost
from tidal.coordinator.rules.scale_rules import newer_forming, schedule_settled
from tidal.coordinator.rules.verdicts import Act
from tidal.protocol import JobState, WorkerState

if TYPE_CHECKING:
    from tidal.config import JobSpec
    from tidal.coordinator.control.ledger import Ledger
    from tidal.coordinator.control.publish import Publisher
    from tidal.coordinator.executor import Executor
    from tidal.coordinator.job import Job


class Generations:
    def __init__(
        self,
        *,
        job: Job,
        spec: JobSpec,
        executor: Executor,
        ledger: Ledger,
        publisher: Publisher,
        namespace: str,
        first_id: int,
        checkpoint_dir: Location | None,
    ) -> None:
        """``namespace``: the coordinator's store namespace; ``first_id``: the id of the
        job's first generation if it has none (a resumed job's go on from its records')."""
        self.job = job
        self.spec = spec
        self.executor = executor
        self.ledger = ledger
        self.publisher = publisher
        self.namespace = namespace
        self.first_id = first_id
        self.checkpoint_dir = checkpoint_dir

    def open(
        self,
        members: list[int],
        reason: str,
        *,
        to_standby: Sequence[int] = (),
        resume: tuple[str, int] | None = None,
    ) -> None:
        """Open the next generation with ``members``; ``resume`` (a checkpoint's path and
        step): no live worker holds the job's state, every member loads it first."""
        job = self.job
        prev = job.latest
        gen = GenerationRecord(
            id=prev.id + 1 if prev is not None else self.first_id,
            members=members,
            reason=reason,
            opened_at=time.time(),
            namespace=self.namespace,
            committed_step=job.step,
            resume_from=resume[0] if resume else None,
            resume_step=resume[1] if resume else None,
        )
        self.executor.do(
            OpenGeneration(
                prefix=gen.store_prefix, previous=prev.store_prefix if prev is not None else None
            )
        )
        job.generations.append(gen)
        ranks = {m: i for i, m in enumerate(members)}
        now = time.monotonic()
        for w in job.workers.values():
            if w.id in ranks:
                w.state, w.rank = WorkerState.RUNNING, ranks[w.id]
            elif w.state == WorkerState.RUNNING:
                w.rank = None
                if w.id in to_standby:
                    w.state = WorkerState.STANDBY
                else:
                    w.ask_to_exit(now)
        # Members held at a scheduled step go on with it: released by this publish, before
        # the records below (the held members' pause waits on it).
        self.settle_schedule()
        self.publisher.publish()  # the members learn of it at their next heartbeat
        self.ledger.save_workers()
        self.executor.do(RecordGeneration(generation=gen.view()))
        self.ledger.save_control()
        self.ledger.event(
            "generation", f"generation {gen.id}: {len(members)} workers {members} ({reason})"
        )
        if not members and job.outcome is None:
            self._every_member_lost()

    def settle_schedule(self) -> None:
        """Release members held at the last applied --schedule step once the generation has
        the target count (or it cannot get there within the start timeout, or a newer
        generation needs them to form: ``scale_rules.schedule_settled``)."""
        job = self.job
        at = self.spec.schedule[job.schedule_done - 1][0] if job.schedule_done else None
        if schedule_settled(
            held_at=at,
            settled=job.settled_step,
            members=len(job.members),
            target=job.target,
            waited_s=time.monotonic() - job.schedule_applied_at,
            timeout_s=self.spec.start_timeout_s,
            newer_forming=at is not None
            and bool(job.members)
            and newer_forming(
                at=at,
                latest=job.latest.id,
                formed=job.latest.formed,
                held=[job.workers[m].held for m in job.members],
            ),
        ):
            job.settled_step = at

    def _every_member_lost(self) -> None:
        """The generation just opened is empty: go on from the newest verified checkpoint
        (``reform_rules.every_member_lost``) or fail."""
        step = None
        if self.checkpoint_dir is not None:
            _, step, warnings = newest_usable(self.checkpoint_dir)
            for line in warnings:
                self.ledger.event("checkpoint", line)
        verdict = every_member_lost(
            keeps_checkpoints=self.checkpoint_dir is not None,
            checkpoint_step=step,
            step=self.job.step,
        )
        if verdict.act is Act.FAIL:
            self.ledger.decide(JobState.FAILED, verdict.why)
        else:
            self.ledger.event("failure", verdict.why)
