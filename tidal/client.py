"""HTTP client of the coordinator's API, used by workers and by the CLI.

It imports the wire messages only, never the server, so a worker process does not pull in
FastAPI or uvicorn.
"""

from __future__ import annotations

import socket

import httpx

from tidal.hosts_protocol import HostJoined, HostOrders, HostPoll, HostRegister
from tidal.protocol import (
    API_PREFIX,
    DoneReport,
    FailureReport,
    GenerationInfo,
    HeartbeatRequest,
    HeartbeatResponse,
    JobStatus,
    RegisterRequest,
    RegisterResponse,
    ScaleRequest,
    StopAnswer,
    StopReport,
)


class CoordinatorError(RuntimeError):
    """The coordinator answered with an error; ``str()`` is its one-line message, ``status``
    the HTTP status (4xx: it refused the request, which sent again is refused again)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def _detail(detail: object) -> str:
    """One line from an error answer; a 422's list of field errors as ``field: why; ...``."""
    if isinstance(detail, list):
        parts = []
        for e in detail:
            if isinstance(e, dict):
                loc = ".".join(str(p) for p in e.get("loc", ())[1:])
                parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
            else:
                parts.append(str(e))
        return "; ".join(parts)
    return str(detail)


class CoordinatorClient:
    """One keep-alive connection to a job's coordinator.

    A coordinator serves plain HTTP (``coordinator.supervisor``; the job's token
    authenticates), so a client of an ``http://`` URL asks httpx for no verification, and
    its unused TLS context loads no CA bundle: that took 20 to 130 ms per client, and a
    worker makes three, one of them on its first failure's path. An ``https://`` URL (a
    proxy in front of the coordinator) keeps httpx's verified default."""

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 10.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        transport = httpx.HTTPTransport(
            verify=not self.url.startswith("http://"),
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],  # no 40 ms stalls
        )
        self._http = httpx.Client(
            base_url=self.url + API_PREFIX,
            headers=headers,
            timeout=timeout_s,
            trust_env=False,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def _call(
        self, method: str, path: str, body: object | None = None, timeout_s: float | None = None
    ) -> dict:
        payload = body.model_dump(mode="json") if body is not None else None
        extra = {} if timeout_s is None else {"timeout": timeout_s}
        resp = self._http.request(method, path, json=payload, **extra)
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise CoordinatorError(_detail(detail), resp.status_code)
        return resp.json()

    # -- worker calls ---------------------------------------------------------------
    def register(self, worker_id: int, req: RegisterRequest) -> RegisterResponse:
        return RegisterResponse.model_validate(
            self._call("POST", f"/workers/{worker_id}/register", req)
        )

    def heartbeat(self, worker_id: int, req: HeartbeatRequest) -> HeartbeatResponse:
        return HeartbeatResponse.model_validate(
            self._call("POST", f"/workers/{worker_id}/heartbeat", req)
        )

    def generation(self, worker_id: int) -> HeartbeatResponse:
        """The worker's role and the newest generation, without reporting anything."""
        return HeartbeatResponse.model_validate(self._call("GET", f"/workers/{worker_id}/role"))

    def report_failure(self, worker_id: int, req: FailureReport) -> None:
        self._call("POST", f"/workers/{worker_id}/failure", req)

    def report_done(self, worker_id: int, req: DoneReport) -> None:
        self._call("POST", f"/workers/{worker_id}/done", req)

    def report_stop(self, worker_id: int, req: StopReport) -> StopAnswer:
        """This member's script ended the job early (``StopReport``); the answer says where
        the job stops and whether this worker writes the final checkpoint."""
        return StopAnswer.model_validate(self._call("POST", f"/workers/{worker_id}/stop", req))

    # -- host agents' calls (``tidal worker --join``; the client holds the hosts' token) ---
    def register_host(self, req: HostRegister) -> HostJoined:
        return HostJoined.model_validate(self._call("POST", "/hosts/register", req))

    def poll_host(self, host_id: int, req: HostPoll) -> HostOrders:
        """The host's orders; held up to ``req.wait_s`` by the coordinator (a long poll)."""
        path = f"/hosts/{host_id}/poll"
        return HostOrders.model_validate(self._call("POST", path, req, req.wait_s + 10.0))

    # -- CLI calls ------------------------------------------------------------------
    def status(self) -> JobStatus:
        return JobStatus.model_validate(self._call("GET", "/status"))

    def scale(self, workers: int) -> JobStatus:
        return JobStatus.model_validate(self._call("POST", "/scale", ScaleRequest(workers=workers)))

    def stop(self) -> JobStatus:
        return JobStatus.model_validate(self._call("POST", "/stop"))


__all__ = ["CoordinatorClient", "CoordinatorError", "GenerationInfo"]
