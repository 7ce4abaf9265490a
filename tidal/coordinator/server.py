"""The coordinator's HTTP API (FastAPI), served by uvicorn on a thread of ``tidal run``.

Every mutating call needs the job's token (``Authorization: Bearer ...``); reads do not.
The server binds 127.0.0.1 unless told otherwise, on a port the OS picks. Beside the API it
serves the read-only dashboard (``/``, ``/jobs/{name}``; ``tidal.dashboard``) and the
Prometheus exposition (``/metrics``; ``tidal.metrics``).
"""

from __future__ import annotations

import secrets
import socket
import threading

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException

from tidal.coordinator.controller import Coordinator, RequestError
from tidal.protocol import (
    API_PREFIX,
    DoneReport,
    FailureReport,
    HeartbeatRequest,
    HeartbeatResponse,
    JobStatus,
    RegisterRequest,
    RegisterResponse,
    ScaleRequest,
)


def make_app(coord: Coordinator) -> FastAPI:
    from tidal.dashboard import LiveSource, dashboard_router

    app = FastAPI(title="Tidal coordinator", version="1")
    source = LiveSource(coord)
    app.state.dashboard_source = source
    app.include_router(
        dashboard_router(source, metrics_statuses=lambda: [coord.status()], bound_host=coord.host)
    )

    def require_token(authorization: str | None = Header(default=None)) -> None:
        expected = f"Bearer {coord.token}"
        if authorization is None or not secrets.compare_digest(authorization, expected):
            raise HTTPException(status_code=401, detail="missing or wrong job token")

    auth = [Depends(require_token)]

    def call(fn, *args):
        try:
            return fn(*args)
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None

    @app.get(API_PREFIX + "/status", response_model=JobStatus)
    def status() -> JobStatus:
        return coord.status()

    @app.post(API_PREFIX + "/scale", response_model=JobStatus, dependencies=auth)
    def scale(req: ScaleRequest) -> JobStatus:
        call(coord.on_scale, req.workers)
        return coord.status()

    @app.post(API_PREFIX + "/stop", response_model=JobStatus, dependencies=auth)
    def stop() -> JobStatus:
        coord.on_stop()
        return coord.status()

    @app.post(
        API_PREFIX + "/workers/{wid}/register", response_model=RegisterResponse, dependencies=auth
    )
    def register(wid: int, req: RegisterRequest) -> RegisterResponse:
        return call(coord.on_register, wid, req)

    @app.post(
        API_PREFIX + "/workers/{wid}/heartbeat", response_model=HeartbeatResponse, dependencies=auth
    )
    def heartbeat(wid: int, req: HeartbeatRequest) -> HeartbeatResponse:
        return call(coord.on_heartbeat, wid, req)

    @app.get(
        API_PREFIX + "/workers/{wid}/role", response_model=HeartbeatResponse, dependencies=auth
    )
    def role(wid: int) -> HeartbeatResponse:
        return call(coord.on_role, wid)

    @app.post(API_PREFIX + "/workers/{wid}/failure", dependencies=auth)
    def failure(wid: int, req: FailureReport) -> dict:
        call(coord.on_failure, wid, req)
        return {}

    @app.post(API_PREFIX + "/workers/{wid}/done", dependencies=auth)
    def done(wid: int, req: DoneReport) -> dict:
        call(coord.on_done, wid, req)
        return {}

    return app


class ApiServer:
    """uvicorn on a daemon thread, listening on a socket bound before it starts (so the
    port is known, and free, before any worker is launched)."""

    def __init__(self, coord: Coordinator, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit this: without it a response written in two parts
        # waits for the client's delayed ACK (40 ms a call).
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.app = make_app(coord)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self.sock]}, name="tidal-api", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self.sock.close()
        self.app.state.dashboard_source.close()
