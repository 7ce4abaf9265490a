"""Hardening of what the coordinator accepts (issue 19): non-finite metrics are carried, bad
input is a 4xx (never a 500 nor a crash), completion is decided from the job's length, each
worker holds its own credential, and no backend starts more workers than the machine holds.

In-process against a real coordinator and its real HTTP server (``served_coordinator``),
except one short real job (NaN metrics and completion end to end) and the CLI checks.
"""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest
from e2e_helpers import DIGITS

from tidal.backends import local as local_backend
from tidal.backends.local import LocalBackend
from tidal.cli import main as cli_main
from tidal.client import CoordinatorClient, CoordinatorError
from tidal.config import JobSpec
from tidal.coordinator.control.controller import Coordinator
from tidal.coordinator.records.records import WorkerRecord
from tidal.protocol import (
    API_PREFIX,
    MAX_STEP,
    CheckpointView,
    DoneReport,
    HeartbeatRequest,
    JobState,
    RegisterRequest,
    WorkerState,
    worker_token,
)
from tidal.worker.agent.client import Agent, WorkerEnv

NAN, INF = float("nan"), float("inf")


def strict_json(text: str):
    """``json.loads`` that refuses the non-standard NaN/Infinity tokens."""

    def refuse(token: str):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def served(served_coordinator):
    coord, url = served_coordinator
    return coord, url


def add_workers(coord, *wids: int) -> None:
    """Worker records as if the backend had started them (no process)."""
    with coord.lock:
        for wid in wids:
            coord.job.workers[wid] = WorkerRecord(id=wid)


def worker_client(coord, url: str, wid: int) -> CoordinatorClient:
    return CoordinatorClient(url, worker_token(coord.token, wid))


def worker_auth(coord, wid: int) -> dict[str, str]:
    return {"Authorization": f"Bearer {worker_token(coord.token, wid)}"}


def job_auth(coord) -> dict[str, str]:
    return {"Authorization": f"Bearer {coord.token}"}


def events(coord, kind: str | None = None) -> list[str]:
    return [e.message for e in coord.status(fresh=True).events if kind is None or e.kind == kind]


# -- finding 6: NaN and infinity metrics are carried ----------------------------------------
def test_nan_and_inf_metrics_are_carried_to_every_view(served, tmp_path, capsys):
    coord, url = served
    add_workers(coord, 0)
    client = worker_client(coord, url, 0)
    try:
        client.register(0, RegisterRequest(pid=1, host="h", max_steps=10))
        metrics = {"loss": NAN, "grad_norm": INF, "log_p": -INF, "accuracy": 0.5}
        client.heartbeat(0, HeartbeatRequest(step=3, metrics=metrics))
        with coord.lock:
            coord.flush()  # as the loop does every half second: reads see it from then on
        back = client.status().metrics  # the client reads them back as floats
    finally:
        client.close()
    assert math.isnan(back["loss"]) and back["grad_norm"] == INF and back["log_p"] == -INF
    assert back["accuracy"] == 0.5
    spelled = {"loss": "NaN", "grad_norm": "Infinity", "log_p": "-Infinity", "accuracy": 0.5}
    # GET /status (the coordinator answering) is standard JSON
    raw = httpx.get(url + API_PREFIX + "/status")
    assert raw.status_code == 200
    assert {k: strict_json(raw.text)["metrics"][k] for k in spelled} == spelled
    # `tidal status --json` from SQLite (no coordinator.json: the records path)
    assert cli_main(["status", "served", "--json", "--home", str(tmp_path)]) == 0
    printed = strict_json(capsys.readouterr().out)
    assert {k: printed["metrics"][k] for k in spelled} == spelled
    # the dashboard's JSON and the Prometheus exposition answer too
    for path in ("/dashboard/jobs", "/dashboard/jobs/served"):
        resp = httpx.get(url + path)
        assert resp.status_code == 200, path
        strict_json(resp.text)
    assert strict_json(httpx.get(url + "/dashboard/jobs").text)["jobs"][0]["loss"] == "NaN"
    assert httpx.get(url + "/metrics").status_code == 200


