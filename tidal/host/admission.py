"""Who may send the coordinator a request, decided from its request line and headers alone,
before a byte of its body is read (issue 50, finding 6).

FastAPI reads and parses a request's body before it runs a route's dependencies, so a
token checked by a dependency is checked after the body: a 100 MB ``[{},...]`` sent with no
token to ``/scale`` froze the coordinator for 17 s and took 2.7 GB before its 401. Here:

- ``admit`` (pure): the credential a request needs, from its method and path, checked
  against its ``Authorization`` header; the ``Host`` header of a read served on loopback
  (DNS rebinding: a web page elsewhere must not read the job through the browser); and the
  most body bytes the request may send, refused at once when its ``Content-Length`` says
  more. The credentials are the ones the routes' dependencies check (``tidal.host.server``),
  which stay as a second check: a worker's call (``/workers/ID/...``) needs that worker's
  own credential (``protocol.worker_token``); a host agent's (``/hosts/...``) the hosts'
  credential (``hosts_protocol.host_token``); any other mutating call of the API the job's
  token as a bearer (one elsewhere, on the dashboard's read-only pages, is FastAPI's 405 or
  404, which reads no body); a read nothing on a loopback bind, the job's token (bearer or HTTP Basic) on any
  other (``tidal.access``). A path under ``/workers/`` that names no worker goes on to
  FastAPI, which refuses the path (422), with the small body limit.
- ``RequestGuard`` (pure ASGI middleware, the "do"): answers a refusal as one JSON line
  (``{"detail": "..."}``) without reading the body, else passes the request on under
  Starlette's ``RequestBodyLimitMiddleware`` with the verdict's limit, which counts the bytes
  of a body sent without a ``Content-Length`` (chunked) as the app reads them and answers 413
  past the limit.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tidal.access import bearer_ok, read_ok
from tidal.hosts_protocol import HOSTS_PATH, host_token
from tidal.protocol import API_PREFIX, MAX_ID, worker_token

#: A worker's call: a heartbeat carries at most ``protocol.MAX_STEP_RECORDS`` per-step metric
#: records, a few KB each in practice.
WORKER_BODY_LIMIT = 16 << 20
#: A host agent's call: a registration or a poll lists at most ``hosts_protocol.MAX_SLOTS``
#: workers and exits, ~100 bytes each.
HOST_BODY_LIMIT = 4 << 20
#: Every other request: ``/scale``'s body is ``{"workers": N}``; reads have none.
BODY_LIMIT = 64 << 10
READS = frozenset({"GET", "HEAD"})
WORKER_CALL = re.compile(re.escape(API_PREFIX) + r"/workers/(\d{1,10})/")
BASIC_CHALLENGE = {"WWW-Authenticate": 'Basic realm="tidal", charset="UTF-8"'}


@dataclass(frozen=True)
class Verdict:
    """``status`` None: let the request through, its body up to ``body_limit`` bytes; else
    refuse it with ``status`` and ``detail`` (and ``headers``)."""

    status: int | None = None
    detail: str = ""
    body_limit: int = BODY_LIMIT
    headers: tuple[tuple[str, str], ...] = ()


def host_allowed(host: str | None, allowed: Collection[str]) -> bool:
    """Whether a ``Host`` header names the server by one of ``allowed`` (none sent: HTTP/1.0,
    allowed)."""
    if not host:
        return True
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:
        return False
    return name is not None and (name in allowed or f"[{name}]" in allowed)


def admit(
    method: str,
    path: str,
    *,
    authorization: str | None,
    host: str | None,
    content_length: str | None,
    token: str,
    guarded: bool,
    allowed_hosts: Collection[str],
) -> Verdict:
    """The verdict on a request (see the module doc). ``guarded``: the server binds beyond
    loopback (every read needs the token); ``allowed_hosts``: the names a read on loopback
    may give in ``Host``."""
    verdict = Verdict()
    m = WORKER_CALL.match(path)
    if m and int(m[1]) <= MAX_ID:
        wid = int(m[1])
        if not bearer_ok(authorization, worker_token(token, wid)):
            return Verdict(401, f"missing or wrong token of worker {wid}")
        verdict = Verdict(body_limit=WORKER_BODY_LIMIT)
    elif path.startswith(API_PREFIX + "/workers/"):
        pass  # names no worker: FastAPI refuses the path (422)
    elif path.startswith(HOSTS_PATH + "/"):
        if not bearer_ok(authorization, host_token(token)):
            return Verdict(401, "missing or wrong hosts' token")
        verdict = Verdict(body_limit=HOST_BODY_LIMIT)
    elif method.upper() not in READS:
        if path.startswith(API_PREFIX + "/") and not bearer_ok(authorization, token):
            return Verdict(401, "missing or wrong job token")
        # elsewhere (the dashboard's pages): FastAPI answers 405 or 404, reading no body
    elif guarded:
        if not read_ok(authorization, token):
            return Verdict(
                401, "missing or wrong job token", headers=tuple(BASIC_CHALLENGE.items())
            )
    elif not host_allowed(host, allowed_hosts):
        return Verdict(400, f"unexpected Host header {host!r}")
    if content_length is not None:
        try:
            length = int(content_length)
        except ValueError:
            return Verdict(400, "malformed Content-Length")
        if length > verdict.body_limit:
            return Verdict(413, f"body of {length} bytes; at most {verdict.body_limit} here")
    return verdict


class RequestGuard:
    """ASGI middleware applying ``admit`` to every HTTP request (see the module doc)."""

    def __init__(
        self, app: ASGIApp, *, token: str, guarded: bool, allowed_hosts: Collection[str]
    ) -> None:
        self.app = app
        self.token, self.guarded, self.allowed_hosts = token, guarded, frozenset(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        verdict = admit(
            scope["method"],
            scope["path"],
            authorization=headers.get("authorization"),
            host=headers.get("host"),
            content_length=headers.get("content-length"),
            token=self.token,
            guarded=self.guarded,
            allowed_hosts=self.allowed_hosts,
        )
        if verdict.status is not None:
            refusal = JSONResponse(
                {"detail": verdict.detail},
                status_code=verdict.status,
                headers=dict(verdict.headers),
            )
            return await refusal(scope, receive, send)
        await RequestBodyLimitMiddleware(self.app, verdict.body_limit)(scope, receive, send)
