"""Reads need the job's token once the coordinator binds anything but loopback (issue 15).

The decision (``access.reads_need_token``) as a table; then real servers: a coordinator bound
to this machine's non-loopback address answers no read without the token (``/status``,
``/metrics``, the dashboard, the schema) and every read with it, while the same coordinator
on 127.0.0.1 stays open; ``tidal status`` reads either through the token of the job's
``coordinator.json``.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tidal.access import is_loopback, read_ok, reads_need_token
from tidal.cli import main as cli_main
from tidal.config import JobSpec
from tidal.coordinator.control.controller import Coordinator
from tidal.dashboard import DashboardServer
from tidal.host.server import ApiServer
from tidal.protocol import API_PREFIX, worker_token

READS = [
    API_PREFIX + "/status",
    "/metrics",
    "/",
    "/jobs/served",
    "/dashboard/jobs",
    "/dashboard/jobs/served",
    "/dashboard/static/dashboard.js",
    "/openapi.json",
]


@pytest.mark.parametrize(
    "host, guarded",
    [
        ("127.0.0.1", False),
        ("127.3.2.1", False),  # all of 127.0.0.0/8 is loopback
        ("localhost", False),
        ("LOCALHOST.", False),
        ("::1", False),
        ("[::1]", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped loopback
        ("0.0.0.0", True),  # every interface
        ("::", True),
        ("", True),  # socket.bind's "" is every interface too
        ("192.0.2.7", True),  # a cluster address (the Ray backend's node IP)
        ("10.0.0.5", True),
        ("fe80::1", True),
        ("::ffff:10.0.0.5", True),
        ("node-3.cluster", True),  # a name may resolve to any interface
        ("127.0.0.1.example.com", True),
    ],
)
def test_reads_need_the_token_on_any_bind_but_loopback(host, guarded):
    assert reads_need_token(host) is guarded
    assert is_loopback(host) is not guarded


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize(
    "authorization, ok",
    [
        ("Bearer tok", True),
        (basic("", "tok"), True),  # a browser's prompt: any user, the token as password
        (basic("me", "tok"), True),
        ("basic " + base64.b64encode(b"me:tok").decode(), True),
        (None, False),
        ("", False),
        ("Bearer tok2", False),
        ("Bearer  tok", False),
        ("tok", False),
        (basic("tok", ""), False),  # the token as the user name is not the password
        (basic("me", "tok2"), False),
        ("Basic " + base64.b64encode(b"tok").decode(), False),  # no colon
        ("Basic !!!", False),
        ("Basic " + base64.b64encode(b"me:\xff").decode(), False),
        ("Bearer \xe9", False),  # non-ASCII: refused, not a TypeError
    ],
)
def test_read_credentials(authorization, ok):
    assert read_ok(authorization, "tok") is ok


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine other than loopback, or None."""
    found = []
    try:
        found.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # a UDP "connect" sends nothing: it picks the interface of the route
            s.connect(("192.0.2.1", 9))
            found.append(s.getsockname()[0])
        except OSError:
            pass
    for ip in found:
        if is_loopback(ip) or ip == "0.0.0.0":
            continue
        with socket.socket() as probe:
            try:
                probe.bind((ip, 0))
            except OSError:
                continue
        return ip
    return None


@pytest.fixture
def serve(tmp_path) -> Iterator:
    """``serve(host)``: a real coordinator bound to ``host`` and its HTTP server."""
    started: list[tuple[ApiServer, Coordinator]] = []

    def start(host: str) -> tuple[Coordinator, str]:
        spec = JobSpec(name="served", script=str(tmp_path / "x.py"), workers=1, max_workers=2)
        coord = Coordinator(spec, tmp_path, host=host)
        server = ApiServer(coord, host=host)
        started.append((server, coord))
        coord.url = server.url
        coord.flush()  # as the loop's first pass would: the status names the URL
        server.start()
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return coord, server.url

    yield start
    for server, coord in started:
        server.stop()
        coord.close()


