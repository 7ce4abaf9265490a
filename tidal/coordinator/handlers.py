"""What the coordinator answers: the API calls of workers and users.

A mixin of ``Coordinator`` (which holds the job and the control loop). Every call that
changes the job becomes a fact (``facts``) queued in ``inbox``; the inbox is applied in
arrival order by ``_drain``, under the lock, by whichever comes first: the control loop's
next pass, or the caller itself (``_submit``), which then answers with what applying its
fact returned. What each fact does is ``effects.Effects``; decisions stay with the loop.

The hot path takes no lock: a heartbeat that carries only what may be applied later (its
step, metrics and per-step values) and a role query are answered from the published
``Answers``, the heartbeat queued for the next pass, so a thousand workers' heartbeats never
wait behind a pass. A heartbeat that carries a checkpoint, a checkpoint failure, a step
report or a preemption notice is applied before it is answered (after everything queued
before it, so each worker's facts apply in order): an answered fact must not be lost with a
coordinator crash. The dashboard's and the status's reads take no lock either: they read
what the loop published (``views``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tidal.coordinator.actions import Notify
from tidal.coordinator.answers import Answers
from tidal.coordinator.effects import RequestError, ReRegister
from tidal.coordinator.facts import (
    Beat,
    Done,
    Fact,
    FailureReported,
    Refused,
    Registered,
    ScaleRequested,
    ScriptStopped,
    StopRequested,
)
from tidal.coordinator.scale_rules import schedule_near
from tidal.protocol import (
    HOLD_ANSWER_S,
    DoneReport,
    FailureReport,
    HeartbeatRequest,
    RegisterRequest,
    RegisterResponse,
    Role,
    StopAnswer,
    StopReport,
)

if TYPE_CHECKING:
    from tidal.coordinator.job import Job
    from tidal.coordinator.records import WorkerRecord


class Handlers:
    job: Job  # the job's state (``job.Job``), set by Coordinator

    answers: Answers | None = None  # published by ``_publish``; None before the first
    _published_key: tuple | None = None
    published: threading.Condition  # notified by every ``_publish``; set by Coordinator
    #: Facts not applied yet, each with the future its caller waits on (None: nobody waits)
    inbox: deque[tuple[Fact, Future | None]]

    def _publish(self) -> None:
        """Publish what workers are told now (``answers``), if it changed since the last
        time; under the lock."""
        latest = self.job.latest
        stopped = self.job.script_stop
        key = (
            latest.id if latest is not None else None,
            self.job.stop_requested_at is not None or stopped is not None,
            self.job.outcome is not None,
            self.job.settled_step,
            len(self.job.workers),
            stopped.step if stopped is not None else None,
            self.job.busy,
        )
        if key == self._published_key:
            return
        notice = self._published_key is None or key[:3] != self._published_key[:3]
        self._published_key = key
        self.answers = Answers(
            generation=latest.info() if latest is not None else None,
            members=latest.member_set() if latest is not None else frozenset(),
            stop=key[1],
            stop_step=key[5],
            busy=key[6],
            ended=key[2],
            settled_step=self.job.settled_step,
            workers=len(self.job.workers),
            base_s=self.spec.beat_interval_s,
            timeout_s=self.spec.heartbeat_timeout_s,
        )
        with self.published:  # held members' heartbeats wait on it (``_await_hold``)
            self.published.notify_all()
        if notice:  # after the answer: rank 0 fetches it when it sees the count move
            self.executor.do(Notify())

    def _await_hold(self, w: WorkerRecord, step: int, timeout_s: float) -> None:
        """Wait (outside the lock) until the published answers release ``w``, held at
        ``step`` (``Membership._hold``): that step settled, ``w`` no longer a member, a stop
        or the job's end; at most ``timeout_s``. The long poll saves the held members a
        round trip after the loop's pass that settles the step (a hold is part of every
        scheduled change's pause)."""

        def released() -> bool:
            a = self.answers
            member = a.role(w.id, retired=w.retired) == Role.MEMBER
            return a.settled_step >= step or not member or a.stop or a.ended

        with self.published:
            self.published.wait_for(released, timeout_s)

    def _answer(self, w: WorkerRecord) -> bytes:
        answers = self.answers
        assert answers is not None  # published at construction
        return answers.encoded(answers.role(w.id, retired=w.retired))

    def _submit(self, fact: Fact) -> object:
        """Queue ``fact`` behind everything queued before it and apply the inbox; returns
        what applying it returned, or raises its refusal (``RequestError``, ``ReRegister``)."""
        done: Future = Future()
        self.inbox.append((fact, done))
        with self.lock:  # the loop may be applying it meanwhile: then this finds it done
            self._drain()
        return done.result()

    def _drain(self) -> None:
        """Apply the queued facts in arrival order (under the lock). A refusal or an error
        goes to the fact's caller; a quick heartbeat has none, and one from a worker no
        longer known is dropped."""
        while self.inbox:
            fact, done = self.inbox.popleft()
            try:
                result = self._apply(fact)
            except Exception as exc:  # noqa: BLE001 - the caller's thread raises it
                if done is None:
                    if isinstance(exc, (RequestError, ReRegister)):
                        continue
                    raise
                done.set_exception(exc)
            else:
                if done is not None:
                    done.set_result(result)

    def _apply(self, fact: Fact) -> object:
        match fact:
            case Beat(wid, req):
                w = self._caller(wid)
                if done_now := req.held_at is not None or self._carries_facts(req):
                    w.last_heartbeat = time.time()
                self._apply_heartbeat(w, req)
                if done_now:
                    self._publish()
                    return self._answer(w)
                return None
            case Registered(wid, req):
                return self._apply_register(wid, req)
            case FailureReported(wid, report):
                return self._apply_failure(wid, report)
            case Done(wid, report):
                return self._apply_done(wid, report)
            case ScriptStopped(wid, report):
                return self._apply_script_stop(wid, report)
            case ScaleRequested(n):
                return self._apply_scale(n)
            case StopRequested():
                return self._apply_stop()
            case Refused(_, message):
                return self.event("refused", message)
        raise TypeError(f"not a fact: {fact!r}")

    # -- API: workers --------------------------------------------------------------------
    def on_register(self, wid: int, req: RegisterRequest) -> RegisterResponse:
        return self._submit(Registered(wid, req))

    @staticmethod
    def _carries_facts(req: HeartbeatRequest) -> bool:
        """True if ``req`` carries a fact that is applied before it is answered (see the
        module's docstring)."""
        return bool(req.leaving or req.checkpoints or req.checkpoint_failures or req.reports)

    def heartbeat_is_quick(self, req: HeartbeatRequest) -> bool:
        """True if ``req`` may be answered at once and applied by the next pass (see the
        module's docstring). A holding heartbeat is, once the published answers settle its
        step: nothing is left to wait for, so the last member to reach a scheduled step,
        the one every other member of the change waits on, skips the thread hop and the
        loop's pass (part of every scheduled change's pause)."""
        if self._carries_facts(req):
            return False
        answers = self.answers
        at = req.held_at
        return at is None or (answers is not None and answers.settled_step >= at)

    def on_heartbeat(self, wid: int, req: HeartbeatRequest) -> bytes:
        """The heartbeat's answer, JSON-encoded (a ``HeartbeatResponse``). Lock-free when
        ``heartbeat_is_quick(req)``: a caller on an event loop runs only those inline. A
        holding one whose step is not settled yet is answered once the loop has settled it
        (``_await_hold``)."""
        if not self.heartbeat_is_quick(req):
            body = self._submit(Beat(wid, req))
            if req.held_at is not None:  # applying it woke the loop (a scheduled step)
                w = self._caller(wid)
                self._await_hold(w, req.held_at, HOLD_ANSWER_S)
                body = self._answer(w)
            return body
        w = self._caller(wid)
        w.last_heartbeat = time.time()
        self.inbox.append((Beat(wid, req), None))
        if schedule_near(self.spec.schedule, req.step):
            self.wake.set()  # members at or just before a scheduled step
        return self._answer(w)

    def on_role(self, wid: int) -> bytes:
        """The worker's role and the newest generation (a ``HeartbeatResponse``, encoded),
        lock-free."""
        return self._answer(self._caller(wid))

    def on_failure(self, wid: int, r: FailureReport) -> None:
        self._submit(FailureReported(wid, r))

    def on_done(self, wid: int, r: DoneReport) -> None:
        self._submit(Done(wid, r))

    def on_script_stop(self, wid: int, r: StopReport) -> StopAnswer:
        return self._submit(ScriptStopped(wid, r))

    def on_refused(self, wid: int, message: str) -> None:
        """A call of worker ``wid`` was refused at the API's edge: an event says why."""
        self._submit(Refused(wid, message))

    # -- API: users ----------------------------------------------------------------------
    def on_scale(self, n: int) -> None:
        lo, hi = self.spec.min_workers, self.spec.max_workers
        if not lo <= n <= hi:
            raise RequestError(
                f"{n} workers is outside [{lo}, {hi}] (--min-workers, --max-workers)"
            )
        self._submit(ScaleRequested(n))

    def on_stop(self) -> None:
        self._submit(StopRequested())
