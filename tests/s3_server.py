"""An S3-compatible server for the tests: moto's server mode, a real HTTP server in its own
process on 127.0.0.1 at a free port, and a TCP relay in front of it that a test can make
die mid-upload (``relay``). Credentials and the endpoint reach the code under test the way
they reach any S3 client: the standard AWS variables (``env``), set by the test only.

moto keeps its objects in its process's memory: a SIGKILLed moto comes back empty. To see
what a write cut by the store's death left behind, the test kills the relay (the endpoint
the writer talks to) and reads moto directly.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

RELAY = Path(__file__).with_name("tcp_relay.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL a process this module started (by its own handle), and reap it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


class Moto:
    """``python -m moto.server`` on 127.0.0.1 at a free port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_listening(self.port, self.proc)
        except BaseException:
            stop(self.proc)
            raise

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):  # noqa: ANN201 - a boto3 S3 client of this server
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def bucket(self) -> str:
        name = f"tidal-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix``: key -> size (listed by boto3, not by Tidal)."""
        found = {}
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        for page in pages:
            found |= {o["Key"]: o["Size"] for o in page.get("Contents", [])}
        return found

    def pending_uploads(self, bucket: str) -> list[str]:
        """Keys of multipart uploads begun and never completed nor aborted."""
        answer = self.client().list_multipart_uploads(Bucket=bucket)
        return [u["Key"] for u in answer.get("Uploads", [])]

    def close(self) -> None:
        stop(self.proc)


class Relay:
    """``tcp_relay.py``: 127.0.0.1:PORT forwarded to ``target``; with ``die_after``, the relay
    SIGKILLs itself once it has forwarded that many bytes towards the server (an endpoint
    that dies in the middle of an upload)."""

    def __init__(self, target: int, die_after: int | None = None) -> None:
        self.port = free_port()
        args = [str(self.port), str(target)] + ([str(die_after)] if die_after else [])
        self.proc = subprocess.Popen(
            [sys.executable, str(RELAY), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_listening(self.port, self.proc)
        except BaseException:
            stop(self.proc)
            raise

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        stop(self.proc)


def env(endpoint: str) -> dict[str, str]:
    """The variables an S3 client reads: test credentials and the endpoint (botocore's
    ``AWS_ENDPOINT_URL_S3``); no retries beyond botocore's first two (a dead endpoint is
    found in seconds)."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_MAX_ATTEMPTS": "2",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
