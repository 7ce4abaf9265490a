"""docs/architecture.md is a map of the code: every module it names exists, and every module
under ``tidal/`` is named there (``__init__.py`` files excepted, as the page says).

A module is named by its path in backticks, ``tidal/...py``, the format the page documents at
its top. Fast: reads files only."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
NAMED = re.compile(r"`(tidal/[A-Za-z0-9_/]+\.py)`")


def named_modules(text: str) -> set[str]:
    return set(NAMED.findall(text))


def package_modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tidal").rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def test_every_named_module_exists() -> None:
    missing = sorted(m for m in named_modules(PAGE.read_text()) if not (ROOT / m).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_module_is_named() -> None:
    unnamed = sorted(package_modules() - named_modules(PAGE.read_text()))
    assert not unnamed, f"modules not named in docs/architecture.md (add a line): {unnamed}"


def test_the_check_can_fail() -> None:
    # a page that no longer names a module, or names one that is gone, is caught
    text = PAGE.read_text().replace("`tidal/coordinator/control/wake.py`", "the wake module")
    assert "tidal/coordinator/control/wake.py" in package_modules() - named_modules(text)
    gone = named_modules(text + "\n`tidal/worker/no_such_module.py`")
    assert not (ROOT / "tidal/worker/no_such_module.py").exists()
    assert "tidal/worker/no_such_module.py" in gone


def test_every_decision_page_is_listed() -> None:
    decisions = ROOT / "docs" / "decisions"
    index = (decisions / "README.md").read_text()
    listed = set(re.findall(r"\]\(([a-z0-9-]+\.md)\)", index))
    pages = {p.name for p in decisions.glob("*.md") if p.name != "README.md"}
    assert pages - listed == set(), (
        f"decision pages not in docs/decisions/README.md: {pages - listed}"
    )
    assert listed - pages == set(), (
        f"docs/decisions/README.md lists missing pages: {listed - pages}"
    )
