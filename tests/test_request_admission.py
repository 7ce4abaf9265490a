"""Requests refused from their headers, before their body is read (issue 50, finding 6 and the
moderate items beside it), against a real coordinator started by the real CLI.

Before: FastAPI parsed a body before the route's dependency checked the token, so a 100 MB
``[{},...]`` POSTed to ``/api/v1/scale`` with no token froze the coordinator for 17 s and took
its memory from 0.19 to 2.9 GB before its 401. Now (``tidal.host.admission``): a 50 MB body
without a token is refused in under 1 s (its own ``Content-Length`` or chunked) and the
coordinator's memory (``VmRSS``, sampled every few ms from ``/proc``) grows by less than
100 MB; one with the token is refused by its size (413); a read whose ``Host`` names another
server is refused (400, ``/api/v1/status`` included); and no command takes a job name that is
not one (``tidal --home A scale ../../B/jobs/x 1`` scaled B's job).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from e2e_helpers import Home

from tidal.protocol import API_PREFIX, worker_token

MB = 1 << 20
BODY_BYTES = 50 * MB

SLOW = """
import sys, time, torch, tidal
from torch.utils.data import TensorDataset
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
trainer = tidal.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), data,
                        global_batch_size=8)
for step in trainer.run(int(sys.argv[1])):
    for x, y in step.micro_batches():
        step.backward(torch.nn.functional.mse_loss(trainer.model(x), y))
    time.sleep(0.05)  # a light job: the coordinator, not the worker, is under test
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Home, dict]]:
    """One running job for the module: ``(home, coordinator.json)``."""
    root = tmp_path_factory.mktemp("admission")
    script = root / "slow.py"
    script.write_text(SLOW)
    home = Home(root / "home")
    try:
        job = home.start("guarded", "--workers", "1", script=script, script_args=["1000000"])
        job.wait_running(min_step=2, timeout=120)
        info = job.coordinator_info()
        assert info is not None
        yield home, info
    finally:
        home.cleanup()


def rss(pid: int) -> int:
    """The process's resident memory, bytes (``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Peak:
    """The highest ``rss(pid)`` seen while in the ``with`` block, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.before, self.peak = pid, rss(pid), 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss(self.pid))
            time.sleep(0.005)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)  # what a late parse would still take
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.before


def json_list_body(total: int) -> Iterator[bytes]:
    """``[{},{},...,{}]`` (valid JSON, what the probe sent) of exactly ``total`` bytes, about
    1 MB at a time."""
    items, pad = divmod(total - 4, 3)  # "[" + "{}," * items + "{}" + pad spaces + "]"
    yield b"["
    per_chunk = MB // 3
    while items > 0:
        n = min(items, per_chunk)
        yield b"{}," * n
        items -= n
    yield b"{}" + b" " * pad + b"]"


