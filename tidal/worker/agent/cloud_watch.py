"""The preemption-notice watcher: a thread in each worker polling its machine's metadata.

Where it runs, and why: the notice is per machine, and the worker is what must leave, so
each worker polls the endpoint of the machine it runs on (a local, Ray or ``tidal worker
--join`` worker alike) and turns a notice into ``Agent.announce_leaving``, the path a
SIGTERM takes: the next heartbeat asks the coordinator to let it leave, and it leaves at the
next step boundary (a planned change: no failed generation, no step lost). What the
answers mean is ``tidal.preemption``'s (pure); this module does the requests.

Contract:

- one request at a time, each bounded by ``REQUEST_TIMEOUT_S``; ``period_s`` between reads
  while the endpoint answers; after an error (unreachable, a timeout, an answer the
  provider does not document) ``preemption.retry_delay``: capped exponential backoff with
  jitter. The first error is said once in the worker's log (a warning), and the first
  answer after it once more; nothing else is logged until a notice.
- a notice is acted on once; the thread then ends. ``close`` stops it (at once between
  requests, within a request's timeout otherwise; a daemon thread, it never holds up the
  process's exit).
- nothing it meets ends the worker: any exception in a poll counts as an error.
- no proxy: the metadata servers are link-local, and ``HTTP_PROXY`` must not reach them.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import httpx

from tidal.preemption import (
    REQUEST_TIMEOUT_S,
    Malformed,
    parse_aws,
    parse_azure,
    parse_gcp,
    retry_delay,
)

log = logging.getLogger(__name__)

AWS_BASE = "http://169.254.169.254"
GCP_BASE = "http://metadata.google.internal"
AZURE_BASE = "http://169.254.169.254"
AWS_TOKEN_TTL_S = 21600  # the most IMDSv2 allows; renewed an hour before it expires


class Source:
    """One endpoint: ``poll`` reads it once and returns the notice in words, or None;
    it raises ``httpx.HTTPError`` or ``Malformed`` for an error."""

    name = "url"

    def poll(self, client: httpx.Client) -> str | None:
        raise NotImplementedError


class Url(Source):
    """Any URL answering as AWS's ``spot/instance-action`` (``preemption``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = url

    def poll(self, client: httpx.Client) -> str | None:
        r = client.get(self.url)
        return parse_aws(r.status_code, r.text)


class Aws(Source):
    """IMDSv2: a session token, then ``spot/instance-action`` with it."""

    name = "aws"

    def __init__(self, base: str = AWS_BASE) -> None:
        self.base = base
        self._token: str | None = None
        self._renew_at = 0.0

    def _fetch_token(self, client: httpx.Client) -> str:
        r = client.put(
            f"{self.base}/latest/api/token",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
        )
        if r.status_code != 200 or not r.text.strip():
            raise Malformed(f"IMDSv2 token: HTTP {r.status_code}")
        self._renew_at = time.monotonic() + AWS_TOKEN_TTL_S - 3600
        return r.text.strip()

    def poll(self, client: httpx.Client) -> str | None:
        for attempt in (0, 1):
            if self._token is None or time.monotonic() > self._renew_at:
                self._token = self._fetch_token(client)
            r = client.get(
                f"{self.base}/latest/meta-data/spot/instance-action",
                headers={"X-aws-ec2-metadata-token": self._token},
            )
            if r.status_code == 401 and attempt == 0:  # the token expired: a new one, once
                self._token = None
                continue
            return parse_aws(r.status_code, r.text)
        return None  # not reached: the second attempt returns or raises


class Gcp(Source):
    name = "gcp"

    def __init__(self, base: str = GCP_BASE) -> None:
        self.base = base

    def poll(self, client: httpx.Client) -> str | None:
        r = client.get(
            f"{self.base}/computeMetadata/v1/instance/preempted",
            headers={"Metadata-Flavor": "Google"},
        )
        return parse_gcp(r.status_code, r.text)


