"""Fixtures of the end-to-end tests (see ``e2e_helpers``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import Home


@pytest.fixture
def tidal_home(tmp_path: Path) -> Iterator[Home]:
    """A fresh ``--home``; whatever happens in the test, no process it started survives it."""
    home = Home(tmp_path / "home")
    try:
        yield home
    finally:
        home.cleanup()


@pytest.fixture(scope="session")
def reference_params(tmp_path_factory: pytest.TempPathFactory):
    """``reference_params(steps, seed)``: the path of the parameters a plain ``--workers 1``
    job saves after ``steps`` digits steps; each (steps, seed) is trained once a session."""
    root = tmp_path_factory.mktemp("reference")
    cache: dict[tuple[int, int], Path] = {}
    homes: list[Home] = []

    def get(steps: int, seed: int = 0) -> Path:
        if (steps, seed) not in cache:
            home = Home(root / f"home-{steps}-{seed}")
            homes.append(home)
            out = root / f"ref-{steps}-{seed}.safetensors"
            proc, job = home.run(
                "ref",
                "--workers",
                "1",
                script_args=["--max-steps", str(steps), "--seed", str(seed), "--save", str(out)],
            )
            assert proc.returncode == 0, f"{proc.stderr}\n{job.logs_tail()}"
            assert out.is_file(), job.logs_tail()
            cache[(steps, seed)] = out
        return cache[(steps, seed)]

    try:
        yield get
    finally:
        for home in homes:
            home.cleanup()