def test_a_refused_heartbeat_is_one_line_in_the_worker_log_and_an_event(served, capsys):
    coord, url = served
    add_workers(coord, 0)
    agent = Agent(WorkerEnv(url=url, token=worker_token(coord.token, 0), worker_id=0))
    try:
        agent.register(max_steps=10)
        agent.post_metrics({"x" * 300: 1.0, "loss": NAN})  # a name longer than the API takes
        deadline = time.monotonic() + 10
        while "refused" not in capsys.readouterr().err and time.monotonic() < deadline:
            time.sleep(0.05)
        before = coord.job.workers[0].last_heartbeat
        # the next heartbeats are accepted: the refused content was dropped, not resent
        deadline = time.monotonic() + 10
        while coord.job.workers[0].last_heartbeat == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coord.job.workers[0].last_heartbeat > before
        agent.post_metrics({"loss": NAN})  # delivered at the latest by close()
    finally:
        agent.close()
    err = capsys.readouterr().err
    assert "refused" not in err  # said once, not once per heartbeat
    assert math.isnan(coord.status(fresh=True).metrics["loss"])
    refused = events(coord, "refused")
    assert len(refused) == 1 and "worker 0: heartbeat refused" in refused[0]
    assert "metrics" in refused[0] and "at most 200 characters" in refused[0]


def test_a_refused_heartbeat_keeps_the_checkpoint_records_it_carried(served, capsys, tmp_path):
    """The script's bad metric is dropped; the checkpoint record beside it, Tidal's own, goes
    with the next heartbeat and reaches the job (issue 51: nothing dropped silently)."""
    coord, url = served
    add_workers(coord, 0)
    agent = Agent(WorkerEnv(url=url, token=worker_token(coord.token, 0), worker_id=0))
    try:
        agent.register(max_steps=10)
        with agent._lock:  # both in one heartbeat
            agent._metrics = {"x" * 300: 1.0}
            agent._checkpoints.append(CheckpointView(step=4, path=str(tmp_path)))  # it exists
        deadline = time.monotonic() + 10
        while not coord.status(fresh=True).checkpoints and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        agent.close()
    assert [c.step for c in coord.status(fresh=True).checkpoints] == [4]
    err = capsys.readouterr().err
    assert "dropped the 1 metrics and 0 per-step records it carried" in err
    assert "its reports and checkpoint records go again" in err


def test_the_line_names_the_reason_when_the_credential_is_refused(served, capsys):
    coord, url = served
    add_workers(coord, 0)
    agent = Agent(WorkerEnv(url=url, token=worker_token(coord.token, 0), worker_id=0))
    try:
        agent.register()
        agent._beat_client.close()
        agent._beat_client = CoordinatorClient(url, coord.token)  # the job's token: refused
        deadline = time.monotonic() + 10
        err = ""
        while "refused" not in err and time.monotonic() < deadline:
            time.sleep(0.05)
            err += capsys.readouterr().err
        time.sleep(0.3)
        err += capsys.readouterr().err
    finally:
        agent.close()
    lines = [line for line in err.splitlines() if "refused" in line]
    assert lines == [
        "tidal: warning: the coordinator refused a heartbeat of worker 0 (HTTP 401): "
        "missing or wrong token of worker 0"
    ]


# -- finding 13: ranges at the API edge, completion, per-worker credentials -----------------
@pytest.mark.parametrize(
    "path, body",
    [
        ("heartbeat", {"step": 10**23}),
        ("heartbeat", {"step": -1}),
        ("heartbeat", {"generation": 2**40}),
        ("heartbeat", {"metrics": {"": 1.0}}),
        ("heartbeat", {"metrics": {f"m{i}": 1.0 for i in range(1001)}}),
        ("heartbeat", {"checkpoints": [{"step": 1, "path": "p" * 5000}]}),
        ("heartbeat", {"reports": [{"generation": 1, "start_step": 0, "first_step_time": 1e300}]}),
        ("register", {"pid": -1, "host": "h"}),
        ("register", {"pid": 2**40, "host": "h"}),
        ("register", {"pid": 1, "host": "h" * 1000}),
        ("register", {"pid": 1, "host": "h", "max_steps": 10**23}),
        ("failure", {"generation": 1, "step": 1, "error": "e" * 10_000}),
        ("done", {"step": 10**23, "completed": True}),
        ("done", {"step": -5, "completed": False}),
    ],
)
def test_out_of_range_values_are_refused_with_422(served, path, body):
    coord, url = served
    add_workers(coord, 0)
    resp = httpx.post(
        f"{url}{API_PREFIX}/workers/0/{path}", json=body, headers=worker_auth(coord, 0)
    )
    assert resp.status_code == 422, resp.text
    strict_json(resp.text)
    assert coord.job.step == 0 and coord.job.outcome is None
    with coord.lock:
        coord.flush()  # what killed the coordinator before: SQLite could not hold the step


