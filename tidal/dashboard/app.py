"""The dashboard's routes (read-only) and ``DashboardServer``, the server of ``tidal dashboard``.

Pages: ``/`` (the jobs of the home) and ``/jobs/{name}`` (one job, live charts). JSON they
poll: ``/dashboard/jobs`` and ``/dashboard/jobs/{name}?after=SEQ&steps_after=SEQ``; a
worker's log tail:
``/dashboard/jobs/{name}/logs/{worker}``. Assets:
``/dashboard/static/...``, the chart library (plotly.js) served from the installed ``plotly``
package: the pages load nothing from outside the server. ``/metrics`` is the Prometheus
exposition (``tidal.metrics``).

Nothing here mutates a job. On a loopback address nothing needs the token; on any other
every route needs the job's (``read_token``; ``tidal.access``): ``Authorization: Bearer
TOKEN``, or HTTP Basic with the token as the password, which a browser asks for (a 401 says
``WWW-Authenticate: Basic``) and then sends with each of the page's requests. Requests must
name the server by a loopback name (or the address it is bound to) in their ``Host`` header:
a web page elsewhere cannot read the dashboard through DNS rebinding.
"""

from __future__ import annotations

import gzip
import html
import importlib.resources
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from tidal import metrics as prom
from tidal.access import read_ok, reads_need_token
from tidal.coordinator.records.home import job_dir
from tidal.dashboard.logs import tail, worker_logs
from tidal.dashboard.sources import HomeSource, UnknownJob
from tidal.protocol import MAX_STEP, JobStatus, wire_float

