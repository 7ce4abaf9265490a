"""What workers are told, published for the lock-free hot path: the ``Answers`` of now.

A part of ``Coordinator``. ``publish`` runs under the coordinator's lock, at the end of
every pass and after every change a worker must learn of at once (a generation opened, a
script's stop); heartbeats read the published ``answers`` without the lock, and a member
held at a scheduled step waits on ``published`` until they release it (``await_hold``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from tidal.coordinator.actions import Notify
from tidal.coordinator.control.answers import Answers
from tidal.protocol import Role

if TYPE_CHECKING:
    from tidal.config import JobSpec
    from tidal.coordinator.executor import Executor
    from tidal.coordinator.job import Job
    from tidal.coordinator.records.records import WorkerRecord


class Publisher:
    def __init__(self, *, job: Job, spec: JobSpec, executor: Executor) -> None:
        self.job = job
        self.spec = spec
        self.executor = executor
        #: What heartbeats are answered from; None before the first ``publish``.
        self.answers: Answers | None = None
        #: Notified by every ``publish``: held members' heartbeats wait on it.
        self.published = threading.Condition()
        self._key: tuple | None = None

    def publish(self) -> None:
        """Publish what workers are told now (``answers``), if it changed since the last
        time; under the lock."""
        job = self.job
        latest = job.latest
        stopped = job.script_stop
        key = (
            latest.id if latest is not None else None,
            job.stop_requested_at is not None or stopped is not None,
            job.outcome is not None,
            job.settled_step,
            len(job.workers),
            stopped.step if stopped is not None else None,
            job.busy,
        )
        if key == self._key:
            return
        notice = self._key is None or key[:3] != self._key[:3]
        self._key = key
        self.answers = Answers(
            generation=latest.info() if latest is not None else None,
            members=latest.member_set() if latest is not None else frozenset(),
            stop=key[1],
            stop_step=key[5],
            busy=key[6],
            ended=key[2],
            settled_step=job.settled_step,
            workers=len(job.workers),
            base_s=self.spec.beat_interval_s,
            timeout_s=self.spec.heartbeat_timeout_s,
        )
        with self.published:  # held members' heartbeats wait on it (``await_hold``)
            self.published.notify_all()
        if notice:  # after the answer: rank 0 fetches it when it sees the count move
            self.executor.do(Notify())

    def await_hold(self, w: WorkerRecord, step: int, timeout_s: float) -> None:
        """Wait (outside the lock) until the published answers release ``w``, held at
        ``step`` (``Membership._hold``): that step settled, ``w`` no longer a member, a stop
        or the job's end; at most ``timeout_s``. The long poll saves the held members a
        round trip after the loop's pass that settles the step (a hold is part of every
        scheduled change's pause)."""

        def released() -> bool:
            a = self.answers
            member = a.role(w.id, retired=w.retired) == Role.MEMBER
            return a.settled(step) or not member or a.stop or a.ended

        with self.published:
            self.published.wait_for(released, timeout_s)

    def answer(self, w: WorkerRecord) -> bytes:
        """``w``'s answer (a ``HeartbeatResponse``, encoded), lock-free."""
        answers = self.answers
        assert answers is not None  # published at construction
        return answers.encoded(answers.role(w.id, retired=w.retired))
