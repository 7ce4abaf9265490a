"""The dashboard: pages, JSON and assets served by the coordinator (in-process, no worker)
and by ``tidal dashboard`` (SQLite), the chart history, and one real job watched in headless
Chromium (Debian's ``chromium`` driven by Playwright) before and after its coordinator exits.
Screenshots land in ``test-artifacts/``."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from e2e_helpers import ROOT, Home, summarize
from prometheus_client.parser import text_string_to_metric_families

from tidal.config import JobSpec
from tidal.coordinator.control.controller import Coordinator
from tidal.coordinator.records.db import Database
from tidal.coordinator.records.home import db_path, job_dir
from tidal.coordinator.records.records import WorkerRecord
from tidal.dashboard import DashboardServer, HistoryStore, Recorder
from tidal.dashboard import history as history_mod
from tidal.host.server import ApiServer
from tidal.protocol import API_PREFIX, EventView, GenerationView, WorkerState

ARTIFACTS = ROOT / "test-artifacts"
BIG = "100000"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _wait_started(server) -> None:
    for _ in range(500):
        if server.started:
            return
        time.sleep(0.01)
    raise AssertionError("server did not start")


@pytest.fixture
def served(tmp_path):
    spec = JobSpec(name="dash-test", script=str(tmp_path / "x.py"), workers=1, max_workers=2)
    coord = Coordinator(spec, tmp_path)  # never ticks: no worker is started
    server = ApiServer(coord)
    coord.url = server.url
    coord.flush()  # as the loop's first pass would: the status names the URL
    server.start()
    _wait_started(server)
    yield coord, server
    server.stop()
    coord.close()


# -- served by the coordinator --------------------------------------------------------------
def test_pages_and_chart_library_come_from_the_server_itself(served) -> None:
    _, server = served
    url = server.url
    index = httpx.get(url + "/")
    assert index.status_code == 200 and "text/html" in index.headers["content-type"]
    page = httpx.get(url + "/jobs/dash-test")
    assert page.status_code == 200
    assert 'data-job="dash-test"' in page.text
    sources = re.findall(r'<(?:script|link)[^>]+(?:src|href)="([^"]+)"', page.text)
    assert any("plotly.min.js" in s for s in sources), sources
    for src in sources:
        if src.startswith("data:"):
            continue
        assert src.startswith("/") and not src.startswith("//"), f"external asset {src}"
        resp = httpx.get(url + src)
        assert resp.status_code == 200, src
    plotly_js = httpx.get(url + "/dashboard/static/plotly.min.js")
    assert len(plotly_js.content) > 1_000_000 and b"plotly" in plotly_js.content[:2000].lower()
    gz = httpx.get(url + "/dashboard/static/plotly.min.js", headers={"Accept-Encoding": "gzip"})
    assert gz.headers.get("content-encoding") == "gzip" and gz.content == plotly_js.content
    assert httpx.get(url + "/jobs/nope").status_code == 404
    assert httpx.get(url + "/dashboard/jobs/nope").status_code == 404
    assert httpx.get(url + "/dashboard/static/..%2Fapp.py").status_code == 404


def test_job_json_has_status_history_and_worker_rates(served) -> None:
    coord, server = served
    jobs = httpx.get(server.url + "/dashboard/jobs").json()
    assert [j["name"] for j in jobs["jobs"]] == ["dash-test"]
    assert jobs["jobs"][0]["live"] is True
    data = httpx.get(server.url + "/dashboard/jobs/dash-test").json()
    assert data["live"] is True
    assert data["status"]["name"] == "dash-test" and data["status"]["state"] == "pending"
    assert data["status"]["dashboard_url"] == f"{server.url}/jobs/dash-test"
    assert set(data["history"]) == {"seq", "t", "step", "world_size", "target", "metrics"}
    assert data["worker_rates"] == {}


def test_reads_answer_while_the_control_loop_holds_the_lock(served) -> None:
    """The dashboard, the status and the metrics read what the loop published: none of them
    waits for the coordinator's lock (held here as a long pass would hold it), and what they
    show is as of the last flush."""
    coord, server = served
    with coord.lock:
        coord.job.step = 42
        coord.flush()
    holding = threading.Event()
    release = threading.Event()

    def long_pass() -> None:
        with coord.lock:
            holding.set()
            release.wait(30)

    t = threading.Thread(target=long_pass)
    t.start()
    try:
        assert holding.wait(5)
        for path in (
            "/dashboard/jobs",
            "/dashboard/jobs/dash-test",
            API_PREFIX + "/status",
            "/metrics",
        ):
            resp = httpx.get(server.url + path, timeout=5)  # a wait for the lock times out
            assert resp.status_code == 200, path
        status = httpx.get(server.url + API_PREFIX + "/status", timeout=5).json()
        assert status["step"] == 42
    finally:
        release.set()
        t.join()


def test_worker_rates_skip_workers_about_to_be_healed(served, monkeypatch) -> None:
    coord, server = served
    source = server.app.state.dashboard_source
    clock = {"now": 1000.0}
    monkeypatch.setattr("tidal.dashboard.sources.time.monotonic", lambda: clock["now"])
    with coord.lock:
        coord.job.step = 100
        coord.job.workers = {
            0: WorkerRecord(id=0, state=WorkerState.RUNNING, step=100),
            1: WorkerRecord(id=1, state=WorkerState.RUNNING, step=0),  # a joiner, not healed
            2: WorkerRecord(id=2, state=WorkerState.STANDBY, step=40),
        }
        coord.flush()  # the loop's flush publishes what the dashboard reads
    assert source.worker_rates("dash-test")[0] == {"step": 100, "steps_per_s": None}
    clock["now"] += 2.0
    with coord.lock:
        coord.job.step = coord.job.workers[0].step = 300
        coord.job.workers[1].step = 299  # healed: its jump from 0 is not a rate
        coord.flush()
    rates = source.worker_rates("dash-test")
    assert rates[0] == {"step": 300, "steps_per_s": 100.0}
    assert rates[1] == {"step": 299, "steps_per_s": None}
    assert rates[2] == {"step": 40, "steps_per_s": None}
    clock["now"] += 1.0
    with coord.lock:
        coord.job.step = coord.job.workers[0].step = coord.job.workers[1].step = 400
        coord.flush()
    rates = source.worker_rates("dash-test")
    assert rates[0]["steps_per_s"] == pytest.approx(100.0)
    assert rates[1]["steps_per_s"] == pytest.approx(101.0)
    assert source.worker_rates("another-job") == {}


def test_dashboard_is_read_only_and_mutations_still_need_the_token(served) -> None:
    coord, server = served
    for path in ("/", "/jobs/dash-test", "/dashboard/jobs", "/dashboard/jobs/dash-test"):
        for method in ("POST", "PUT", "DELETE"):
            assert httpx.request(method, server.url + path).status_code == 405, (method, path)
    base = server.url + API_PREFIX
    for path, body in [("/scale", {"workers": 2}), ("/stop", None)]:
        assert httpx.post(base + path, json=body).status_code == 401
        other = "y" if coord.token.endswith("x") else "x"  # one in 64 tokens ends with x
        wrong = {"Authorization": "Bearer " + coord.token[:-1] + other}
        assert httpx.post(base + path, json=body, headers=wrong).status_code == 401
        assert (
            httpx.post(base + path, json=body, headers={"Authorization": coord.token}).status_code
            == 401
        )
    assert coord.job.target == 1 and coord.job.stop_requested_at is None


def test_dashboard_answers_only_on_the_bound_loopback_address(served) -> None:
    _, server = served
    host, port = server.sock.getsockname()
    assert host == "127.0.0.1"
    assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
    assert httpx.get(f"http://localhost:{port}/").status_code == 200
    with pytest.raises(ConnectionRefusedError):  # another loopback address: nothing listens
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
    # a page on another site that rebinds its name to 127.0.0.1 is refused
    evil = httpx.get(f"http://127.0.0.1:{port}/dashboard/jobs", headers={"Host": "evil.example"})
    assert evil.status_code == 400


# -- history ------------------------------------------------------------------------------
def _point(i: int, world: int = 2) -> history_mod.Point:
    return history_mod.Point(time=100.0 + i, step=i, world_size=world, target=world, metrics={})


def test_history_reads_after_a_sequence_and_thins_long_series(tmp_path) -> None:
    store = HistoryStore(tmp_path / "tidal.db")
    try:
        store.append("a", [_point(i, world=2 if i < 500 else 3) for i in range(1000)])
        store.append("b", [_point(0)])
        full = store.read("a", max_points=None)
        assert full["step"] == list(range(1000))
        tail = store.read("a", after=full["seq"] - 3, max_points=None)
        assert tail["step"] == [997, 998, 999] and tail["seq"] == full["seq"]
        assert store.read("a", after=full["seq"])["step"] == []
        thin = store.read("a", max_points=100)
        assert 100 <= len(thin["step"]) <= 110
        assert {0, 499, 500, 999} <= set(thin["step"])  # ends and the change of size kept
        assert store.read("b", max_points=None)["step"] == [0]
    finally:
        store.close()


def test_recorder_samples_changes_and_writes_them_for_later(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(history_mod, "SAMPLE_EVERY_S", 0.0)
    monkeypatch.setattr(history_mod, "WRITE_EVERY_S", 0.0)

    class FakeCoordinator:  # what Recorder reads of a Coordinator
        spec = SimpleNamespace(name="j")
        step, target, world, metrics = 0, 2, 0, {}

        def sample(self) -> tuple:
            return self.step, self.world, self.target, dict(self.metrics), [], {}

    coord = FakeCoordinator()
    coord.metrics = {}
    rec = Recorder(coord, tmp_path)
    rec.tick()
    rec.tick()  # nothing changed: no point
    coord.step, coord.world = 5, 2
    coord.metrics["loss"] = 1.5
    rec.tick()
    coord.target = 3
    rec.tick()
    rec.close()  # a last point, forced
    got = HistoryStore(db_path(tmp_path)).read("j")
    assert got["step"] == [0, 5, 5, 5]
    assert got["world_size"] == [0, 2, 2, 2]
    assert got["target"] == [2, 2, 3, 3]
    assert got["metrics"][1] == {"loss": 1.5}


def test_the_history_says_each_new_failure_and_its_recovery(tmp_path, monkeypatch, capsys):
    """Never silent after a first warning (issue 51): each new error is said, repeats are
    not, and recording again is said; what could not be written is written then."""
    monkeypatch.setattr(history_mod, "SAMPLE_EVERY_S", 0.0)
    monkeypatch.setattr(history_mod, "WRITE_EVERY_S", 0.0)

    class FakeCoordinator:
        spec = SimpleNamespace(name="j")
        step = 0

        def sample(self) -> tuple:
            return self.step, 1, 1, {}, [], {}

    coord = FakeCoordinator()
    rec = Recorder(coord, tmp_path)
    append = rec.store.append
    errors = [OSError("disk full"), OSError("disk full"), RuntimeError("locked")]

    def failing(*args, **kwargs):
        if errors:
            raise errors.pop(0)
        return append(*args, **kwargs)

    rec.store.append = failing
    for step in range(5):
        coord.step = step
        rec.tick()
    rec.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if "dashboard history" in line]
    assert len(lines) == 3, lines
    assert "OSError: disk full" in lines[0] and "RuntimeError: locked" in lines[1]
    assert "records again, after 3 failed attempts" in lines[2]
    assert HistoryStore(db_path(tmp_path)).read("j")["step"] == [0, 1, 2, 3, 4, 4]  # + close's


def test_a_history_that_cannot_be_written_is_told_to_its_host(tmp_path, monkeypatch, capsys):
    """``on_write_error`` hears each failed SQLite write (the host ends the job on it, in
    one line) instead of the history's own warning; other errors stay warnings."""
    monkeypatch.setattr(history_mod, "SAMPLE_EVERY_S", 0.0)
    monkeypatch.setattr(history_mod, "WRITE_EVERY_S", 0.0)

    class FakeCoordinator:
        spec = SimpleNamespace(name="j")

        def sample(self) -> tuple:
            return 0, 1, 1, {}, [], {}

    heard: list[str] = []
    rec = Recorder(FakeCoordinator(), tmp_path, on_write_error=lambda e: heard.append(str(e)))
    errors = [sqlite3.OperationalError("database or disk is full"), OSError("gone")]

    def failing(*args, **kwargs):
        raise errors.pop(0)

    rec.store.append = failing
    rec.tick()
    assert heard == ["database or disk is full"]
    assert "dashboard history" not in capsys.readouterr().err
    rec.tick(force=True)
    assert heard == ["database or disk is full"]
    assert "OSError: gone" in capsys.readouterr().err