def test_the_probe_body_is_json_of_its_size():
    body = b"".join(json_list_body(MB + 5))
    assert len(body) == MB + 5 and json.loads(body) == [{}] * ((MB + 1) // 3 + 1)


def post_raw(
    url: str, path: str, *, headers: dict[str, str], total: int, chunked: bool = False
) -> tuple[int, dict, float]:
    """POST a ``total``-byte body over a raw socket, sending on a thread while this one waits
    for the answer: ``(status, JSON body, seconds from the first byte sent to the answer)``.
    A server that answers before reading the body is seen answering then."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + f"{framing}\r\n\r\n"
    ).encode()

    def send() -> None:
        try:
            sock.sendall(head)
            for chunk in json_list_body(total):
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked else chunk)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server closed: it has answered

    started = time.monotonic()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    answer = b""
    try:
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            assert data, f"connection closed without an answer: {answer!r}"
            answer += data
        elapsed = time.monotonic() - started
        head_text, _, body = answer.partition(b"\r\n\r\n")
        lines = head_text.decode("latin-1").split("\r\n")
        fields = dict(line.split(": ", 1) for line in lines[1:])
        length = int(fields.get("content-length", "0"))
        while len(body) < length:
            data = sock.recv(65536)
            assert data, "connection closed in the answer's body"
            body += data
        sender.join(timeout=30)  # the rest of the body, drained by the server
    finally:
        sock.close()
    return int(lines[0].split()[1]), json.loads(body[:length]), elapsed


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_50mb_body_without_a_token_is_refused_in_under_a_second(live, chunked):
    home, info = live
    with Peak(info["pid"]) as mem:
        status, body, elapsed = post_raw(
            info["url"], API_PREFIX + "/scale", headers={}, total=BODY_BYTES, chunked=chunked
        )
    print(
        f"50 MB unauthenticated ({'chunked' if chunked else 'Content-Length'}): {status} in "
        f"{elapsed * 1000:.0f} ms, coordinator RSS {mem.before / MB:.0f} MB -> peak "
        f"{mem.peak / MB:.0f} MB"
    )
    assert status == 401 and body == {"detail": "missing or wrong job token"}, body
    assert elapsed < 1.0, f"refused after {elapsed:.2f} s"
    assert mem.growth < 100 * MB, f"the coordinator grew by {mem.growth / MB:.0f} MB"
    # the same for a worker's call with another's credential
    wrong = {"Authorization": f"Bearer {worker_token(info['token'], 1)}"}
    status, body, elapsed = post_raw(
        info["url"], API_PREFIX + "/workers/0/heartbeat", headers=wrong, total=BODY_BYTES
    )
    assert status == 401 and "worker 0" in body["detail"] and elapsed < 1.0, (body, elapsed)
    answer = httpx.get(info["url"] + API_PREFIX + "/status", timeout=5)  # still answering
    assert answer.status_code == 200 and answer.json()["state"] == "running"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_50mb_body_with_the_token_is_refused_by_its_size(live, chunked):
    home, info = live
    before = httpx.get(info["url"] + API_PREFIX + "/status", timeout=5).json()["target_workers"]
    auth = {"Authorization": f"Bearer {info['token']}"}
    with Peak(info["pid"]) as mem:
        status, body, elapsed = post_raw(
            info["url"], API_PREFIX + "/scale", headers=auth, total=BODY_BYTES, chunked=chunked
        )
    assert status == 413, body
    assert elapsed < 1.0 and mem.growth < 100 * MB, (elapsed, mem.growth / MB)
    after = httpx.get(info["url"] + API_PREFIX + "/status", timeout=5).json()["target_workers"]
    assert after == before


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_read_on_loopback_checks_the_host_header(live):
    home, info = live
    for path in (API_PREFIX + "/status", "/metrics", "/openapi.json", "/dashboard/jobs"):
        evil = httpx.get(info["url"] + path, headers={"Host": "evil.example"}, timeout=5)
        assert evil.status_code == 400, (path, evil.status_code)
        assert evil.json() == {"detail": "unexpected Host header 'evil.example'"}
        assert httpx.get(info["url"] + path, timeout=5).status_code == 200, path
    port = urlsplit(info["url"]).port
    assert httpx.get(f"http://localhost:{port}{API_PREFIX}/status", timeout=5).status_code == 200


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_no_command_takes_a_path_for_a_job_name(live, tmp_path):
    home, info = live
    other = Home(home.path.parent / "a")  # a home A beside B: the escape lands on B's job
    (other.path / "jobs").mkdir(parents=True, exist_ok=True)
    escape = f"../../{home.path.name}/jobs/guarded"
    assert (other.path / "jobs" / escape).resolve() == (home.path / "jobs" / "guarded")
    before = httpx.get(info["url"] + API_PREFIX + "/status", timeout=5).json()
    for args in (
        ("scale", escape, "1"),  # the target it has: before, accepted (exit 0)
        ("stop", escape),
        ("status", escape),
        ("logs", escape),
        ("attach", escape),
        ("resume", escape),
        ("dashboard", escape),
    ):
        proc = other.cli(*args, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, (args, proc.stderr)
        assert lines[0] == f"tidal: error: bad job name {escape!r}: use letters, digits, " + (
            "'.', '_' or '-' (at most 64)"
        ), (args, lines)
    after = httpx.get(info["url"] + API_PREFIX + "/status", timeout=5).json()
    assert after["state"] == "running"
    assert after["target_workers"] == before["target_workers"] == 1