def test_a_completion_report_ends_the_job_only_at_its_length_from_a_member(served):
    coord, url = served
    add_workers(coord, 0, 1, 2)
    clients = {w: worker_client(coord, url, w) for w in (0, 1, 2)}
    try:
        for wid, c in clients.items():
            c.register(wid, RegisterRequest(pid=100 + wid, host="h", max_steps=10_000_000))
        with coord.lock:
            coord.generations.open([0, 1], "test")  # worker 2 stays outside
        clients[0].report_done(0, DoneReport(step=1704, completed=True))
        assert coord.job.outcome is None
        clients[2].report_done(2, DoneReport(step=10_000_000, completed=True))
        assert coord.job.outcome is None
        clients[1].report_done(1, DoneReport(step=10_000_000, completed=True))
        assert coord.job.outcome == JobState.SUCCEEDED
    finally:
        for c in clients.values():
            c.close()
    ignored = [m for m in events(coord, "worker") if "ignored" in m]
    assert ignored == [
        "worker 0 reported completion at step 1704; ignored: the job has 10000000 steps",
        "worker 2 reported completion at step 10000000; ignored: "
        "it is not a member of the current generation",
    ]


def test_completion_is_refused_while_the_jobs_length_is_unknown(served):
    coord, url = served
    add_workers(coord, 0)
    client = worker_client(coord, url, 0)
    try:
        client.register(0, RegisterRequest(pid=100, host="h"))  # no max_steps
        with coord.lock:
            coord.generations.open([0], "test")
        client.report_done(0, DoneReport(step=5, completed=True))
    finally:
        client.close()
    assert coord.job.outcome is None
    assert any("the job's length is unknown" in m for m in events(coord, "worker"))


def test_each_worker_speaks_only_with_its_own_credential(served):
    coord, url = served
    add_workers(coord, 0, 1)
    base = url + API_PREFIX
    hb = {"step": 1}
    assert httpx.post(
        f"{base}/workers/0/heartbeat", json=hb, headers=worker_auth(coord, 0)
    ).is_success
    # worker 0 cannot speak for worker 1, nor scale or stop the job
    assert (
        httpx.post(
            f"{base}/workers/1/heartbeat", json=hb, headers=worker_auth(coord, 0)
        ).status_code
        == 401
    )
    assert (
        httpx.post(
            f"{base}/workers/1/done",
            json={"step": 1, "completed": True},
            headers=worker_auth(coord, 0),
        ).status_code
        == 401
    )
    assert (
        httpx.post(f"{base}/scale", json={"workers": 2}, headers=worker_auth(coord, 0)).status_code
        == 401
    )
    assert httpx.post(f"{base}/stop", headers=worker_auth(coord, 0)).status_code == 401
    # the job's token is for the CLI: not a worker's credential
    assert (
        httpx.post(f"{base}/workers/0/heartbeat", json=hb, headers=job_auth(coord)).status_code
        == 401
    )
    assert coord.job.workers[1].last_heartbeat is None and coord.job.stop_requested_at is None


def test_workers_are_started_with_their_own_credential_not_the_jobs_token(served):
    coord, _ = served
    envs: dict[int, dict[str, str]] = {}

    def start(wid: int, env: dict[str, str]) -> int:
        envs[wid] = env
        return 4_000_000 + wid  # no process: only the environment is under test

    coord.executor.backend.start = start
    with coord.lock:
        coord.lifecycle.start_worker()
        coord.lifecycle.start_worker()
        coord.job.workers.clear()
    assert envs[0]["TIDAL_TOKEN"] == worker_token(coord.token, 0)
    assert envs[1]["TIDAL_TOKEN"] == worker_token(coord.token, 1)
    assert coord.token not in {e["TIDAL_TOKEN"] for e in envs.values()}