# -- served by `tidal dashboard` ------------------------------------------------------------
def _recorded_job(home: Path, name: str, state: str, *, coordinator_pid: int | None = None):
    db = Database(db_path(home))
    try:
        db.create_job(
            name=name,
            spec={"min_workers": 1, "max_workers": 3, "script": "/x/train.py"},
            target=2,
        )
        db.update_job(name, state=state, step=40, world_size=2, metrics={"loss": 0.5})
        db.upsert_generation(
            name,
            GenerationView(
                id=1,
                world_size=2,
                members=[0, 1],
                start_step=0,
                reason="start with 2 workers",
                pause_s=None,
                opened_at=time.time(),
            ),
        )
        db.add_event(name, EventView(time=time.time(), kind="scale", message="target 2 -> 3"))
    finally:
        db.close()
    store = HistoryStore(db_path(home))
    store.append(name, [_point(i) for i in range(5)])
    store.close()
    if coordinator_pid is not None:
        job_dir(home, name).path.mkdir(parents=True, exist_ok=True)
        job_dir(home, name).write_coordinator(
            url="http://127.0.0.1:9", token="t", pid=coordinator_pid
        )


def test_home_server_lists_every_job_and_reports_dead_coordinators(tmp_path) -> None:
    _recorded_job(tmp_path, "done", "succeeded")
    _recorded_job(tmp_path, "orphan", "running")  # no coordinator: it died
    _recorded_job(tmp_path, "live", "running", coordinator_pid=os.getpid())
    server = DashboardServer(tmp_path)
    server.start()
    try:
        assert server.url.startswith("http://127.0.0.1:")
        jobs = {j["name"]: j for j in httpx.get(server.url + "/dashboard/jobs").json()["jobs"]}
        assert {n: j["state"] for n, j in jobs.items()} == {
            "done": "succeeded",
            "orphan": "interrupted",
            "live": "running",
        }
        assert jobs["orphan"]["world_size"] == 0 and jobs["live"]["live"] is True
        data = httpx.get(server.url + "/dashboard/jobs/done").json()
        assert data["live"] is False and data["history"]["step"] == [0, 1, 2, 3, 4]
        assert data["status"]["events"][-1]["kind"] == "scale"
        assert httpx.get(server.job_url("done")).status_code == 200
        parsed = {
            (s.name, s.labels.get("job")): s.value
            for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
            for s in f.samples
        }
        assert parsed[("tidal_step", "done")] == 40
        assert parsed[("tidal_world_size", "orphan")] == 0
        assert httpx.post(server.url + "/dashboard/jobs").status_code == 405
    finally:
        server.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/", timeout=2)


