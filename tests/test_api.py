"""The coordinator's HTTP API on a real server: tokens, validation, status from SQLite."""

import httpx
import pytest

from tidal.protocol import API_PREFIX


@pytest.fixture
def served(served_coordinator):
    coord, url = served_coordinator
    return coord, url + API_PREFIX


def test_mutating_calls_need_the_job_token(served):
    coord, base = served
    for path, body in [
        ("/scale", {"workers": 2}),
        ("/stop", None),
        ("/workers/0/register", {"pid": 1, "host": "h"}),
        ("/workers/0/heartbeat", {}),
    ]:
        assert httpx.post(base + path, json=body).status_code == 401
        bad = {"Authorization": "Bearer nope"}
        assert httpx.post(base + path, json=body, headers=bad).status_code == 401


def test_scale_with_token_validates_the_range(served):
    coord, base = served
    auth = {"Authorization": f"Bearer {coord.token}"}
    resp = httpx.post(base + "/scale", json={"workers": 9}, headers=auth)
    assert resp.status_code == 400 and "outside [1, 2]" in resp.json()["detail"]
    resp = httpx.post(base + "/scale", json={"workers": 2}, headers=auth)
    assert resp.status_code == 200 and resp.json()["target_workers"] == 2


def test_status_is_readable_without_token_and_has_the_contract_fields(served):
    _, base = served
    data = httpx.get(base + "/status").json()
    for key in (
        "name",
        "state",
        "step",
        "world_size",
        "target_workers",
        "workers",
        "generations",
        "events",
        "metrics",
        "checkpoints",
    ):
        assert key in data
    assert data["state"] == "pending" and data["name"] == "served"


def test_server_binds_loopback_only(served):
    _, base = served
    assert base.startswith("http://127.0.0.1:")
