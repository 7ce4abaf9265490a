"""What the coordinator answers: the API calls of workers and users.

A part of ``Coordinator``. Every call that changes the job becomes a fact (``facts``)
queued in ``inbox``; the inbox is applied in arrival order by ``drain``, under the lock, by
whichever comes first: the control loop's next pass, or the caller itself (``_submit``),
which then answers with what applying its fact returned. What each fact does is
``effects.Effects``; decisions stay with the loop.

The hot path takes no lock: a heartbeat that carries only what may be applied later (its
step, metrics and per-step values) and a role query are answered from the published
``Answers`` (``publish.Publisher``), the heartbeat queued for the next pass, so a thousand
workers' heartbeats never wait behind a pass. A heartbeat that carries a checkpoint, a
checkpoint failure, a step report or a preemption notice is applied before it is answered
(after everything queued before it, so each worker's facts apply in order): an answered
fact must not be lost with a coordinator crash. The dashboard's and the status's reads take
no lock either: they read what the loop published (``views``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tidal.coordinator.control.effects import RequestError, ReRegister
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
from tidal.coordinator.rules.scale_rules import schedule_near
from tidal.protocol import (
    HOLD_ANSWER_S,
    DoneReport,
    FailureReport,
    HeartbeatRequest,
    RegisterRequest,
    RegisterResponse,
    StopAnswer,
    StopReport,
)

if TYPE_CHECKING:
    from tidal.config import JobSpec
    from tidal.coordinator.control.effects import Effects
    from tidal.coordinator.control.ledger import Ledger
    from tidal.coordinator.control.publish import Publisher
    from tidal.coordinator.control.wake import Wake


class Handlers:
    def __init__(
        self,
        *,
        spec: JobSpec,
        lock: threading.RLock,
        inbox: deque[tuple[Fact, Future | None]],
        wake: Wake,
        effects: Effects,
        publisher: Publisher,
        ledger: Ledger,
    ) -> None:
        """``inbox``: the facts not applied yet, each with the future its caller waits on
        (None: nobody waits); ``lock``: the coordinator's."""
        self.spec = spec
        self.lock = lock
        self.inbox = inbox
        self.wake = wake
        self.effects = effects
        self.publisher = publisher
        self.ledger = ledger

    def _submit(self, fact: Fact) -> object:
        """Queue ``fact`` behind everything queued before it and apply the inbox; returns
        what applying it returned, or raises its refusal (``RequestError``, ``ReRegister``)."""
        done: Future = Future()
        self.inbox.append((fact, done))
        with self.lock:  # the loop may be applying it meanwhile: then this finds it done
            self.drain()
        return done.result()

    def drain(self) -> None:
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
                w = self.effects.caller(wid)
                if done_now := req.held_at is not None or self._carries_facts(req):
                    w.last_heartbeat = time.time()
                self.effects.apply_heartbeat(w, req)
                if done_now:
                    self.publisher.publish()
                    return self.publisher.answer(w)
                return None
            case Registered(wid, req):
                return self.effects.apply_register(wid, req)
            case FailureReported(wid, report):
                return self.effects.apply_failure(wid, report)
            case Done(wid, report):
                return self.effects.apply_done(wid, report)
            case ScriptStopped(wid, report):
                return self.effects.apply_script_stop(wid, report)
            case ScaleRequested(n):
                return self.effects.apply_scale(n)
            case StopRequested():
                return self.effects.apply_stop()
            case Refused(_, message):
                return self.ledger.event("refused", message)
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
        answers = self.publisher.answers
        at = req.held_at
        return at is None or (answers is not None and answers.settled(at))

    def on_heartbeat(self, wid: int, req: HeartbeatRequest) -> bytes:
        """The heartbeat's answer, JSON-encoded (a ``HeartbeatResponse``). Lock-free when
        ``heartbeat_is_quick(req)``: a caller on an event loop runs only those inline. A
        holding one whose step is not settled yet is answered once the loop has settled it
        (``Publisher.await_hold``)."""
        if not self.heartbeat_is_quick(req):
            body = self._submit(Beat(wid, req))
            if req.held_at is not None:  # applying it woke the loop (a scheduled step)
                w = self.effects.caller(wid)
                self.publisher.await_hold(w, req.held_at, HOLD_ANSWER_S)
                body = self.publisher.answer(w)
            return body
        w = self.effects.caller(wid)
        w.last_heartbeat = time.time()
        self.inbox.append((Beat(wid, req), None))
        if schedule_near(self.spec.schedule, req.step):
            self.wake.set()  # members at or just before a scheduled step
        return self.publisher.answer(w)

    def on_role(self, wid: int) -> bytes:
        """The worker's role and the newest generation (a ``HeartbeatResponse``, encoded),
        lock-free."""
        return self.publisher.answer(self.effects.caller(wid))

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
