"""The Trainer is composed, not inherited (issue 53), read from the source with ``ast``.

- No class under ``tidal/`` has more than one base class defined in ``tidal/``: a class
  made of mixins shares one bag of attributes that every mixin writes. The exemptions below
  are classes still being taken apart; the list must only shrink.
- No module under ``tidal/`` reads another module's ``_private`` names: ``x._name`` where ``x`` is not ``self``/``cls`` and ``_name`` is not
  defined in the same module, or ``from tidal... import _name``. Parts talk through public
  attributes and methods. The third-party private names Tidal must reach (torch's
  internals, with no public equivalent) are listed below, each with its reason; a named
  tuple's ``_replace``/``_fields`` are its documented public API, not private names.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIDAL = ROOT / "tidal"

#: Classes allowed more than one tidal base: none since the coordinator's parts are composed
#: too (issue 53); kept so that an exception would have to be named here, with its reason.
MIXIN_EXEMPT: set[str] = set()

#: A named tuple's documented methods and attributes (``collections.namedtuple``).
NAMEDTUPLE_API = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}

#: (module, private name) pairs of other libraries' internals Tidal reads on purpose.
FOREIGN_PRIVATE = {
    # os._exit: leave without running atexit handlers (a worker, an actor, the supervisor)
    ("tidal/backends/ray_actor.py", "_exit"),
    ("tidal/coordinator/process/supervisor.py", "_exit"),
    # argparse's subparsers action: the type of ``add_subparsers``' result, for annotations
    ("tidal/attach_cli.py", "_SubParsersAction"),
    ("tidal/sim_cli.py", "_SubParsersAction"),
    ("tidal/worker_cli.py", "_SubParsersAction"),
    ("tidal/worker/agent/client.py", "_exit"),  # os._exit: leave without running atexit handlers
    (
        "tidal/worker/membership/busy.py",
        "_set_pg_timeout",
    ),  # c10d: a group's timeout, changed in place
    (
        "tidal/worker/membership/ddp.py",
        "_rebuild_buckets",
    ),  # DDP's bucket rebuild, made between steps
    # c10d's process-group registry and NCCL group calls: destroying and aborting a group
    # whose peer died without a collective (``group``).
    ("tidal/worker/membership/group.py", "_world"),
    ("tidal/worker/membership/group.py", "_set_default_timeout"),
    ("tidal/worker/membership/group.py", "_update_default_pg"),
    ("tidal/worker/membership/group.py", "_unregister_all_process_groups"),
    ("tidal/worker/membership/group.py", "_set_pg_timeout"),
    ("tidal/worker/membership/group.py", "_get_backend"),
    ("tidal/worker/membership/group.py", "_group_start"),
    ("tidal/worker/membership/group.py", "_group_end"),
    # DTensor's local shard: FSDP2's parameters and their optimizer state, row by row.
    ("tidal/worker/sharded/module.py", "_local_tensor"),
    # A tensor's version counter (in-place changes since a mark), a module's own parameter
    # and buffer dicts, and the fused copy the rewind uses (``tracked``).
    ("tidal/tracked.py", "_version"),
    ("tidal/tracked.py", "_parameters"),
    ("tidal/tracked.py", "_buffers"),
    ("tidal/tracked.py", "_foreach_copy_"),
}


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _classes() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Every class under tidal/, by name: (module, node)."""
    found: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for path in sorted(TIDAL.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append((_rel(path), node))
    return found


def _tidal_bases(node: ast.ClassDef, tidal_names: set[str]) -> list[str]:
    names = []
    for base in node.bases:
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if name in tidal_names:
            names.append(name)
    return names


def mixed_classes(exempt: set[str]) -> list[str]:
    """The classes under tidal/ with more than one tidal base, outside ``exempt``."""
    classes = _classes()
    bad = []
    for name, defs in classes.items():
        for module, node in defs:
            bases = _tidal_bases(node, set(classes))
            if len(bases) > 1 and f"{module}:{name}" not in exempt:
                bad.append(f"{module}:{name}({', '.join(bases)})")
    return bad


def _own_names(tree: ast.Module) -> set[str]:
    """The private names a module defines itself: functions, classes, and attributes it
    assigns (``self._x = ...``, class-level ``_x``, dataclass fields)."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
    return {n for n in own if n.startswith("_")}


def private_uses(source: str, rel: str) -> list[tuple[str, str]]:
    """Where a module reads another module's private name (module doc), before the
    exemptions: (``rel:line: what``, the name)."""
    tree = ast.parse(source)
    own = _own_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in own:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append((f"{rel}:{node.lineno}: {ast.unparse(node)}", name))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tidal"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    where = f"{rel}:{node.lineno}: from {node.module} import {alias.name}"
                    found.append((where, alias.name))
    return found


def _uses() -> list[tuple[str, str, str]]:
    return [
        (_rel(path), where, name)
        for path in sorted(TIDAL.rglob("*.py"))
        for where, name in private_uses(path.read_text(), _rel(path))
        if name not in NAMEDTUPLE_API
    ]


def test_no_class_is_made_of_several_tidal_classes() -> None:
    bad = mixed_classes(MIXIN_EXEMPT)
    assert not bad, f"classes made of mixins (compose parts instead): {bad}"


def test_the_mixin_exemptions_still_exist_and_still_need_it() -> None:
    """An exemption whose class is gone or composed now is removed from the list."""
    still = {entry.split("(")[0] for entry in mixed_classes(set())}
    assert still >= MIXIN_EXEMPT, f"remove from MIXIN_EXEMPT: {MIXIN_EXEMPT - still}"


def test_the_trainer_has_no_tidal_base_class() -> None:
    classes = _classes()
    ((module, node),) = [(m, n) for m, n in classes["Trainer"] if m.endswith("runtime.py")]
    assert _tidal_bases(node, set(classes)) == [], module


def test_no_module_reads_another_modules_private_names() -> None:
    bad = [where for rel, where, name in _uses() if (rel, name) not in FOREIGN_PRIVATE]
    assert not bad, "private names read across modules:\n" + "\n".join(bad)


def test_every_foreign_exemption_is_still_used() -> None:
    stale = FOREIGN_PRIVATE - {(rel, name) for rel, _, name in _uses()}
    assert not stale, f"remove from FOREIGN_PRIVATE: {stale}"


def test_the_checks_can_fail() -> None:
    """Each rule finds what it forbids in a module written for it."""
    source = (
        "from tidal.worker.state.heal import _hidden\n"
        "class A: pass\nclass B: pass\nclass C(A, B): pass\n"
        "def f(trainer):\n    return trainer._members\n"
        "class D:\n    def g(self):\n        self._own = 1\n        return self._own, other._own\n"
    )
    tree = ast.parse(source)
    (c,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "C"]
    assert _tidal_bases(c, {"A", "B", "C"}) == ["A", "B"]
    found = sorted(name for _, name in private_uses(source, "probe.py"))
    assert found == ["_hidden", "_members"], found  # ``other._own``: defined in the module