# -- finding 14: every bad input is a 4xx ------------------------------------------------------
@pytest.mark.parametrize(
    "raw",
    [
        b'{"workers": NaN}',
        b'{"workers": Infinity}',
        b'{"workers": -Infinity}',
        b'{"workers": 1e400}',
        b'{"workers": 2.0}',
        b'{"workers": "2"}',
        b'{"workers": true}',
        b'{"workers": 100000000000000000000000000000}',
        b'{"workers": -1}',
        b'{"workers": null}',
        b"{}",
        b'{"workers": ',
        b"[]",
    ],
)
def test_scale_with_a_bad_body_is_a_4xx(served, raw):
    coord, url = served
    headers = {**job_auth(coord), "Content-Type": "application/json"}
    resp = httpx.post(url + API_PREFIX + "/scale", content=raw, headers=headers)
    assert 400 <= resp.status_code < 500, (raw, resp.status_code, resp.text)
    strict_json(resp.text)
    assert coord.job.target == 1


@pytest.mark.parametrize(
    "raw",
    [
        b'{"step": NaN}',
        b'{"step": 1e400}',
        b'{"metrics": {"loss": "not a number"}}',
        b'{"reports": [{"generation": 1, "start_step": 0, "first_step_time": NaN}]}',
    ],
)
def test_a_worker_call_with_a_bad_body_is_a_4xx(served, raw):
    coord, url = served
    add_workers(coord, 0)
    headers = {**worker_auth(coord, 0), "Content-Type": "application/json"}
    resp = httpx.post(url + API_PREFIX + "/workers/0/heartbeat", content=raw, headers=headers)
    assert resp.status_code == 422, resp.text
    strict_json(resp.text)


def test_a_nan_metric_in_a_raw_body_is_carried(served):
    coord, url = served
    add_workers(coord, 0)
    headers = {**worker_auth(coord, 0), "Content-Type": "application/json"}
    for raw in (b'{"metrics": {"loss": NaN}}', b'{"metrics": {"loss": "NaN"}}'):
        resp = httpx.post(url + API_PREFIX + "/workers/0/heartbeat", content=raw, headers=headers)
        assert resp.status_code == 200, resp.text
        assert math.isnan(coord.status(fresh=True).metrics["loss"])


@pytest.mark.parametrize("after", [str(2**77), "-1", "1e400", "NaN", "x"])
def test_dashboard_after_out_of_range_is_a_422(served, after):
    _, url = served
    resp = httpx.get(f"{url}/dashboard/jobs/served", params={"after": after})
    assert resp.status_code == 422, resp.text


def test_dashboard_after_at_the_bound_answers(served):
    _, url = served
    resp = httpx.get(f"{url}/dashboard/jobs/served", params={"after": str(MAX_STEP)})
    assert resp.status_code == 200 and resp.json()["history"]["t"] == []


def test_worker_ids_out_of_range_are_a_4xx(served):
    coord, url = served
    for wid in (2**77, -1):
        resp = httpx.post(
            f"{url}{API_PREFIX}/workers/{wid}/heartbeat", json={}, headers=job_auth(coord)
        )
        assert 400 <= resp.status_code < 500


def test_client_errors_are_one_line(served):
    coord, url = served
    add_workers(coord, 0)
    client = worker_client(coord, url, 0)
    try:
        with pytest.raises(CoordinatorError) as info:
            client.report_done(0, DoneReport.model_construct(step=-3, completed=True))
    finally:
        client.close()
    assert info.value.status == 422 and str(info.value).startswith("step: ")
    assert coord.job.workers[0].state == WorkerState.STARTING


# -- finding 16: no more workers than the machine holds, a few starting at a time ------------
def _spec(**kw) -> JobSpec:
    base = dict(name="cap", script="/x.py", workers=1, max_workers=1)
    base.update(kw)
    return JobSpec(**base)