class Azure(Source):
    """Scheduled Events; the VM's own name (read once) picks the events that are its own."""

    name = "azure"
    HEADERS = {"Metadata": "true"}

    def __init__(self, base: str = AZURE_BASE) -> None:
        self.base = base
        self.vm_name: str | None = None

    def poll(self, client: httpx.Client) -> str | None:
        if self.vm_name is None:
            r = client.get(
                f"{self.base}/metadata/instance/compute/name",
                params={"api-version": "2021-02-01", "format": "text"},
                headers=self.HEADERS,
            )
            if r.status_code != 200 or not r.text.strip():
                raise Malformed(f"the VM's name: HTTP {r.status_code}")
            self.vm_name = r.text.strip()
        r = client.get(
            f"{self.base}/metadata/scheduledevents",
            params={"api-version": "2020-07-01"},
            headers=self.HEADERS,
        )
        return parse_azure(r.status_code, r.text, self.vm_name)


def source_for(setting: str, worker_id: int) -> Source:
    """The source ``--preemption-notice`` names (validated by ``JobSpec``)."""
    if setting == "aws":
        return Aws()
    if setting == "gcp":
        return Gcp()
    if setting == "azure":
        return Azure()
    return Url(setting.replace("{worker}", str(worker_id)))


class Watcher:
    """Polls ``source`` on a daemon thread until a notice (then ``on_notice(words)``, once)
    or ``close``. ``jitter``: where the backoff's jitter comes from (``random.random``)."""

    def __init__(
        self,
        source: Source,
        on_notice: Callable[[str], None],
        *,
        period_s: float,
        timeout_s: float = REQUEST_TIMEOUT_S,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.source, self._on_notice = source, on_notice
        self.period_s, self.timeout_s, self._jitter = period_s, timeout_s, jitter
        self.polls = 0  # answers read, errors included
        self.errors = 0  # in a row, now
        self.notice: str | None = None
        self._stop = threading.Event()
        self._warned = False  # the first error is said
        self._said_back = False  # and the first answer after it
        self._thread = threading.Thread(target=self._run, name="tidal-preemption", daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def close(self, wait_s: float = 0.2) -> None:
        """Stop polling. Waits at most ``wait_s`` for the thread: one inside a request ends
        within the request's timeout on its own, and a worker's end (its done report comes
        after this) must not wait for an endpoint that does not answer."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=wait_s)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s, trust_env=False) as client:
            delay = 0.0
            while not self._stop.wait(delay):
                delay = self._poll_once(client)
                if self.notice is not None:
                    return

    def _poll_once(self, client: httpx.Client) -> float:
        """One read; the seconds to wait before the next."""
        try:
            notice = self.source.poll(client)
        except Exception as exc:  # noqa: BLE001 - whatever it is, retried, never fatal
            self.polls += 1
            self.errors += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "tidal: the preemption-notice endpoint (%s) does not answer (%s: %s); "
                    "retrying with backoff up to %.0f s: notices are missed meanwhile",
                    self.source.name,
                    type(exc).__name__,
                    str(exc)[:200] or "no detail",
                    retry_delay(99, period_s=self.period_s, jitter=1.0),
                )
            return retry_delay(self.errors, period_s=self.period_s, jitter=self._jitter())
        self.polls += 1
        if self.errors and self._warned and not self._said_back:
            self._said_back = True
            log.warning(
                "tidal: the preemption-notice endpoint (%s) answers again", self.source.name
            )
        self.errors = 0
        if notice is not None:
            self.notice = f"{self.source.name}: {notice}"
            log.warning("tidal: preemption notice (%s): leaving at the next step", self.notice)
            self._on_notice(self.notice)
        return self.period_s


def start(
    setting: str | None, worker_id: int, on_notice: Callable[[str], None], *, period_s: float
) -> Watcher | None:
    """The watcher ``--preemption-notice`` asks for, started; None when it asks for none."""
    if not setting:
        return None
    return Watcher(source_for(setting, worker_id), on_notice, period_s=period_s).start()
