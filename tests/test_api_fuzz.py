"""Fuzzing the coordinator's live API (issue 15): schemathesis generates requests from the
OpenAPI schema the running server serves, valid ones (positive) and ones that break it
(negative), and sends them over real HTTP to a real coordinator on 127.0.0.1.

- without a credential, with a wrong one, with an unprintable one, or with the other kind
  (a worker's on ``/scale``, the job's on a worker's or a host's call, another worker's): every call that
  needs one is refused (401, or 422 for a path that names no worker) and nothing about the
  job changes (target, state, workers, generations, events, metrics, checkpoints);
- with the right one (the job's token for ``/scale`` and ``/stop``, the worker's own
  ``protocol.worker_token`` for ``/workers/{wid}/...``, the hosts' ``host_token`` for
  ``/hosts/...``): no answer is a 5xx, every 2xx matches the schema, and the server keeps
  answering;
- the dashboard's routes (outside the schema) with random names and numbers: no 5xx.

Seeded (``derandomize``) and bounded (``EXAMPLES`` per operation and mode): CI sees the same
cases each run, in a few seconds. ``pytest tests/test_api_fuzz.py``; raise ``TIDAL_FUZZ_EXAMPLES``
for a longer campaign.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from urllib.parse import quote

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tidal.config import JobSpec
from tidal.coordinator.control.controller import Coordinator
from tidal.coordinator.records.records import WorkerRecord
from tidal.host.server import ApiServer
from tidal.hosts_protocol import HostRegister, host_token
from tidal.protocol import API_PREFIX, JobStatus, worker_token

EXAMPLES = int(os.environ.get("TIDAL_FUZZ_EXAMPLES", "20"))
UNAUTHORIZED = max(1, EXAMPLES // 2)  # cases per operation and mode, each sent 4-5 times
WORKERS = 4  # worker records 0..3; 0 and 1 are members of generation 1
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
OPERATIONS = {
    ("GET", "/status"),
    ("POST", "/scale"),
    ("POST", "/stop"),
    ("POST", "/workers/{wid}/register"),
    ("POST", "/workers/{wid}/heartbeat"),
    ("GET", "/workers/{wid}/role"),
    ("POST", "/workers/{wid}/failure"),
    ("POST", "/workers/{wid}/done"),
    ("POST", "/workers/{wid}/stop"),
    ("POST", "/hosts/register"),
    ("POST", "/hosts/{hid}/poll"),
}


def fuzz_settings(examples: int = EXAMPLES) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,  # the same cases on every run: CI is reproducible
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


def run_given(test: Callable, examples: int = EXAMPLES, **strategies) -> None:
    """Run ``test`` under hypothesis with ``strategies``, seeded and bounded."""
    fuzz_settings(examples)(given(**strategies)(test))()


@pytest.fixture
def served_hosts_job(tmp_path) -> Iterator[tuple[Coordinator, str]]:
    """A real coordinator of a job that takes hosts (``--listen 127.0.0.1:0``, the hosts
    backend, so every route answers), never ticking, its server on 127.0.0.1, one host
    joined (id 1). Its heartbeat timeout is short: a fuzzed poll is held 0.1 s at most."""
    spec = JobSpec(
        name="served",
        script=str(tmp_path / "x.py"),
        workers=1,
        max_workers=2,
        backend="hosts",
        listen="127.0.0.1:0",
        heartbeat_timeout_s=0.4,
    )
    coord = Coordinator(spec, tmp_path)
    server = ApiServer(coord)
    coord.url = server.url
    coord.flush()
    server.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    coord.hosts.register(HostRegister(name="h", address="127.0.0.1", slots=2, pid=1))
    try:
        yield coord, server.url
    finally:
        server.stop()
        coord.close()


@pytest.fixture
def fuzzed(served_hosts_job) -> Iterator[tuple]:
    """``(coordinator, base URL, schema, session)``: the served job with four worker
    records (no process), 0 and 1 the members of generation 1, and the schema it serves."""
    coord, url = served_hosts_job
    with coord.lock:
        for wid in range(WORKERS):
            coord.job.workers[wid] = WorkerRecord(id=wid)
        coord.generations.open([0, 1], "fuzz")
    schema = schemathesis.openapi.from_url(url + "/openapi.json", timeout=10)
    with requests.Session() as session:
        session.trust_env = False
        yield coord, url, schema, session


def operations(schema) -> list:
    """The schema's operations, ``/stop`` last (after it every call meets a stopped job)."""
    ops = [result.ok() for result in schema.get_all_operations()]
    return sorted(ops, key=lambda op: op.path.endswith("/stop"))


