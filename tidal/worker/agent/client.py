"""A worker's link to the coordinator: registration, heartbeats and an outbox.

Nothing here blocks a training step: heartbeats, metrics and timing reports travel on a
background thread, and the training loop reads the newest answer (role and generation)
from memory at step boundaries. Only the rare membership calls (fetch the role after a
switch, report a failure, report completion) are blocking round trips.

Per-step records (``tidal.log``) reach the job's records through a coordinator that writes
them down within a second of taking them; one killed meanwhile loses what it took. So a
worker keeps the newest records it delivered, and when it registers again with a restarted
coordinator, which tells it the newest of its records the job's records hold
(``RegisterResponse.saved_step_metrics``), it sends the ones after that again.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import httpx

from tidal.client import CoordinatorClient, CoordinatorError
from tidal.protocol import (
    MAX_STEP_RECORDS,
    CheckpointFailure,
    CheckpointView,
    Departure,
    DoneReport,
    FailureKind,
    FailureReport,
    HeartbeatRequest,
    HeartbeatResponse,
    RegisterRequest,
    RegisterResponse,
    StepMetrics,
    StepReport,
    StopAnswer,
    StopReport,
    WorkerConfig,
    WorkerEnv,
)
from tidal.worker.agent import retry

T = TypeVar("T")
log = logging.getLogger(__name__)


# Before its first registration a worker knows no ``orphan_timeout_s``: it waits this long for
# a coordinator (one restarted by its supervisor answers within a second or two).
ORPHAN_TIMEOUT_S = 30.0
# Per-step metric records (``tidal.log``) waiting for the coordinator; a heartbeat carries at
# most ``protocol.MAX_STEP_RECORDS`` of them. Beyond this many (the coordinator unreachable
# for long), the oldest are dropped, with one warning.
MAX_STEP_OUTBOX = 20_000
# Per-step records delivered, kept until a restarted coordinator says which of them the dead
# one had written down (``RegisterResponse.saved_step_metrics``): the recorder writes them
# within a second, so these many (the newest) are plenty.
RESEND_KEEP = 4096


class Agent:
    """The worker's side of the API, on keep-alive connections: one for the heartbeat
    thread, one for the training thread's blocking calls, one for failure reports.

    Through a coordinator outage (its supervisor restarts it within a second or two, or an
    operator runs ``tidal attach``) every call is retried, and the training loop goes on in
    its generation meanwhile; a coordinator that answers 409 (``ReRegister``: it was restarted
    and does not know this worker yet) gets a new registration first, which bumps ``epoch``
    (the trainer then reconnects to the store named by the new ``config``). A worker that
    reaches no coordinator for ``WorkerConfig.orphan_timeout_s`` exits (code 3)."""

    def __init__(self, env: WorkerEnv) -> None:
        self.env = env
        self.worker_id = env.worker_id
        self._client = CoordinatorClient(env.url, env.token)
        self._beat_client = CoordinatorClient(env.url, env.token)
        # Made now, not with the first report: that is on a recovery's path.
        self._report_client = CoordinatorClient(env.url, env.token)
        self._reporter = ThreadPoolExecutor(1, thread_name_prefix="tidal-failure-report")
        # A scheduled step's holding heartbeat, sent during the step's update (``beat_soon``).
        self._hold_client = CoordinatorClient(env.url, env.token)
        self._failure_reports: list[Future] = []
        self._lock = threading.Lock()
        self._register_lock = threading.Lock()
        self._wake = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._latest: HeartbeatResponse | None = None
        self.latest_at = 0.0  # monotonic: when ``_latest`` was answered
        #: Seconds this member has been in the script outside Tidal's collectives, or None
        #: (``AbortWatch.script_s``): what each heartbeat says of it (``busy``).
        self.script_s: Callable[[], float | None] = lambda: None
        # Each request that returns an answer is numbered as it is sent; ``_latest`` is the
        # answer to the highest number answered so far (``_set_latest``).
        self._asked = itertools.count()
        self._latest_asked = -1
        self._metrics: dict[str, float] = {}
        self._reports: list[StepReport] = []
        self._departures: list[Departure] = []
        self._checkpoints: list[CheckpointView] = []
        self._checkpoint_failures: list[CheckpointFailure] = []
        self._step_metrics: list[StepMetrics] = []
        self._step_metrics_dropped = 0
        self._delivered: deque[StepMetrics] = deque(maxlen=RESEND_KEEP)
        self.leaving = False  # a preemption notice arrived: leave at the next step boundary
        self.notice: str | None = None  # where it came from (``announce_leaving``)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.step = 0
        self.generation = 0
        self.config: WorkerConfig | None = None  # the newest registration's
        self.epoch = 0  # registrations so far: a new one may name a new store
        self._max_steps: int | None = None
        self._orphan_timeout_s = ORPHAN_TIMEOUT_S
        self._last_ok = time.monotonic()  # the last call the coordinator answered

    def register(self, max_steps: int | None = None) -> RegisterResponse:
        """``max_steps``: the job's length, against which the coordinator decides completion."""
        self._max_steps = max_steps
        resp = self._call(self._client, lambda c: self._register(c, self.epoch))
        self._thread = threading.Thread(target=self._beat_loop, name="tidal-heartbeat", daemon=True)
        self._thread.start()
        return resp

    def _register(self, client: CoordinatorClient, seen_epoch: int) -> RegisterResponse | None:
        """(Re-)register, unless another thread did since ``seen_epoch``."""
        with self._register_lock:
            if self.epoch != seen_epoch:
                return None
            resp = client.register(
                self.worker_id,
                RegisterRequest(
                    pid=os.getpid(),
                    host=socket.gethostname(),
                    max_steps=self._max_steps,
                    generation=self.generation,
                    step=self.step,
                ),
            )
            self.config = resp.config
            self._interval = resp.config.heartbeat_interval_s
            self._orphan_timeout_s = resp.config.orphan_timeout_s
            if self.epoch:  # a restarted coordinator: what the dead one took goes again
                self._resend(resp.saved_step_metrics)
            self.epoch += 1
            return resp

    def _resend(self, saved: tuple[int, int] | None) -> None:
        """Put the per-step records delivered from ``saved`` (generation, step) on, in front
        of the outbox (all of those kept if None): a restarted coordinator's records hold
        only those below it. Sent twice, a record changes nothing (the same worker's value
        of the same step and generation)."""
        with self._lock:
            again = [r for r in self._delivered if saved is None or (r.generation, r.step) >= saved]
            self._delivered.clear()
            self._step_metrics = again + self._step_metrics
            self._bound_step_metrics()
        if again:
            self._wake.set()  # the heartbeat thread sends them now

    def registered_epoch(self) -> int:
        """``epoch``, once a registration in flight on another thread has finished. A
        restarted coordinator answers this worker as soon as it has processed a registration,
        while the thread that sent it may not have taken the new ``config`` yet: an answer in
        hand proves that registration is done or holds the lock (seeds 320000039, -49, -114:
        a member joined a new coordinator's generation in the dead one's store)."""
        with self._register_lock:
            return self.epoch

    def _call(self, client: CoordinatorClient, fn: Callable[[CoordinatorClient], T]) -> T:
        """``fn(client)``, retried through a coordinator outage (unreachable, or a 5xx)
        until the orphan timeout, with capped exponential backoff and jitter
        (``retry.backoff_s``); a 409 registers again first. Other refusals (4xx) raise."""
        for attempt in itertools.count():
            epoch = self.epoch
            try:
                result = fn(client)
                self._last_ok = time.monotonic()
                return result
            except CoordinatorError as exc:
                if exc.status == 409:
                    self._register(client, epoch)
                    continue
                if 400 <= exc.status < 500:
                    raise
                error: Exception = exc
            except httpx.TransportError as exc:
                error = exc
            self._exit_if_orphaned(error)
            time.sleep(retry.backoff_s(attempt, random.random()))

    def _exit_if_orphaned(self, error: Exception) -> None:
        if time.monotonic() - self._last_ok > self._orphan_timeout_s and not self._closed:
            log.error(
                "no coordinator answered for %.0f s (%s: %s); exiting",
                self._orphan_timeout_s,
                type(error).__name__,
                error,
            )
            os._exit(3)

    # -- the background thread -------------------------------------------------------
    def _drain(self) -> HeartbeatRequest:
        """The next heartbeat, carrying (and taking out of the outbox) what waits there."""
        with self._lock:
            # Not validated here: the coordinator validates, and its refusal is printed (a bad
            # metric must not end the heartbeat thread).
            req = HeartbeatRequest.model_construct(
                step=self.step,
                generation=self.generation,
                leaving=self.leaving,
                notice=self.notice,
                script_s=self.script_s(),
                metrics=self._metrics,
                reports=self._reports,
                departures=self._departures,
                checkpoints=self._checkpoints,
                checkpoint_failures=self._checkpoint_failures,
                step_metrics=self._step_metrics[:MAX_STEP_RECORDS],
            )
            self._metrics, self._reports, self._checkpoints = {}, [], []
            self._departures = []
            self._checkpoint_failures = []
            self._step_metrics = self._step_metrics[MAX_STEP_RECORDS:]
            if self._step_metrics:
                self._wake.set()  # the rest go with the next heartbeat, without waiting
        return req

    def _beat_loop(self) -> None:
        last_refusal = ""
        while not self._closed:
            req = self._drain()
            epoch = self.epoch
            try:
                asked = next(self._asked)
                resp = self._beat_client.heartbeat(self.worker_id, req)
                self._last_ok = time.monotonic()
                self._set_latest(resp, asked)
                if req.step_metrics:
                    self._delivered_to(epoch, req.step_metrics)
            except Exception as exc:  # noqa: BLE001 - any failure to reach it counts the same
                if isinstance(exc, CoordinatorError) and exc.status == 409:
                    self._requeue(req)  # a restarted coordinator: register, then deliver
                    try:
                        self._register(self._beat_client, epoch)
                    except Exception:  # noqa: BLE001 - retried with the next heartbeat
                        pass
                    continue
                if isinstance(exc, CoordinatorError) and 400 <= exc.status < 500:
                    # Refused: sent again it would be refused again. The script's records
                    # are dropped, Tidal's own kept (``retry.after_refusal``), and the log
                    # says which. A worker whose heartbeats keep being refused is killed as
                    # hung: its log says why, once per reason.
                    verdict = retry.after_refusal(retry.Refused.of(req))
                    if verdict.keep_own:
                        self._requeue(req, own_only=True)
                    line = (
                        f"the coordinator refused a heartbeat of worker "
                        f"{self.worker_id} (HTTP {exc.status}): {exc}"[:1000]
                    ) + (f"; {verdict.dropped}" if verdict.dropped else "")
                    if line != last_refusal:  # once per reason and loss
                        last_refusal = line
                        log.warning("%s", line)
                else:
                    self._requeue(req)
                self._exit_if_orphaned(exc)
            latest = self._latest  # a large generation's coordinator paces its heartbeats
            self._wake.wait(latest.interval_s if latest and latest.interval_s else self._interval)
            self._wake.clear()

    def _delivered_to(self, epoch: int, records: list[StepMetrics]) -> None:
        """Keep ``records``, delivered to the coordinator of registration ``epoch``, until a
        restarted one says which it holds (``_resend``); a registration with a new one since
        (on the other thread) means they go again now."""
        with self._register_lock:  # no registration in between
            if self.epoch == epoch:
                with self._lock:
                    self._delivered.extend(records)
            else:  # in the outbox's order, (generation, step): the resent ones are older
                with self._lock:
                    self._step_metrics = sorted(
                        records + self._step_metrics, key=lambda r: (r.generation, r.step)
                    )
                    self._bound_step_metrics()

    def _requeue(self, req: HeartbeatRequest, *, own_only: bool = False) -> None:
        """Keep what a heartbeat that was not delivered carried, for the next one;
        ``own_only``: Tidal's own records, not the script's metrics."""
        with self._lock:
            if not own_only:
                self._metrics = {**req.metrics, **self._metrics}
                self._step_metrics = req.step_metrics + self._step_metrics
                self._bound_step_metrics()
            self._reports = req.reports + self._reports
            self._departures = req.departures + self._departures
            self._checkpoints = req.checkpoints + self._checkpoints
            self._checkpoint_failures = req.checkpoint_failures + self._checkpoint_failures

    def _set_latest(self, resp: HeartbeatResponse, asked: int) -> None:
        """Keep ``resp`` unless a request sent after it (``asked``: its number) was answered
        first. The heartbeat thread and the training thread ask concurrently: a heartbeat
        answered before a generation opened, whose thread read its answer after the
        trainer's fetch had brought that generation, replaced it, and the member, told it
        was a standby again, switched and waited for a generation that never came (the
        slow suite, 2026-12-04: a job stuck 138 s after its first step)."""
        with self._changed:
            if asked < self._latest_asked:
                return
            self._latest, self._latest_asked = resp, asked
            self.latest_at = time.monotonic()
            self._changed.notify_all()

    def _asking(
        self, fn: Callable[[CoordinatorClient], HeartbeatResponse]
    ) -> Callable[[CoordinatorClient], tuple[int, HeartbeatResponse]]:
        """``fn`` with each attempt's number taken as it is sent (``_set_latest``)."""
        return lambda c: (next(self._asked), fn(c))

    # -- what the training loop uses ----------------------------------------------------
    def latest(self) -> HeartbeatResponse | None:
        return self._latest

    def fetch(self) -> HeartbeatResponse:
        """Ask the coordinator now (a blocking round trip: only between generations)."""
        asked, resp = self._call(self._client, self._asking(lambda c: c.generation(self.worker_id)))
        self._set_latest(resp, asked)
        return resp

    def beat_now(self, *, holding: bool = False) -> HeartbeatResponse:
        """A heartbeat from the calling thread, so the coordinator learns the step now;
        ``holding``: this member waits at a scheduled step, and the coordinator answers
        once it has settled it (``HeartbeatRequest.holding``)."""
        return self._beat(self._client, step=self.step, holding=holding)

    def beat_soon(self, *, step: int, approaching: bool = False) -> Future[HeartbeatResponse]:
        """The holding heartbeat of scheduled step ``step``, sent now from a thread of its
        own (its own connection) while the training thread finishes committing that step;
        the future is its answer (``beat_now(holding=True)``'s). ``approaching``: the step
        before a scheduled one instead (``HeartbeatRequest.approaching``), whose answer only
        updates ``latest``. A daemon thread: one whose answer nobody waits for (the member
        switched or stopped instead) never holds up the process's exit, even retrying
        against a coordinator that is gone."""
        answer: Future[HeartbeatResponse] = Future()
        holding = not approaching

        def send() -> None:
            try:
                answer.set_result(
                    self._beat(
                        self._hold_client, step=step, holding=holding, approaching=approaching
                    )
                )
            except BaseException as exc:  # noqa: BLE001 - the caller's ``result`` raises it
                answer.set_exception(exc)

        threading.Thread(target=send, name="tidal-hold", daemon=True).start()
        return answer

    def _beat(
        self, client: CoordinatorClient, *, step: int, holding: bool, approaching: bool = False
    ) -> HeartbeatResponse:
        req = HeartbeatRequest(
            step=step, generation=self.generation, holding=holding, approaching=approaching
        )
        asked, resp = self._call(client, self._asking(lambda c: c.heartbeat(self.worker_id, req)))
        self._set_latest(resp, asked)
        return resp

    def wait_change(self, timeout_s: float) -> None:
        with self._changed:
            self._changed.wait(timeout_s)

    def post_metrics(self, metrics: dict[str, float]) -> None:
        with self._lock:
            self._metrics.update(metrics)

    def post_step_metrics(self, step: int, generation: int, values: dict[str, float]) -> None:
        """Values ``tidal.log`` recorded for ``step`` in ``generation`` (merged into the
        previous record when it is of the same step and generation: the last value wins)."""
        with self._lock:
            last = self._step_metrics[-1] if self._step_metrics else None
            if last is not None and (last.step, last.generation) == (step, generation):
                last.values.update(values)
            else:
                record = StepMetrics.model_construct(
                    step=step, generation=generation, values=dict(values)
                )
                self._step_metrics.append(record)
                self._bound_step_metrics()

    def _bound_step_metrics(self) -> None:
        """Drop the oldest records beyond ``MAX_STEP_OUTBOX`` (under the lock); warn once."""
        excess = len(self._step_metrics) - MAX_STEP_OUTBOX
        if excess <= 0:
            return
        del self._step_metrics[:excess]
        if not self._step_metrics_dropped:
            log.warning(
                "worker %s drops per-step metrics the coordinator has not taken (more than "
                "%d steps waiting)",
                self.worker_id,
                MAX_STEP_OUTBOX,
            )
        self._step_metrics_dropped += excess

    def post_report(self, report: StepReport) -> None:
        """Put ``report`` in the outbox: it goes with the next heartbeat (``send_soon``)."""
        with self._lock:
            self._reports.append(report)

    def post_departure(self, departure: Departure) -> None:
        """Put ``departure`` in the outbox and send it now (a leaver's next call may be its
        last: it goes to standby or exits)."""
        with self._lock:
            self._departures.append(departure)
        self._wake.set()

    def send_soon(self) -> None:
        """Send the next heartbeat now, with whatever waits in the outbox."""
        self._wake.set()

    def post_checkpoint(self, checkpoint: CheckpointView) -> None:
        with self._lock:
            self._checkpoints.append(checkpoint)
        self._wake.set()

    def post_checkpoint_failure(self, step: int, error: str) -> None:
        with self._lock:
            self._checkpoint_failures.append(CheckpointFailure(step=step, error=error[:2000]))
        self._wake.set()

    def announce_leaving(self, why: str) -> None:
        """A preemption notice (``why``: where from): ask the coordinator, with the next
        heartbeat (sent now), to let this worker leave, a planned leave at the next step
        boundary: its peers already hold the state. Safe from a signal handler and from
        any thread (``cloud_watch``); the first notice's words are kept."""
        if self.notice is None:
            self.notice = why[:200]
        self.leaving = True
        self._wake.set()

    def install_preemption_handler(self) -> None:
        """SIGTERM becomes a notice (``announce_leaving``)."""

        def on_sigterm(signum: int, frame: object) -> None:
            self.announce_leaving("SIGTERM")

        signal.signal(signal.SIGTERM, on_sigterm)

    def report_failure(
        self, generation: int, step: int, error: str, *, kind: FailureKind = FailureKind.COLLECTIVE
    ) -> None:
        """Send a failure report without waiting for its answer: the member goes on to the
        next generation at once (the coordinator has usually opened it already, having
        seen the peer's exit itself; a report waiting behind the control loop's pass cost
        ~10 ms of every recovery). Reports are delivered in order, on one thread and
        connection of their own; the done report waits for them (``report_done``)."""
        report = FailureReport(generation=generation, step=step, error=error[:500], kind=kind)
        client = self._report_client
        self._failure_reports = [f for f in self._failure_reports if not f.done()]
        self._failure_reports.append(
            self._reporter.submit(
                self._call, client, lambda c: c.report_failure(self.worker_id, report)
            )
        )

    def report_done(self, *, step: int, completed: bool) -> None:
        """Tell the coordinator this worker's training loop has ended (after its failure
        reports: each worker's facts reach the coordinator in order)."""
        wait(self._failure_reports)
        report = DoneReport(step=step, completed=completed)
        self._call(self._client, lambda c: c.report_done(self.worker_id, report))

    def report_stop(self, *, generation: int, step: int, writes: bool) -> StopAnswer:
        """Tell the coordinator, and wait for its answer, that this member's script ended the
        job at committed ``step`` (``StopReport``), before the member leaves its group."""
        report = StopReport(generation=generation, step=step, writes=writes)
        return self._call(self._client, lambda c: c.report_stop(self.worker_id, report))

    def close(self) -> None:
        """Deliver what is still in the outbox and stop heartbeating (at process exit, so
        that metrics the script logs after its loop still reach the job's status)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        req = self._drain()
        try:
            self._client.heartbeat(self.worker_id, req)
            for _ in range(MAX_STEP_OUTBOX // MAX_STEP_RECORDS):  # per-step records left
                if not self._step_metrics:
                    break
                req = self._drain()
                self._client.heartbeat(self.worker_id, req)
        except Exception as exc:  # noqa: BLE001 - the job may be gone already: say what is lost
            r = retry.Refused.of(req)
            log.warning(
                "worker %s: the last heartbeat at exit was not delivered (%s: %s): %d metrics, "
                "%d per-step records and %d checkpoint records not recorded by the job",
                self.worker_id,
                type(exc).__name__,
                str(exc)[:300],
                r.metrics,
                r.step_records + len(self._step_metrics),
                len(r.checkpoints),
            )
        finally:
            self._client.close()
            self._beat_client.close()
            self._report_client.close()
            self._hold_client.close()
