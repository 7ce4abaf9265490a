"""``--preemption-notice``: what the clouds' metadata endpoints say, read as rules.

A spot machine is announced before it is taken: AWS two minutes ahead, GCP and Azure about
30 s. Each worker polls its own machine's endpoint (``worker.cloud_watch``, the side
effects); a notice becomes the same planned leave as a SIGTERM (``Agent.announce_leaving``):
the worker asks to leave and does so at the next step boundary, nothing redone.

The sources and the answers each provider documents (checked against their docs):

- ``aws``: IMDSv2. ``PUT /latest/api/token`` (header ``X-aws-ec2-metadata-token-ttl-seconds``)
  gives a token; ``GET /latest/meta-data/spot/instance-action`` with the token (header
  ``X-aws-ec2-metadata-token``) answers 404 until a notice, then 200 and
  ``{"action": "terminate"|"stop"|"hibernate", "time": "2017-09-18T08:22:00Z"}``. AWS asks
  for a check every 5 s.
- ``gcp``: ``GET http://metadata.google.internal/computeMetadata/v1/instance/preempted``
  with ``Metadata-Flavor: Google`` answers ``FALSE``, then ``TRUE`` once preempted.
- ``azure``: Scheduled Events, ``GET /metadata/scheduledevents?api-version=2020-07-01``
  with ``Metadata: true`` answers ``{"DocumentIncarnation": n, "Events": [...]}``; an event
  of ``EventType`` ``Preempt`` whose ``Resources`` names this VM (the events of an
  availability set or scale set reach all its VMs) is the notice. The VM's name comes
  from ``/metadata/instance/compute/name?api-version=2021-02-01&format=text``.
- a URL (``http://`` or ``https://``): a plain ``GET`` answered as AWS's
  ``spot/instance-action``: 404 (or 204) while there is none, 200 with a JSON object that
  has an ``action`` once there is. ``{worker}`` in it becomes the worker's id (a proxy
  that serves the notices of several machines, a test).

Any other answer (a 500, a body the provider does not document) is ``Malformed``: an
error like an unreachable server, retried with ``retry_delay``, never taken as a notice.
"""

from __future__ import annotations

import json

from tidal import backoff

PROVIDERS = ("aws", "gcp", "azure")
#: Seconds between two reads while the endpoint answers (AWS asks for 5 s).
DEFAULT_POLL_S = 5.0
#: The longest wait between two tries while it does not: a notice 30 s ahead is still
#: seen once the endpoint answers again, and an unreachable one costs 2 requests a minute.
RETRY_CAP_S = 30.0
#: Each request's connect and read timeout (a link-local server answers in milliseconds).
REQUEST_TIMEOUT_S = 2.0


class Malformed(ValueError):
    """An answer the source's documentation does not describe."""


def notice_source_error(value: object) -> str | None:
    """Why ``value`` cannot be ``--preemption-notice``, in one line, or None."""
    if value is None:
        return None
    if isinstance(value, str) and (
        value in PROVIDERS or (value.startswith(("http://", "https://")) and len(value) > 8)
    ):
        return None
    return (
        f"--preemption-notice must be aws, gcp, azure or an http:// URL answering as AWS's "
        f"spot/instance-action, got {value!r}"
    )


def _json(body: str) -> object:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise Malformed(f"not JSON: {body[:80]!r}") from exc


def parse_aws(status: int, body: str) -> str | None:
    """AWS's ``spot/instance-action`` (and the URL form's) answer: the notice in words, or
    None while there is none."""
    if status in (404, 204):
        return None
    if status != 200:
        raise Malformed(f"HTTP {status}")
    doc = _json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("action"), str):
        raise Malformed(f"no action in {body[:80]!r}")
    when = doc.get("time")
    return doc["action"] + (f" at {when}" if isinstance(when, str) else "")


def parse_gcp(status: int, body: str) -> str | None:
    """GCP's ``instance/preempted``: ``TRUE`` is the notice."""
    if status != 200:
        raise Malformed(f"HTTP {status}")
    word = body.strip().upper()
    if word == "TRUE":
        return "preempted"
    if word == "FALSE":
        return None
    raise Malformed(f"neither TRUE nor FALSE: {body[:80]!r}")


def parse_azure(status: int, body: str, vm_name: str) -> str | None:
    """Azure's Scheduled Events: the first ``Preempt`` event naming ``vm_name``."""
    if status != 200:
        raise Malformed(f"HTTP {status}")
    doc = _json(body)
    events = doc.get("Events") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise Malformed(f"no Events list in {body[:80]!r}")
    for event in events:
        if not isinstance(event, dict) or event.get("EventType") != "Preempt":
            continue
        resources = event.get("Resources")
        if isinstance(resources, list) and vm_name in resources:
            when = event.get("NotBefore") or "soon"
            return f"Preempt {event.get('EventId', '?')}, not before {when}"
    return None


def retry_delay(
    failures: int, *, period_s: float, jitter: float, cap_s: float = RETRY_CAP_S
) -> float:
    """Seconds to wait after ``failures`` (>= 1) errors in a row: capped exponential
    backoff (``period_s * 2**failures``, at most ``cap_s``) with equal jitter (``jitter``
    in [0, 1): between half and all of it), so that the workers of one machine, which
    failed together, do not retry together."""
    return backoff.capped(failures, base_s=period_s, cap_s=cap_s, draw=jitter)