def short_path(op) -> str:
    return op.path.removeprefix(API_PREFIX)


def has_inputs(op) -> bool:
    """Whether a negative case exists: something to send that the schema refuses."""
    return bool(op.path_parameters) or op.body


def drop_generated_credential(case) -> None:
    """The schema lists the ``Authorization`` header (FastAPI's ``Header``): the tests send
    their own instead of what the generator made up."""
    for key in [k for k in case.headers or {} if k.lower() == "authorization"]:
        del case.headers[key]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def snapshot(coord) -> dict:
    """What an unauthorized call must not change (times of day excluded: cost accrues)."""
    status = coord.status(fresh=True).model_dump(mode="json")
    keep = ("state", "step", "target_workers", "world_size", "workers", "generations")
    keep += ("events", "metrics", "checkpoints", "checkpoint_failures")
    with coord.lock:
        internal = (coord.job.requested, coord.job.stop_requested_at, list(coord.job.leaving))
        internal += (coord.job.job_length, coord.job.reform_requested)
    return {"status": {k: status[k] for k in keep}, "internal": internal}


def assert_answering(url: str) -> None:
    resp = httpx.get(url + API_PREFIX + "/status", timeout=10)
    assert resp.status_code == 200, resp.text
    JobStatus.model_validate(resp.json())


def test_the_schema_lists_every_call_of_the_api(fuzzed):
    """The fuzzers cover what the schema lists: an API call missing from it goes unfuzzed."""
    _, _, schema, _ = fuzzed
    listed = {(op.method.upper(), short_path(op)) for op in operations(schema)}
    assert listed == OPERATIONS


# Header values no client library would build: non-ASCII, bare schemes, a token's prefix.
odd_headers = st.one_of(
    st.binary(min_size=1, max_size=60).map(
        lambda b: b"Bearer " + bytes(c for c in b if c >= 0x21 and c != 0x7F)
    ),
    st.sampled_from([b"Bearer", b"Bearer ", b"Basic", b"bearer x", b"Bearer \xff\xfe"]),
    st.text(st.characters(codec="latin-1", exclude_categories=["Cc"]), max_size=40).map(
        lambda t: t.strip().encode("latin-1") or b"x"
    ),
)


def wrong_credentials(coord, op, case, odd: bytes) -> list[dict]:
    """Every credential this call must refuse: none, a wrong one, an unprintable one, and
    the credentials of others."""
    creds = [{}, bearer("nope"), {"Authorization": odd}]
    wid = (case.path_parameters or {}).get("wid")
    if "/hosts/" in op.path:
        creds.append(bearer(coord.token))  # the job's token is not the hosts'
        creds.append(bearer(worker_token(coord.token, 0)))
    elif "{wid}" in op.path:
        creds.append(bearer(coord.token))  # the job's token is no worker's credential
        if isinstance(wid, int):
            creds.append(bearer(worker_token(coord.token, wid + 1)))  # another worker's
    else:
        creds.append(bearer(worker_token(coord.token, 0)))  # a worker cannot scale or stop
    return creds


def refused(resp) -> bool:
    """Refused before any handler ran: the credential (401), a path or body the schema
    refuses (422), or a body that is no JSON at all (FastAPI's 400, before the checks)."""
    if resp.status_code == 400:
        return resp.json().get("detail") == "There was an error parsing the body"
    return resp.status_code in (401, 422)


def test_fuzz_without_the_credential_is_refused_and_changes_nothing(fuzzed):
    coord, url, schema, session = fuzzed
    before = snapshot(coord)
    seen: dict[int, int] = {}
    for op in operations(schema):
        if (op.method.upper(), short_path(op)) == ("GET", "/status"):
            continue  # a read: open on loopback (tests/test_read_auth.py)

        def check(case, odd, op) -> None:
            drop_generated_credential(case)
            for headers in wrong_credentials(coord, op, case, odd):
                resp = case.call(session=session, headers=headers, timeout=10)
                seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
                assert refused(resp), f"{op.method} {op.path} {headers}: {resp.text[:300]}"
            assert snapshot(coord) == before, f"{op.method} {op.path} changed the job"

        for mode in MODES if has_inputs(op) else MODES[:1]:
            run_given(
                check, UNAUTHORIZED, case=op.as_strategy(mode), odd=odd_headers, op=st.just(op)
            )
    assert_answering(url)
    # the credential check refused them, not only the validation
    assert seen.get(401, 0) > seen.get(422, 0) > 0, seen


