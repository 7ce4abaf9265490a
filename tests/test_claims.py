"""Claims the README makes that a reader can check, checked: the torch version it names is
the one the tests run on, and nothing in the package unpickles."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
#: What would load a pickle: the unpickler, torch's loader (weights-only or not), NumPy's
#: loader allowed to unpickle, and ``torch.save``, whose bytes only a pickle loader reads.
LOADERS = re.compile(
    r"\bimport pickle\b|\bpickle\.loads?\(|\btorch\.load\(|\btorch\.save\(|allow_pickle\s*=\s*True"
    r"|\bcloudpickle\b|\bdill\b|\bjoblib\.load\("
)


def test_the_torch_version_the_readme_names_is_the_one_tested():
    (named,) = set(re.findall(r"torch==([0-9.]+)", (ROOT / "README.md").read_text()))
    assert torch.__version__.split("+")[0] == named
    assert f"torch=={named}" in (ROOT / ".ci" / "run").read_text()


def test_nothing_in_the_package_loads_or_writes_a_pickle():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "tidal").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if LOADERS.search(line.split("#", 1)[0])
    ]
    assert not found, "\n".join(found)