@pytest.fixture
def cluster_ip() -> str:
    ip = non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no IPv4 address other than loopback to bind")
    return ip


def test_beyond_loopback_every_read_needs_the_job_token(serve, cluster_ip):
    coord, url = serve(cluster_ip)
    assert url.startswith(f"http://{cluster_ip}:")
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as client:
        for path in READS:
            for auth in [None, "Bearer nope", basic("x", "nope"), f"Bearer {coord.token}x"]:
                headers = {"Authorization": auth} if auth else {}
                resp = client.get(path, headers=headers)
                assert resp.status_code == 401, (path, auth, resp.status_code)
                assert "served" not in resp.text and "target_workers" not in resp.text
            worker = {"Authorization": f"Bearer {worker_token(coord.token, 0)}"}
            assert client.get(path, headers=worker).status_code == 401, path  # not a worker's
            for auth in [f"Bearer {coord.token}", basic("", coord.token)]:
                resp = client.get(path, headers={"Authorization": auth})
                assert resp.status_code == 200, (path, auth, resp.text[:200])
        # a browser is asked for the token (Basic) on the dashboard's pages
        assert client.get("/").headers["www-authenticate"].startswith("Basic")
        assert client.get(API_PREFIX + "/status").json()["detail"] == "missing or wrong job token"
        status = client.get(
            API_PREFIX + "/status", headers={"Authorization": f"Bearer {coord.token}"}
        )
        assert status.json()["name"] == "served"
        metrics = client.get("/metrics", headers={"Authorization": f"Bearer {coord.token}"})
        assert 'job="served"' in metrics.text
        # mutations take only the Bearer token: a browser's cached Basic could be forged
        scale = client.post(
            API_PREFIX + "/scale",
            json={"workers": 2},
            headers={"Authorization": basic("", coord.token)},
        )
        assert scale.status_code == 401 and coord.job.target == 1
        scale = client.post(
            API_PREFIX + "/scale",
            json={"workers": 2},
            headers={"Authorization": f"Bearer {coord.token}"},
        )
        assert scale.status_code == 200 and coord.job.target == 2


def test_on_loopback_reads_stay_open(serve):
    coord, url = serve("127.0.0.1")
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as client:
        for path in READS:
            assert client.get(path).status_code == 200, path
        assert client.post(API_PREFIX + "/scale", json={"workers": 2}).status_code == 401


@pytest.mark.parametrize("where", ["loopback", "cluster"])
def test_tidal_status_reads_with_the_token_of_the_coordinator_file(serve, where, capsys, tmp_path):
    host = "127.0.0.1" if where == "loopback" else non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no IPv4 address other than loopback to bind")
    coord, url = serve(host)
    coord.jobdir.write_coordinator(url=url, token=coord.token, pid=1)
    assert cli_main(["status", "served", "--json", "--home", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    # the live coordinator answered (from SQLite alone, with no lock held, it would say
    # interrupted)
    assert printed["state"] == "pending" and printed["url"] == url


def test_the_home_dashboard_beyond_loopback_needs_a_token(serve, cluster_ip, tmp_path):
    with pytest.raises(ValueError, match="needs a token"):
        DashboardServer(tmp_path, host="0.0.0.0")
    serve("127.0.0.1")  # a job in the home
    server = DashboardServer(tmp_path, host=cluster_ip, token="secret")
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=10, trust_env=False) as client:
            for path in ["/", "/dashboard/jobs", "/metrics"]:
                assert client.get(path).status_code == 401, path
                ok = client.get(path, headers={"Authorization": basic("", "secret")})
                assert ok.status_code == 200, path
            jobs = client.get("/dashboard/jobs", headers={"Authorization": "Bearer secret"})
            assert [j["name"] for j in jobs.json()["jobs"]] == ["served"]
    finally:
        server.stop()