def steer(coord, case, known: bool) -> None:
    """Aim a case at the job as it is: a known worker, the current generation, a size the
    job admits. Half the cases keep the fuzzer's own numbers (unknown workers, generations
    that never were, sizes outside [min, max])."""
    if not known:
        return
    wid = (case.path_parameters or {}).get("wid")
    if isinstance(wid, int) and not isinstance(wid, bool):
        case.path_parameters["wid"] = wid % WORKERS
    if isinstance((case.path_parameters or {}).get("hid"), int):
        case.path_parameters["hid"] = 1  # the host joined, unless a goodbye removed it
    body = case.body if isinstance(case.body, dict) else {}
    if isinstance(body.get("generation"), int) and coord.job.latest is not None:
        body["generation"] = coord.job.latest.id
    if isinstance(body.get("workers"), int) and not isinstance(body["workers"], bool):
        body["workers"] %= coord.spec.max_workers + 1


def credential(coord, op, case) -> dict[str, str]:
    if "/hosts/" in op.path:
        return bearer(host_token(coord.token))
    if "{wid}" not in op.path:
        return bearer(coord.token)
    return bearer(worker_token(coord.token, (case.path_parameters or {}).get("wid")))


def test_fuzz_with_the_credential_never_fails_the_server(fuzzed):
    coord, url, schema, session = fuzzed
    answered: dict[str, set[int]] = {}
    for op in operations(schema):

        def check(case, known, op) -> None:
            steer(coord, case, known)
            drop_generated_credential(case)
            headers = credential(coord, op, case)
            resp = case.call(session=session, headers=headers, timeout=10)
            answered.setdefault(f"{op.method.upper()} {short_path(op)}", set()).add(
                resp.status_code
            )
            checks = [not_a_server_error]
            if 200 <= resp.status_code < 300:
                checks.append(response_schema_conformance)
            case.validate_response(resp, checks=checks, headers=headers)

        for mode in MODES if has_inputs(op) else MODES[:1]:
            run_given(check, case=op.as_strategy(mode), known=st.booleans(), op=st.just(op))
        assert_answering(url)  # after each operation's cases
    # the calls reached the handlers: each operation was answered 2xx at least once
    assert all(any(200 <= c < 300 for c in codes) for codes in answered.values()), answered
    assert len(answered) == len(OPERATIONS)
    # Stopped last; never started by a tick (none runs), though a member's fuzzed step
    # report of generation 1, with its own credential, rightly marks the job running. A
    # member's fuzzed failure report of kind script_mismatch rightly fails the job at once,
    # as do three fuzzed checkpoint failures in a row (``checkpoint_rules``), and a decided
    # job takes no stop.
    assert coord.status(fresh=True).state.value in ("pending", "running")
    if coord.job.outcome is None:
        assert coord.job.stop_requested_at is not None
    else:
        assert coord.job.outcome.value == "failed" and coord.job.stop_requested_at is None
        failed = [e.message for e in coord.status(fresh=True).events if e.kind == "job"]
        rightly = ("job failed: worker ", "job failed: 3 checkpoints in a row could not be written")
        assert any(m.startswith(rightly) for m in failed), failed


# -- the dashboard's routes (not in the schema: include_in_schema=False) ---------------------
names = st.one_of(st.just("served"), st.text(max_size=30))
numbers = st.one_of(st.integers(), st.text(max_size=12))


def test_fuzz_the_dashboard_routes_never_fails_the_server(fuzzed):
    _, url, _, _ = fuzzed
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as client:

        def check(name, a, b, asset) -> None:
            n = quote(name, safe="")
            for path, params in [
                (f"/dashboard/jobs/{n}", {"after": a, "steps_after": b}),
                (f"/dashboard/jobs/{n}/logs/{quote(str(a), safe='')}", {}),
                (f"/jobs/{n}", {}),
                (f"/dashboard/static/{quote(asset, safe='')}", {}),
                ("/dashboard/jobs", {"after": a}),
                ("/metrics", {}),
            ]:
                resp = client.get(path, params=params)
                assert resp.status_code < 500, f"{path} {params}: {resp.status_code}"

        run_given(check, 40, name=names, a=numbers, b=numbers, asset=st.text(max_size=20))
    assert_answering(url)
