"""The package's layers: every module imports only from its own layer or the ones below it
(function-level and type-checking imports included), read from the source with ``ast``.

A module that imports upward would make the lower layer depend on what it serves: the
coordinator on its dashboard or on worker code, the worker on the coordinator's server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tidal"

# Bottom to top; a top-level module or package of ``tidal`` may import its own and lower
# layers only. Packages of one layer are siblings: they import neither each other.
LAYERS: list[set[str]] = [
    {"backoff", "logconfig"},  # the retry loops' one wait rule; the log's one handler
    {"restarts", "preemption"},  # pure parsers and rules of settings: import nothing of tidal
    {"config", "protocol", "store_keys", "store_auth", "access", "tracked", "devices", "pids"}
    | {"hosts_protocol"},
    {"client", "policy", "sim", "checkpoint", "backends", "data", "metrics", "terminal"},
    {"coordinator", "worker", "hosts"},  # hosts: a joined host's agent (``tidal worker``)
    {"dashboard", "tensorboard", "display", "lookup", "tracking"},
    {"host", "testing"},
    {"cli", "launch", "attach_cli", "sim_cli", "worker_cli", "__init__"},
    {"__main__"},  # ``python -m tidal``: the command itself
]
SIBLINGS_MAY_IMPORT = {
    ("sim", "policy"),  # the simulator runs the policies' own code
    ("backends", "config"),
    ("checkpoint", "tracked"),
    ("dashboard", "tensorboard"),  # the recorder feeds TensorBoard
    ("display", "coordinator"),
    ("cli", "attach_cli"),
    ("cli", "launch"),
    ("cli", "sim_cli"),
    ("cli", "worker_cli"),
    ("hosts_protocol", "protocol"),  # the API's prefix and id bound
    ("hosts", "coordinator"),  # the agent's logs go where a job's logs go (``home.job_dir``)
    ("protocol", "config"),
    ("attach_cli", "cli"),
}


def _layer(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"tidal.{name} is in no layer of tests/test_layers.py: add it")


def _imports(path: Path, depth: int = 1) -> set[str]:
    """The ``tidal`` units ``path`` imports: ``tidal.X`` (``depth`` 1), or ``tidal.X.Y``
    (``depth`` 2, for the layers inside a package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tidal"):
            # ``from tidal import metrics`` imports tidal.metrics, not the package's __init__
            names = (
                [f"tidal.{a.name}" for a in node.names] if node.module == "tidal" else [node.module]
            )
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:
            parts = n.split(".")
            if parts[0] == "tidal":
                found.add(".".join(parts[1 : depth + 1]) if len(parts) > 1 else "__init__")
    return found


def _top(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0].removesuffix(".py")


MODULES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_downward(path: Path) -> None:
    me = _top(path)
    for other in _imports(path) - {me}:
        ok = _layer(other) < _layer(me) or (me, other) in SIBLINGS_MAY_IMPORT
        assert ok, f"tidal/{path.relative_to(ROOT)} imports tidal.{other}, which is not below it"


# The coordinator's folders, bottom to top (docs/architecture.md): what is written down,
# the process around it, the values a pass works on (and the executor), the pure rules
# over them, and the parts that compose the ``Coordinator``.
COORDINATOR_LAYERS: list[set[str]] = [
    {"records"},
    {"process"},
    {"job", "facts", "actions", "recovery", "executor", "__init__"},
    {"rules"},
    {"control"},
]


def _coordinator_unit(path: Path) -> str:
    rel = path.relative_to(ROOT / "coordinator").parts
    return rel[0].removesuffix(".py")


def _coordinator_layer(unit: str) -> int:
    for i, layer in enumerate(COORDINATOR_LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"tidal.coordinator.{unit} is in no COORDINATOR_LAYERS: add it")


@pytest.mark.parametrize("path", sorted((ROOT / "coordinator").rglob("*.py")), ids=lambda p: p.name)
def test_the_coordinators_folders_import_downward(path: Path) -> None:
    me = _coordinator_layer(_coordinator_unit(path))
    for name in _imports(path, depth=2):
        top, _, unit = name.partition(".")
        if top != "coordinator" or not unit:
            continue
        assert _coordinator_layer(unit) <= me, (
            f"tidal/{path.relative_to(ROOT)} imports tidal.coordinator.{unit}, above it"
        )


def test_the_coordinator_imports_no_dashboard_worker_or_host_code() -> None:
    for path in (ROOT / "coordinator").rglob("*.py"):
        bad = _imports(path) & {"dashboard", "worker", "host", "cli", "display", "tensorboard"}
        assert not bad, f"{path.name} imports {bad}"


def test_the_dashboard_takes_no_coordinator_lock() -> None:
    for path in (ROOT / "dashboard").rglob("*.py"):
        assert ".lock" not in path.read_text().replace("_lock", ""), path.name


def test_a_module_that_imports_upward_is_caught(tmp_path: Path) -> None:
    bad = tmp_path / "coordinator_like.py"
    bad.write_text(
        "def f():\n    from tidal.dashboard import app\n    import tidal.worker.agent.client\n"
    )
    assert _imports(bad) == {"dashboard", "worker"}
    bad.write_text("from tidal.coordinator.control.loop import ControlLoop\n")
    assert _imports(bad, depth=2) == {"coordinator.control"}
    assert _coordinator_layer("control") > _coordinator_layer("records")
