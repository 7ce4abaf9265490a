"""Fixtures of the end-to-end tests (see ``e2e_helpers``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from e2e_helpers import Home, hook_errors, standalone_params
from s3_server import Moto
from s3_server import env as s3_env

from tidal.config import JobSpec
from tidal.coordinator.control.controller import Coordinator
from tidal.host.server import ApiServer

#: The devices a device-dependent test runs on: the CPU always; a GPU where CUDA exists
#: (marked ``gpu``: ``pytest -m gpu`` runs those alone).
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ],
    ),
]


@pytest.fixture(autouse=True)
def tidal_records_reach_caplog() -> Iterator[None]:
    """The ``tidal`` logger does not propagate (``tidal.logconfig``: a script's own root
    handler would print each line twice); in tests it does, so that ``caplog`` (a handler on
    the root logger) sees Tidal's records. Its own handler still writes the lines."""
    logger = logging.getLogger("tidal")
    before = logger.propagate
    logger.propagate = True
    yield
    logger.propagate = before


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device a device-parametrized test runs on (``DEVICES``)."""
    return request.param


@pytest.fixture
def tidal_home(tmp_path: Path) -> Iterator[Home]:
    """A fresh ``--home``; whatever happens in the test, no process it started survives it."""
    home = Home(tmp_path / "home")
    try:
        yield home
    finally:
        home.cleanup()
    if errors := hook_errors(tmp_path):
        pytest.fail(f"a test hook failed to import in a process the test started:\n{errors}")


@pytest.fixture(scope="session")
def reference_params(tmp_path_factory: pytest.TempPathFactory):
    """``reference_params(steps, seed, double=False)``: the path of the parameters a plain
    one-worker run saves after ``steps`` digits steps (``--double``: in float64); each
    (steps, seed, double) is trained once a session."""
    root = tmp_path_factory.mktemp("reference")
    cache: dict[tuple[int, int, bool], Path] = {}

    def get(steps: int, seed: int = 0, double: bool = False) -> Path:
        key = (steps, seed, double)
        if key not in cache:
            tag = f"{steps}-{seed}" + ("-f64" if double else "")
            args = ["--max-steps", str(steps), "--seed", str(seed)] + (
                ["--double"] if double else []
            )
            cache[key] = standalone_params(root / f"ref-{tag}.safetensors", *args)
        return cache[key]

    return get


@pytest.fixture
def served_coordinator(tmp_path: Path) -> Iterator[tuple[Coordinator, str]]:
    """A real coordinator and its HTTP server that never ticks (no worker is started):
    ``(coordinator, base URL)``."""
    spec = JobSpec(name="served", script=str(tmp_path / "x.py"), workers=1, max_workers=2)
    coord = Coordinator(spec, tmp_path)
    server = ApiServer(coord)
    coord.url = server.url
    coord.flush()  # as the loop's first pass would: the status names the URL
    server.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    try:
        yield coord, server.url
    finally:
        server.stop()
        coord.close()


_PROBE = r"""
import json, sys, torch
from tidal.worker.state import cma
t, hold = torch.arange(8, dtype=torch.float64), cma.Hold()
print(json.dumps(cma.offer([t], hold) if cma.offerable([t]) else None), flush=True)
sys.stdin.readline()
"""


@pytest.fixture(scope="session")
def cross_memory() -> bool:
    """Whether this machine lets a process read another's memory (``worker/state/cma.py``): the
    heal's same-host path. Where the kernel refuses (no ptrace right, a seccomp profile
    without ``process_vm_readv``), the tests of that path skip and the group's path is the
    one tested."""
    import json
    import subprocess
    import sys

    from tidal.worker.state import cma

    src = subprocess.Popen(
        [sys.executable, "-c", _PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        offer = json.loads(src.stdout.readline())
        if offer is None:
            return False
        mine = torch.zeros(8, dtype=torch.float64)
        try:
            cma.read(offer, [mine])
        except OSError:
            return False
        return mine.tolist() == list(range(8))
    finally:
        src.stdin.close()
        src.wait(timeout=30)


# -- an S3-compatible server (moto's server mode; ``s3_server``) ------------------------------
@pytest.fixture(scope="session")
def moto_server() -> Iterator[Moto]:
    """One moto server for the session; each test takes its own bucket (``s3``)."""
    server = Moto()
    try:
        yield server
    finally:
        server.close()


@dataclass
class S3:
    moto: Moto
    bucket: str

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])

    def use(self, monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
        """Point this process's S3 clients (and the processes it starts) at ``endpoint``."""
        for name, value in s3_env(endpoint).items():
            monkeypatch.setenv(name, value)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # a client made for another endpoint


@pytest.fixture
def s3(moto_server: Moto, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """A fresh bucket on the session's moto server; this process's S3 clients (and the
    processes it starts) reach it through the standard AWS variables."""
    store = S3(moto=moto_server, bucket=moto_server.bucket())
    store.use(monkeypatch, moto_server.endpoint)
    yield store
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
