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


# The folders of the two big packages, bottom to top (docs/architecture.md). A folder's
# modules import their own folder and the folders below it; ``__init__`` and the modules
# at the package's root sit in the first layer.
#
# The coordinator: what is written down, the process around it, the values a pass works on
# (and the executor), the pure rules over them, and the parts that compose the
# ``Coordinator``.
COORDINATOR_LAYERS: list[set[str]] = [
    {"records"},
    {"process"},
    {"job", "facts", "actions", "recovery", "executor", "__init__"},
    {"rules"},
    {"control"},
]
# The worker: mechanisms that know nothing of the ``Trainer`` below, its parts above them,
# and the ways into it from scripts written for other tools on top.
WORKER_LAYERS: list[set[str]] = [
    {"__init__", "probes", "waits"},  # what every folder may use
    {"agent"},  # the worker's link to the coordinator and the host's cloud watch
    {"batches"},  # the elastic sampler, the input pipeline, what members must agree on
    {"state"},  # the training state: the heal, its landing, durable checkpoints
    {"membership"},  # generations: groups, DDP and the control word, the abort watch
    {"sharded"},  # FSDP2 generations: layout, plan, neighbour copies, heal, checkpoint
    {"trainer"},  # the ``Trainer``'s parts, composed
    {"compat"},  # torchrun scripts and loops the script owns (``tidal.prepare``)
]
FOLDERS = {"coordinator": COORDINATOR_LAYERS, "worker": WORKER_LAYERS}


def _units(path: Path, package: str) -> set[str]:
    """The units of ``tidal.<package>`` that ``path`` imports: the folder or root module
    named after the package (``from tidal.worker import waits`` is ``waits``)."""
    found = set()
    prefix = ["tidal", package]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts == prefix:
                found |= {a.name for a in node.names}
            elif parts[:2] == prefix:
                found.add(parts[2])
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[:2] == prefix and len(parts) > 2:
                    found.add(parts[2])
    return found


def _folder_layer(package: str, unit: str) -> int:
    for i, layer in enumerate(FOLDERS[package]):
        if unit in layer:
            return i
    raise AssertionError(f"tidal.{package}.{unit} is in no {package.upper()}_LAYERS: add it")


def _folder_unit(package: str, path: Path) -> str:
    return path.relative_to(ROOT / package).parts[0].removesuffix(".py")


@pytest.mark.parametrize(
    "package,path",
    [(p, m) for p in FOLDERS for m in sorted((ROOT / p).rglob("*.py"))],
    ids=lambda x: x if isinstance(x, str) else str(x.relative_to(ROOT)),
)
def test_the_folders_import_downward(package: str, path: Path) -> None:
    me = _folder_layer(package, _folder_unit(package, path))
    for unit in _units(path, package):
        assert _folder_layer(package, unit) <= me, (
            f"tidal/{path.relative_to(ROOT)} imports tidal.{package}.{unit}, above it"
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
    bad.write_text(
        "from tidal.coordinator.control.loop import ControlLoop\n"
        "from tidal.worker import waits\nimport tidal.worker.trainer.step\n"
    )
    assert _units(bad, "coordinator") == {"control"}
    assert _units(bad, "worker") == {"waits", "trainer"}
    assert _folder_layer("coordinator", "control") > _folder_layer("coordinator", "records")
    assert _folder_layer("worker", "trainer") > _folder_layer("worker", "membership")