def test_run_with_more_workers_than_the_machine_holds_is_one_line_and_starts_nothing(
    tmp_path, capsys, monkeypatch
):
    def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(local_backend.subprocess, "Popen", no_process)
    monkeypatch.setattr("tidal.launch.subprocess.Popen", no_process)
    home = tmp_path / "home"
    for opts in (["--workers", "100000"], ["--workers", "2", "--max-workers", "100000"]):
        code = cli_main(["run", "--home", str(home), *opts, str(DIGITS)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1, err
        assert err[0].startswith("tidal: error: 100000 workers is more than this machine holds")
    assert not (home / "tidal.db").exists() and not (home / "jobs").exists()


def test_the_local_limit_is_per_core_unless_oversubscribed_and_memory_always(monkeypatch):
    monkeypatch.setattr(local_backend, "_cores", lambda: 2)
    monkeypatch.setattr(local_backend, "_available_memory", lambda: 64 * 2**30)
    LocalBackend.check_capacity(_spec(workers=4, max_workers=8))  # 4 per core on 2 cores
    with pytest.raises(ValueError, match=r"at most 8 local workers .*--oversubscribe") as info:
        LocalBackend.check_capacity(_spec(workers=4, max_workers=9))
    assert "\n" not in str(info.value)
    LocalBackend.check_capacity(_spec(workers=4, max_workers=64, oversubscribe=True))
    monkeypatch.setattr(local_backend, "_available_memory", lambda: 2**30)  # 4 workers' worth
    with pytest.raises(ValueError, match=r"at most 4 local workers \(1.0 GiB of memory") as info:
        LocalBackend.check_capacity(_spec(workers=4, max_workers=5, oversubscribe=True))
    assert "--oversubscribe" not in str(info.value)


def test_the_default_limit_holds_the_test_suites_4_workers_on_this_machine():
    LocalBackend.check_capacity(_spec(workers=4, max_workers=4))


def test_the_coordinator_starts_at_most_max_starting_workers_at_once(tmp_path):
    coord = Coordinator(_spec(workers=8, max_workers=8), tmp_path)
    started: list[int] = []

    def start(wid: int, env: dict[str, str]) -> int:
        started.append(wid)
        return 4_000_000 + wid  # no process

    try:
        coord.executor.backend.start = start
        coord.executor.backend.max_starting = 3
        with coord.lock:
            coord.loop.reconcile()
            assert started == [0, 1, 2]
            coord.loop.reconcile()
            assert started == [0, 1, 2]  # still starting: no more
            coord.job.workers[0].state = coord.job.workers[1].state = WorkerState.STANDBY
            coord.loop.reconcile()
            assert started == [0, 1, 2, 3, 4]
    finally:
        coord.job.workers.clear()
        coord.close()


# -- end to end: a real worker logs NaN, the job completes ------------------------------------
SCRIPT = """
import torch
from torch.utils.data import TensorDataset

import tidal

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
trainer = tidal.Trainer(model, opt, data, global_batch_size=8)
for step in trainer.run(max_steps=30):
    for x, y in step.micro_batches():
        step.backward(torch.nn.functional.mse_loss(trainer.model(x), y))
    tidal.log(loss=float("nan"), best=float("inf"))
"""


def test_a_job_whose_script_logs_nan_runs_to_success(tidal_home, tmp_path):
    script = tmp_path / "nan_loss.py"
    script.write_text(SCRIPT)
    proc, job = tidal_home.run("nan", "--workers", "1", script=script, timeout=90)
    assert proc.returncode == 0, f"{proc.stderr}\n{job.logs_tail()}"
    proc = tidal_home.cli("status", "nan", "--json", timeout=60)
    status = strict_json(proc.stdout)
    assert status["state"] == "succeeded" and status["step"] == 30
    assert status["metrics"]["loss"] == "NaN" and status["metrics"]["best"] == "Infinity"
    assert "refused" not in job.worker_log(0)


def test_a_client_of_a_plain_http_coordinator_builds_no_verifying_tls_context(served):
    """Coordinators serve plain HTTP: a client of one loads no CA bundle (20 to 130 ms per
    client, three per worker, one on a recovery's path), and still speaks to it; an
    ``https://`` URL (a proxy in front) keeps verification on."""
    import ssl

    coord, url = served
    plain = CoordinatorClient(url, coord.token)
    assert plain._http._transport._pool._ssl_context.verify_mode == ssl.CERT_NONE
    assert plain.status().name == coord.spec.name
    proxied = CoordinatorClient("https://coordinator.example", coord.token)
    ctx = proxied._http._transport._pool._ssl_context
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