STATIC = Path(__file__).with_name("static")
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
LOG_TAIL_BYTES = 256 * 1024
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1", "[::1]"}


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities as ``protocol.wire_float`` spells them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return wire_float(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class SafeJSONResponse(JSONResponse):
    """JSON, with a metric the script logged as NaN or infinity (JSON has no spelling for
    them) sent as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:  # a non-finite float somewhere: rare, so only then walk it all
            text = json.dumps(_finite(content), ensure_ascii=False, allow_nan=False)
            return text.encode("utf-8")


@lru_cache(maxsize=1)
def _plotly_js() -> tuple[bytes, bytes, str]:
    """plotly.min.js from the installed plotly package: (raw, gzipped, version)."""
    import plotly

    raw = (importlib.resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    return raw, gzip.compress(raw, compresslevel=6), plotly.__version__


def plotly_version() -> str:
    try:
        import plotly

        return plotly.__version__
    except ImportError:  # pragma: no cover - a declared dependency
        return "missing"


def _page(template: str, **values: str) -> str:
    text = (STATIC / template).read_text()
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", html.escape(value, quote=True))
    return text


def dashboard_router(
    source: HomeSource,
    *,
    metrics_statuses: Callable[[], Iterable[JobStatus]],
    bound_host: str = "127.0.0.1",
    read_token: str | None = None,
) -> APIRouter:
    """Routes of the dashboard over ``source``; ``/metrics`` exposes ``metrics_statuses()``.
    ``read_token``: every request must carry it (a server bound beyond loopback)."""
    allowed = LOOPBACK_NAMES | {bound_host, f"[{bound_host}]"}

    def check_host(request: Request) -> None:
        host = request.headers.get("host", "")
        name = urlsplit(f"//{host}").hostname if host else None
        if name is not None and name not in allowed and f"[{name}]" not in allowed:
            raise HTTPException(status_code=400, detail=f"unexpected Host header {host!r}")
        if read_token is not None and not read_ok(request.headers.get("authorization"), read_token):
            raise HTTPException(
                status_code=401,
                detail="missing or wrong job token",
                headers={"WWW-Authenticate": 'Basic realm="tidal", charset="UTF-8"'},
            )

    router = APIRouter(dependencies=[Depends(check_host)], include_in_schema=False)
    version = plotly_version()

    def job_or_404(name: str) -> None:
        if name not in source.job_names():
            raise HTTPException(status_code=404, detail=f"unknown job {name!r}")

    @router.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return HTMLResponse(
            _page("index.html", HOME=str(source.home), PLOTLY=version), headers=_no_store()
        )

    @router.get("/jobs/{name}", response_class=HTMLResponse)
    def job_page(name: str) -> HTMLResponse:
        if name not in source.job_names():
            return HTMLResponse(
                _page("missing.html", JOB=name, HOME=str(source.home)), status_code=404
            )
        return HTMLResponse(_page("job.html", JOB=name, PLOTLY=version), headers=_no_store())

    @router.get("/dashboard/jobs")
    def jobs() -> JSONResponse:
        return SafeJSONResponse(
            {"home": str(source.home), "now": time.time(), "jobs": source.jobs()},
            headers=_no_store(),
        )

    @router.get("/dashboard/jobs/{name}")
    def job_data(
        name: str,
        after: Annotated[int, Query(ge=0, le=MAX_STEP)] = 0,
        steps_after: Annotated[int, Query(ge=0, le=MAX_STEP)] = 0,
    ) -> JSONResponse:
        job_or_404(name)
        try:
            data = source.job_data(name, after=after, steps_after=steps_after)
        except UnknownJob:
            raise HTTPException(status_code=404, detail=f"unknown job {name!r}") from None
        return SafeJSONResponse(data, headers=_no_store())

    @router.get("/dashboard/jobs/{name}/logs/{worker}", response_class=PlainTextResponse)
    def worker_log(name: str, worker: int) -> PlainTextResponse:
        job_or_404(name)
        path = worker_logs(job_dir(source.home, name)).get(worker)
        if path is None:
            raise HTTPException(status_code=404, detail=f"no log of worker {worker}")
        return PlainTextResponse(tail(path, LOG_TAIL_BYTES), headers=_no_store())

    @router.get("/dashboard/static/plotly.min.js")
    def plotly_js(request: Request) -> Response:
        raw, packed, _ = _plotly_js()
        headers = {"Cache-Control": "public, max-age=86400", "Vary": "Accept-Encoding"}
        if "gzip" in request.headers.get("accept-encoding", ""):
            headers["Content-Encoding"] = "gzip"
            return Response(packed, media_type="text/javascript", headers=headers)
        return Response(raw, media_type="text/javascript", headers=headers)

    @router.get("/dashboard/static/{asset}")
    def asset(asset: str) -> Response:
        if asset not in ASSETS:
            raise HTTPException(status_code=404)
        return Response((STATIC / asset).read_bytes(), media_type=ASSETS[asset])

    @router.get("/metrics")
    def metrics() -> Response:
        return Response(prom.render(metrics_statuses), media_type=prom.CONTENT_TYPE_LATEST)

    return router


def _no_store() -> dict[str, str]:
    return {"Cache-Control": "no-store"}


def make_home_app(
    source: HomeSource, *, bound_host: str = "127.0.0.1", read_token: str | None = None
) -> FastAPI:
    """The app of ``tidal dashboard``: every job of a home, read-only, from SQLite."""
    app = FastAPI(title="Tidal dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(
        dashboard_router(
            source, metrics_statuses=source.statuses, bound_host=bound_host, read_token=read_token
        )
    )
    return app


class DashboardServer:
    """``tidal dashboard``: uvicorn serving a home's jobs on ``host:port`` (0: a free port).

    ``start()``/``stop()`` run it on a thread (tests); ``serve()`` blocks until SIGINT or
    SIGTERM (the CLI). Beyond loopback it needs a ``token`` that every request must carry."""

    def __init__(
        self, home: Path, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None
    ) -> None:
        if reads_need_token(host) and not token:
            raise ValueError(f"serving on {host} (not a loopback address) needs a token")
        self.source = HomeSource(home)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            self.source.close()
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        self.sock.listen(128)  # connections wait in the backlog until uvicorn serves them
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(
            make_home_app(self.source, bound_host=host, read_token=token if token else None),
            log_level="warning",
            access_log=False,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def job_url(self, name: str) -> str:
        from urllib.parse import quote

        return f"{self.url}/jobs/{quote(name, safe='')}"

    def serve(self) -> None:
        try:
            self._server.run(sockets=[self.sock])
        finally:
            self.close()

    def start(self, timeout: float = 30) -> None:
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self.sock]},
            name="tidal-dashboard",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError("the dashboard server exited at start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.close()

    def close(self) -> None:
        self.sock.close()
        self.source.close()
