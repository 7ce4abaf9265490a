"""The coordinator's HTTP API (FastAPI), served by uvicorn on a thread of ``tidal run``.

Every mutating call needs a token (``Authorization: Bearer ...``): ``/scale`` and ``/stop``
the job's token; ``/workers/ID/...`` only that worker's own credential
(``protocol.worker_token``); ``/hosts/...`` (the agents of joined hosts: ``register`` and the
long ``poll``, ``tidal.hosts_protocol``) the hosts' credential (``hosts_protocol.host_token``).
Reads (``/status``, ``/metrics``, the dashboard, the OpenAPI
schema) are open on a loopback address and need the job's token on any other
(``tidal.access``). These credentials, the ``Host`` of a read on loopback, and a limit on the
body's size are checked from the request's headers before any body is read
(``tidal.host.admission``); the routes' dependencies check the credentials again. Whatever a
client sends that the wire messages refuse is a 422
that names the field, never a 500 (a value JSON cannot spell back, like NaN, included).
The server binds 127.0.0.1 unless told otherwise, on a port the OS picks. Beside the API it
serves the read-only dashboard (``/``, ``/jobs/{name}``; ``tidal.dashboard``) and the
Prometheus exposition (``/metrics``; ``tidal.metrics``).
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from concurrent.futures import Future
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from tidal.access import bearer_ok, read_ok, reads_need_token
from tidal.backends.host_registry import HostRegistry, UnknownHost
from tidal.coordinator.control.controller import Coordinator
from tidal.coordinator.control.effects import RequestError, ReRegister
from tidal.coordinator.process.supervisor import listen, url_of
from tidal.host.admission import RequestGuard
from tidal.host.hot_path import HeartbeatHotPath
from tidal.hosts_protocol import (
    HOSTS_PATH,
    HostJoined,
    HostOrders,
    HostPoll,
    HostRegister,
    host_token,
)
from tidal.protocol import (
    API_PREFIX,
    MAX_ID,
    DoneReport,
    FailureReport,
    HeartbeatRequest,
    HeartbeatResponse,
    JobStatus,
    RegisterRequest,
    RegisterResponse,
    ScaleRequest,
    StopAnswer,
    StopReport,
    worker_token,
)

_WORKER_PATH = re.compile(re.escape(API_PREFIX) + r"/workers/(\d{1,10})/")
WorkerId = Annotated[int, Path(ge=0, le=MAX_ID)]


def validation_errors(exc: RequestValidationError) -> list[dict]:
    """The errors of a refused request without the values that caused them: a NaN or an
    infinity there would make the answer itself unencodable (a 500 instead of a 422)."""
    return [
        {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg")), "type": e.get("type")}
        for e in exc.errors()
    ]


async def held(waiter: Future, request: Request, wait_s: float) -> bool:
    """Wait until ``waiter`` completes or ``wait_s`` passes, on the event loop (no thread
    held: an agent's long poll costs nothing while it waits); True if the client's
    connection closed meanwhile (its agent died: ``HostRegistry.cut``)."""
    news = asyncio.wrap_future(waiter)
    gone = asyncio.ensure_future(request.receive())  # the body is read: only a disconnect
    try:
        done, _ = await asyncio.wait(
            {news, gone}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for task in (news, gone):
            if not task.done():
                task.cancel()
    if gone not in done:
        return False
    try:
        return gone.result().get("type") == "http.disconnect"
    except Exception:  # noqa: BLE001 - the connection failed under the read: it is gone
        return True


def make_app(coord: Coordinator, host: str | None = None) -> FastAPI:
    """The API of ``coord`` for a server bound to ``host`` (default: ``coord.host``), which
    decides whether reads need the job's token (``access.reads_need_token``)."""
    from tidal.dashboard import LiveSource, dashboard_router
    from tidal.dashboard.app import LOOPBACK_NAMES

    bound = coord.host if host is None else host
    guarded = reads_need_token(bound)
    # Guarded, the schema is served by a route that asks the token (FastAPI's own cannot).
    app = FastAPI(
        title="Tidal coordinator", version="1", openapi_url=None if guarded else "/openapi.json"
    )
    # Before any body is read: the credential, the Host of a read, the body's size.
    app.add_middleware(
        RequestGuard,
        token=coord.token,
        guarded=guarded,
        allowed_hosts=LOOPBACK_NAMES | {bound, f"[{bound}]"},
    )
    source = LiveSource(coord)
    app.state.dashboard_source = source
    app.include_router(
        dashboard_router(
            source,
            metrics_statuses=lambda: [coord.status()],
            bound_host=bound,
            read_token=coord.token if guarded else None,
        )
    )

    def require_token(authorization: str | None = Header(default=None)) -> None:
        if not bearer_ok(authorization, coord.token):
            raise HTTPException(status_code=401, detail="missing or wrong job token")

    def require_read(authorization: str | None = Header(default=None)) -> None:
        if guarded and not read_ok(authorization, coord.token):
            raise HTTPException(status_code=401, detail="missing or wrong job token")

    def worker_authorized(wid: int, authorization: str | None) -> bool:
        return bearer_ok(authorization, worker_token(coord.token, wid))

    async def require_worker(
        wid: WorkerId, authorization: str | None = Header(default=None)
    ) -> None:  # async: checked on the event loop, no thread-pool hop (it never blocks)
        if not worker_authorized(wid, authorization):
            raise HTTPException(status_code=401, detail=f"missing or wrong token of worker {wid}")

    def require_host(authorization: str | None = Header(default=None)) -> None:
        if not bearer_ok(authorization, host_token(coord.token)):
            raise HTTPException(status_code=401, detail="missing or wrong hosts' token")

    def hosts() -> HostRegistry:
        registry = coord.hosts
        if registry is None:
            raise HTTPException(
                status_code=409,
                detail=f"job {coord.spec.name} takes no hosts: it was started without --listen",
            )
        return registry

    auth = [Depends(require_token)]
    host_auth = [Depends(require_host)]
    read_auth = [Depends(require_read)] if guarded else []
    worker_auth = [Depends(require_worker)]
    refused: dict[int, str] = {}  # the last refusal recorded as an event, per worker

    @app.exception_handler(RequestValidationError)
    def refuse(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = validation_errors(exc)
        m = _WORKER_PATH.match(request.url.path)
        if m and worker_authorized(int(m[1]), request.headers.get("authorization")):
            wid = int(m[1])  # a worker of this job sent it: say why in the job's events
            first = errors[0] if errors else {"loc": [], "msg": "invalid"}
            line = f"{'.'.join(first['loc'][1:]) or 'body'}: {first['msg']}"
            if refused.get(wid) != line:
                refused[wid] = line
                coord.on_refused(
                    wid,
                    f"worker {wid}: {request.url.path.rsplit('/', 1)[-1]} refused "
                    f"({len(errors)} invalid values): {line}"[:500],
                )
        return JSONResponse(status_code=422, content={"detail": errors})

    def call(fn, *args):
        try:
            return fn(*args)
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        except ReRegister as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None

    if guarded:

        @app.get("/openapi.json", include_in_schema=False, dependencies=read_auth)
        def openapi() -> dict:
            return app.openapi()

    @app.get(API_PREFIX + "/status", response_model=JobStatus, dependencies=read_auth)
    def status() -> JobStatus:
        return coord.status()

    @app.post(API_PREFIX + "/scale", response_model=JobStatus, dependencies=auth)
    def scale(req: ScaleRequest) -> JobStatus:
        call(coord.on_scale, req.workers)
        return coord.status(fresh=True)

    @app.post(API_PREFIX + "/stop", response_model=JobStatus, dependencies=auth)
    def stop() -> JobStatus:
        coord.on_stop()
        return coord.status(fresh=True)

    @app.post(
        API_PREFIX + "/workers/{wid}/register",
        response_model=RegisterResponse,
        dependencies=worker_auth,
    )
    def register(wid: int, req: RegisterRequest) -> RegisterResponse:
        return call(coord.on_register, wid, req)

    @app.post(
        API_PREFIX + "/workers/{wid}/heartbeat",
        response_model=HeartbeatResponse,
        dependencies=worker_auth,
    )
    async def heartbeat(wid: int, req: HeartbeatRequest) -> Response:
        # The hot path: answered on the event loop from bytes (``coordinator.answers``);
        # a heartbeat that must be applied under the coordinator's lock goes to a thread.
        if coord.heartbeat_is_quick(req):
            body = call(coord.on_heartbeat, wid, req)
        else:
            body = await run_in_threadpool(call, coord.on_heartbeat, wid, req)
        return Response(content=body, media_type="application/json")

    @app.get(
        API_PREFIX + "/workers/{wid}/role",
        response_model=HeartbeatResponse,
        dependencies=worker_auth,
    )
    async def role(wid: int) -> Response:
        return Response(content=call(coord.on_role, wid), media_type="application/json")

    @app.post(API_PREFIX + "/workers/{wid}/failure", dependencies=worker_auth)
    def failure(wid: int, req: FailureReport) -> dict:
        call(coord.on_failure, wid, req)
        return {}

    @app.post(API_PREFIX + "/workers/{wid}/done", dependencies=worker_auth)
    def done(wid: int, req: DoneReport) -> dict:
        call(coord.on_done, wid, req)
        return {}

    @app.post(
        API_PREFIX + "/workers/{wid}/stop", response_model=StopAnswer, dependencies=worker_auth
    )
    def stop_by_script(wid: int, req: StopReport) -> StopAnswer:
        return call(coord.on_script_stop, wid, req)

    @app.post(HOSTS_PATH + "/register", response_model=HostJoined, dependencies=host_auth)
    def host_register(req: HostRegister, request: Request) -> HostJoined:
        return hosts().register(req, peer=request.client.host if request.client else "")

    @app.post(HOSTS_PATH + "/{hid}/poll", response_model=HostOrders, dependencies=host_auth)
    async def host_poll(
        hid: Annotated[int, Path(ge=1, le=MAX_ID)], req: HostPoll, request: Request
    ) -> HostOrders:
        registry = hosts()
        try:
            orders = registry.poll(hid, req)
            waiter = registry.waiter(hid, req.version) if req.wait_s > 0 else None
            if waiter is not None:  # no news for it yet: hold the answer
                hold_s = min(req.wait_s, registry.joined.lost_after_s / 4)
                if await held(waiter, request, hold_s):
                    registry.cut(hid)
                orders = registry.orders(hid)
        except UnknownHost as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
        return orders

    return app


class ApiServer:
    """uvicorn on a daemon thread, listening on a socket bound before it starts (so the
    port is known, and free, before any worker is launched)."""

    def __init__(
        self, coord: Coordinator, host: str = "127.0.0.1", sock: socket.socket | None = None
    ) -> None:
        """``sock``: a listening socket to serve (the supervisor's, so that a restarted
        coordinator serves the same URL); default: one bound on ``host``, a port the OS
        picks."""
        self.sock = sock if sock is not None else listen(host)
        self.url = url_of(self.sock)
        self.coord = coord
        self.app = make_app(coord)
        served = HeartbeatHotPath(self.app, coord)  # the hot path in front of FastAPI
        config = uvicorn.Config(served, log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self.sock]}, name="tidal-api", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        """True once the server accepts requests."""
        return self._server.started

    def stop(self) -> None:
        if self.coord.hosts is not None:  # answer the agents' held polls: nothing waits on them
            self.coord.hosts.close()
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self.sock.close()
        self.app.state.dashboard_source.close()
