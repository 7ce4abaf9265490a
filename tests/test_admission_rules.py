"""The pure rules of issue 50's findings 4 and 6 and the job-name item, as tables: which
request the coordinator admits from its headers alone (``host.admission.admit``), which
names are job names (``config.job_name_error``, ``home.job_dir``), and which failed loads
mark a checkpoint bad (``layout.marks_bad``). The real processes are in
``tests/test_request_admission.py`` and ``tests/test_mismatched_resume.py``."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tidal.checkpoint.layout import CheckpointError, CheckpointMismatch, marks_bad
from tidal.config import job_name_error
from tidal.coordinator.records.home import BadJobName, job_dir
from tidal.host.admission import BODY_LIMIT, WORKER_BODY_LIMIT, admit
from tidal.protocol import API_PREFIX, MAX_ID, worker_token

TOKEN = "t0ken"
JOB = f"Bearer {TOKEN}"
W3 = f"Bearer {worker_token(TOKEN, 3)}"
BASIC = "Basic " + base64.b64encode(f"me:{TOKEN}".encode()).decode()
ALLOWED = {"127.0.0.1", "localhost", "::1", "[::1]"}
S, H = API_PREFIX + "/scale", API_PREFIX + "/workers/3/heartbeat"

# (method, path, authorization, host, content-length, guarded) -> (status, body limit)
CASES = {
    "scale without a token": ("POST", S, None, "127.0.0.1:1", "52428800", False, 401, None),
    "scale, a worker's credential": ("POST", S, W3, None, "20", False, 401, None),
    "scale, Basic is no bearer": ("POST", S, BASIC, None, "20", False, 401, None),
    "scale with the token": ("POST", S, JOB, None, "20", False, None, BODY_LIMIT),
    "scale, the token, 50 MB": ("POST", S, JOB, None, "52428800", False, 413, None),
    "scale, the token, at the limit": (
        "POST",
        S,
        JOB,
        None,
        str(BODY_LIMIT),
        False,
        None,
        BODY_LIMIT,
    ),
    "scale, the token, chunked": ("POST", S, JOB, None, None, False, None, BODY_LIMIT),
    "scale, malformed length": ("POST", S, JOB, None, "12x", False, 400, None),
    "stop without a token": ("POST", API_PREFIX + "/stop", None, None, None, False, 401, None),
    "any other mutating call of the API": (
        "DELETE",
        API_PREFIX + "/status",
        None,
        None,
        None,
        False,
        401,
        None,
    ),
    "a mutating call of a page (405)": ("POST", "/", None, None, None, False, None, BODY_LIMIT),
    "a page, 50 MB": ("POST", "/jobs/x", None, None, "52428800", False, 413, None),
    "heartbeat, its worker's": ("POST", H, W3, None, "500", False, None, WORKER_BODY_LIMIT),
    "heartbeat, 50 MB, its worker's": ("POST", H, W3, None, "52428800", False, 413, None),
    "heartbeat, another worker's": (
        "POST",
        H,
        f"Bearer {worker_token(TOKEN, 4)}",
        None,
        None,
        False,
        401,
        None,
    ),
    "heartbeat, the job's token": ("POST", H, JOB, None, None, False, 401, None),
    "heartbeat, no token, 50 MB": ("POST", H, None, None, "52428800", False, 401, None),
    "role read, no token": (
        "GET",
        API_PREFIX + "/workers/3/role",
        None,
        None,
        None,
        False,
        401,
        None,
    ),
    "a path naming no worker": (
        "POST",
        API_PREFIX + "/workers/x/heartbeat",
        None,
        None,
        "9",
        False,
        None,
        BODY_LIMIT,
    ),
    "a worker id past MAX_ID": (
        "POST",
        f"{API_PREFIX}/workers/{MAX_ID + 1}/done",
        None,
        None,
        "9",
        False,
        None,
        BODY_LIMIT,
    ),
    "naming no worker, 50 MB": (
        "POST",
        API_PREFIX + "/workers/x/done",
        None,
        None,
        "52428800",
        False,
        413,
        None,
    ),
    "status on loopback": (
        "GET",
        API_PREFIX + "/status",
        None,
        "127.0.0.1:8",
        None,
        False,
        None,
        BODY_LIMIT,
    ),
    "status, localhost": (
        "GET",
        API_PREFIX + "/status",
        None,
        "localhost:8",
        None,
        False,
        None,
        BODY_LIMIT,
    ),
    "status, [::1]": (
        "GET",
        API_PREFIX + "/status",
        None,
        "[::1]:8",
        None,
        False,
        None,
        BODY_LIMIT,
    ),
    "status, no Host (HTTP/1.0)": (
        "GET",
        API_PREFIX + "/status",
        None,
        None,
        None,
        False,
        None,
        BODY_LIMIT,
    ),
    "status, a rebound name": (
        "GET",
        API_PREFIX + "/status",
        None,
        "evil.example:8",
        None,
        False,
        400,
        None,
    ),
    "dashboard, a rebound name": (
        "GET",
        "/dashboard/jobs",
        None,
        "evil.example",
        None,
        False,
        400,
        None,
    ),
    "HEAD, a rebound name": ("HEAD", "/metrics", None, "evil.example", None, False, 400, None),
    "guarded read, no token": (
        "GET",
        API_PREFIX + "/status",
        None,
        "10.0.0.5:8",
        None,
        True,
        401,
        None,
    ),
    "guarded read, bearer": (
        "GET",
        API_PREFIX + "/status",
        JOB,
        "10.0.0.5:8",
        None,
        True,
        None,
        BODY_LIMIT,
    ),
    "guarded read, Basic": ("GET", "/", BASIC, "node-3:8", None, True, None, BODY_LIMIT),
    "guarded read, a read with 50 MB": ("GET", "/", JOB, None, "52428800", True, 413, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_admit(case):
    method, path, auth, host, length, guarded, status, limit = CASES[case]
    verdict = admit(
        method,
        path,
        authorization=auth,
        host=host,
        content_length=length,
        token=TOKEN,
        guarded=guarded,
        allowed_hosts=ALLOWED,
    )
    assert verdict.status == status, verdict
    if status is None:
        assert verdict.body_limit == limit
    else:
        assert verdict.detail and "\n" not in verdict.detail
    if status == 401 and guarded:  # a browser is asked for the token
        assert dict(verdict.headers)["WWW-Authenticate"].startswith("Basic")


@pytest.mark.parametrize(
    "name, ok",
    [
        ("digits-1a2b", True),
        ("a", True),
        ("A.b_c-9", True),
        ("x" * 64, True),
        ("x" * 65, False),
        ("", False),
        (".hidden", False),
        ("..", False),
        ("../../B/jobs/x", False),
        ("a/b", False),
        ("/abs", False),
        ("x\n", False),  # ``$`` would match before a final newline
        ("a b", False),
        ("é", False),
        (None, False),
    ],
)
def test_job_names(name, ok, tmp_path):
    assert (job_name_error(name) is None) is ok
    if ok:
        assert job_dir(tmp_path, name).path == tmp_path / "jobs" / name
    else:
        with pytest.raises(BadJobName, match=r"^bad job name .*: use letters"):
            job_dir(tmp_path, name)


@pytest.mark.parametrize(
    "exc, bad",
    [
        (CheckpointError("checkpoint p refused: xxh3_128 mismatch in model.safetensors"), True),
        (CheckpointError("checkpoint p refused: the manifest has no table of files"), True),
        (CheckpointMismatch(Path("p"), "0.weight is torch.float64 [3, 3]"), False),
        (CheckpointMismatch("p", "it does not load (ValueError: param groups)"), False),
    ],
)
def test_only_a_damaged_checkpoint_is_marked_bad(exc, bad):
    assert marks_bad(exc) is bad
    if not bad:
        assert "refused, and kept: " in str(exc) and "\n" not in str(exc)
