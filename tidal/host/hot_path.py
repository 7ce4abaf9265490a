"""The heartbeat's hot path: an ASGI layer in front of the FastAPI app.

Every worker heartbeats every interval, and FastAPI's per-request machinery (middleware,
routing, dependency solving, body validation through its own layer, the response model)
costs more than the coordinator's handling of a heartbeat (docs/benchmarks.md, "Control
plane capacity"). This layer answers the worker's heartbeats and role reads itself: a
``POST /api/v1/workers/ID/heartbeat`` with that worker's credential and a body that parses
as a ``HeartbeatRequest``, and a ``GET /api/v1/workers/ID/role`` with it. A heartbeat that
``Coordinator.heartbeat_is_quick`` accepts, and a role read, are answered on the event loop
from the coordinator's published answers (no lock); any other heartbeat (one carrying a
fact to apply first, a hold) on a thread, as the FastAPI endpoint would run it: those come
at every scheduled change, from every member, while the cores are busiest (~1 ms of the
coordinator's CPU each through FastAPI's stack, measured on the rescale bench).

Everything else goes to the FastAPI app unchanged, the request body replayed: a missing or
wrong credential (401), a body that does not validate (422 naming the field, and the
``refused`` event), any other route. So FastAPI remains the one definition of the API's
answers; this layer only answers, faster, the requests whose answer it would give the same
way (tested in ``tests/test_heartbeat_path.py``; the API fuzzing runs through it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio.to_thread
from pydantic import ValidationError

from tidal.access import bearer_ok
from tidal.coordinator.control.controller import Coordinator
from tidal.coordinator.control.effects import RequestError, ReRegister
from tidal.protocol import API_PREFIX, MAX_ID, HeartbeatRequest, worker_token

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_WORKER_CALL = re.compile(re.escape(API_PREFIX) + r"/workers/(\d{1,10})/(heartbeat|role)")
#: Bodies larger than this go to FastAPI (a heartbeat is a few KB; its limits are there).
MAX_BODY = 1 << 20
_JSON = [(b"content-type", b"application/json")]


class HeartbeatHotPath:
    def __init__(self, app: App, coord: Coordinator) -> None:
        self.app, self.coord = app, coord

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = _WORKER_CALL.fullmatch(scope.get("path", "")) if scope["type"] == "http" else None
        if m is None or scope["method"] != _METHOD[m[2]] or not self._authorized(scope, m[1]):
            return await self.app(scope, receive, send)
        wid = int(m[1])
        if m[2] == "role":
            return await self._answer(send, self.coord.on_role, wid)
        body, more = await _read(receive)
        req = None if more else _parse(body)
        if req is None:  # FastAPI answers it (see the module doc)
            return await self.app(scope, _replay(body, more, receive), send)
        if self.coord.heartbeat_is_quick(req):
            return await self._answer(send, self.coord.on_heartbeat, wid, req)
        # Applied under the coordinator's lock, a hold answered once settled: on a thread.
        return await self._answer(send, self.coord.on_heartbeat, wid, req, thread=True)

    def _authorized(self, scope: Scope, digits: str) -> bool:
        wid = int(digits)
        if wid > MAX_ID:
            return False
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        token = worker_token(self.coord.token, wid)
        return auth is not None and bearer_ok(auth.decode("latin-1"), token)

    async def _answer(
        self, send: Send, call: Callable[..., bytes], *args: Any, thread: bool = False
    ) -> None:
        """Send ``call(*args)``'s answer, run on anyio's worker threads if ``thread`` (as
        FastAPI runs a sync endpoint), with the statuses the FastAPI endpoint gives."""
        try:
            if thread:
                body = await anyio.to_thread.run_sync(call, *args)
            else:
                body = call(*args)
            status = 200
        except RequestError as exc:  # as FastAPI's endpoint answers them (``server.call``)
            status, body = 400, json.dumps({"detail": str(exc)}).encode()
        except ReRegister as exc:
            status, body = 409, json.dumps({"detail": str(exc)}).encode()
        headers = [*_JSON, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


_METHOD = {"heartbeat": "POST", "role": "GET"}


def _parse(body: bytes) -> HeartbeatRequest | None:
    try:
        return HeartbeatRequest.model_validate_json(body)
    except ValidationError:  # FastAPI answers it: 422 naming the field, and the event
        return None


async def _read(receive: Receive) -> tuple[bytes, bool]:
    """The request's body, up to ``MAX_BODY``; True as the second value if it is longer
    (or the client went away): then the rest is left to the app."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), True
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if not message.get("more_body", False):
            return b"".join(chunks), False
        if size > MAX_BODY:
            return b"".join(chunks), True


def _replay(body: bytes, more: bool, receive: Receive) -> Receive:
    """A ``receive`` that hands the app what was read, then the rest from the client."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replay