def test_dashboard_command_refuses_a_home_without_jobs(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "dashboard", "--home", str(tmp_path / "empty")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert (
        proc.stderr.strip()
        == f"tidal: error: no jobs in {tmp_path / 'empty'} (set --home or $TIDAL_HOME)"
    )


# -- a real job in a real browser -----------------------------------------------------------
@pytest.fixture
def page(tmp_path):
    """A page of a fresh headless Debian chromium (Playwright drives it; nothing downloads)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(exe):
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: .ci/run installs it (apt-get install chromium)")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=exe,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            pg = ctx.new_page()
            pg.errors = []
            pg.on("pageerror", lambda exc: pg.errors.append(str(exc)))
            yield pg
        finally:
            ctx.close()


CHART_POINTS = "id => Number(document.getElementById(id)?.dataset.points || 0)"
HAS_DATA = f"""() => {{
    const points = {CHART_POINTS};
    const world = document.getElementById('chart-world');
    const loss = document.querySelector('[data-metric="loss"]');
    return points('chart-world') > 0 && points('chart-throughput') > 0
        && loss && Number(loss.dataset.points) > 0
        && world.data && world.data[0].x.length > 0;
}}"""
SCALED = """() => {
    const world = document.getElementById('chart-world');
    return world.data && Math.max(...world.data[0].y) === 3
        && Number(document.getElementById('chart-pauses').dataset.points) > 0;
}"""


def _screenshot(pg, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    pg.screenshot(path=str(path), full_page=True)
    return path


def _metric_samples(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=10).text
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.labels.get("job") == "watched" and "le" not in s.labels and "state" not in s.labels
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_live_job_in_chromium_then_finished_job_from_sqlite(tidal_home: Home, page) -> None:
    job = tidal_home.start(
        "watched", "--workers", "2", "--max-workers", "3", script_args=["--max-steps", BIG]
    )
    status = job.wait_running(min_step=30, timeout=90)
    url = job.coordinator_info()["url"]
    assert status["dashboard_url"] == f"{url}/jobs/watched"
    assert status["metrics_url"] == f"{url}/metrics"
    shown = tidal_home.cli("dashboard", "watched")  # a running job: its coordinator's page
    assert shown.returncode == 0 and shown.stdout.strip() == status["dashboard_url"], shown

    page.goto(status["dashboard_url"])
    page.wait_for_function(HAS_DATA, timeout=60_000)
    assert page.locator("#workers tbody tr[data-state=running]").count() == 2

    scaled = job.scale(3)
    assert scaled.returncode == 0, scaled.stderr
    page.wait_for_selector(
        '#timeline tbody tr[data-kind="scale"]:has-text("tidal scale")', timeout=30_000
    )
    job.wait_for(lambda s: s["world_size"] == 3, 120, "world size 3 after tidal scale")
    page.wait_for_function(SCALED, timeout=30_000)
    page.wait_for_selector('#timeline tbody tr[data-kind="generation"]:has-text("3 workers")')
    # How the joiner got the state: healed from a member (the generations table says so).
    page.wait_for_selector("#generations tbody tr td:text-is('heal')", timeout=30_000)
    shot = _screenshot(page, "dashboard-live-job.png")
    assert shot.stat().st_size > 10_000

    metrics = _metric_samples(status["metrics_url"])
    assert metrics["tidal_world_size"] == 3 and metrics["tidal_target_workers"] == 3
    assert metrics["tidal_step"] > 30 and metrics["tidal_samples_per_second"] > 0
    assert metrics["tidal_rescale_pause_seconds_count"] >= 1
    for name in (
        "tidal_worker_failures_total",
        "tidal_checkpoint_stall_seconds",
        "tidal_cost_dollars",
    ):
        assert name in metrics, sorted(metrics)

    # The job ends and its coordinator exits; `tidal dashboard` serves it from SQLite.
    assert job.stop().returncode == 0
    final = job.wait_state("stopped", timeout=60)
    assert final["dashboard_url"] is None, summarize(final)
    tidal_home.assert_no_processes(timeout=30)
    assert job.coordinator_info() is None  # coordinator.json went with it

    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tidal.cli",
            "dashboard",
            "--home",
            str(tidal_home.path),
            "--port",
            "0",
        ],
        cwd=ROOT,
        env=tidal_home.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        home_url = server.stdout.readline().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", home_url), (home_url, server.stderr)
        page.goto(home_url)
        page.wait_for_selector('#jobs tbody tr[data-job="watched"][data-state="stopped"]')
        page.click('#jobs a:has-text("watched")')
        page.wait_for_function(HAS_DATA, timeout=30_000)
        page.wait_for_function(SCALED, timeout=10_000)
        page.wait_for_selector('#timeline tbody tr[data-kind="scale"]:has-text("tidal scale")')
        assert page.locator("#state").inner_text() == "stopped"
        _screenshot(page, "dashboard-finished-job.png")
        logs = httpx.get(home_url + "dashboard/jobs/watched/logs/0")
        assert logs.status_code == 200 and "step" in logs.text
        assert not page.errors, page.errors
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=15) == 0, server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    with pytest.raises(httpx.ConnectError):
        httpx.get(home_url, timeout=2)
