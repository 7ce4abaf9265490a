"""``tidal scale`` / ``tidal stop`` whose coordinator goes away mid-call: one line saying whether
the change may have been applied, never httpx's traceback (issue 50, moderate).

The real CLI in a subprocess talks to a real socket peer in this process that answers the
CLI's first call (the status that finds a running coordinator) and then, as a coordinator
killed mid-request does, reads the mutating request and closes the connection unanswered,
or is gone before the request (refused).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tidal.lookup import lost_call_line
from tidal.protocol import JobStatus

ROOT = Path(__file__).resolve().parents[1]


def _status_body() -> bytes:
    return (
        JobStatus(
            name="j",
            state="running",
            step=3,
            world_size=2,
            target_workers=2,
            min_workers=1,
            max_workers=4,
            script="s.py",
            created=1.0,
        )
        .model_dump_json()
        .encode()
    )


class DyingCoordinator:
    """Answers GET /status; then reads the next request and drops it (``mid_request``), or
    stops listening before it (not ``mid_request``)."""

    def __init__(self, *, mid_request: bool) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.mid_request = mid_request
        self.got: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _read_request(self, conn: socket.socket) -> str:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return ""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        while len(body) < length:
            body += conn.recv(65536)
        return head.split(b"\r\n")[0].decode()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            self.got.append(self._read_request(conn))
            body = _status_body()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            if not self.mid_request:
                self.sock.close()  # gone before the next request: nobody listens
                return
            self.got.append(self._read_request(conn))  # the mutating call arrives ...
        self.sock.close()  # ... and the coordinator dies without answering


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    return subprocess.run(
        [sys.executable, "-m", "tidal.cli", args[0], "--home", str(home), *args[1:]],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _home_for(tmp_path: Path, url: str) -> Path:
    home = tmp_path / "home"
    jd = home / "jobs" / "j"
    jd.mkdir(parents=True)
    record = {"url": url, "token": "t" * 32, "pid": os.getpid(), "supervisor_pid": None}
    (jd / "coordinator.json").write_text(json.dumps(record))
    return home


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cmd", "mid_request", "says"),
    [
        (("scale", "j", "4"), True, "the scale to 4 workers may or may not have been applied"),
        (("stop", "j"), True, "the stop may or may not have been applied"),
        (("scale", "j", "3"), False, "the scale to 3 workers was not applied"),
    ],
)
def test_a_coordinator_lost_mid_call_is_one_line(tmp_path, cmd, mid_request, says) -> None:
    peer = DyingCoordinator(mid_request=mid_request)
    proc = _cli(_home_for(tmp_path, peer.url), *cmd)
    peer.thread.join(10)
    assert proc.returncode == 1, proc
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("tidal: error: job 'j': its coordinator"), proc.stderr
    assert says in proc.stderr and "`tidal status j`" in proc.stderr, proc.stderr
    assert peer.got[0].startswith("GET /api/v1/status"), peer.got
    if mid_request:
        assert peer.got[1].startswith(f"POST /api/v1/{cmd[0]}"), peer.got


@pytest.mark.parametrize("sent", [True, False])
def test_lost_call_line(sent: bool) -> None:
    line = lost_call_line("j", "stop", sent=sent, why="ReadError")
    assert ("may or may not have been applied" in line) is sent
    assert ("was not applied" in line) is not sent
    assert "(ReadError)" in line and "\n" not in line
