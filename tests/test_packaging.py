"""What pip sees: the declared dependencies match what hcqa imports, and the metadata is there."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def _module_level_imports() -> set[str]:
    """Top-level modules imported at module level (not inside functions) anywhere in hcqa/."""
    found = set()
    for path in (ROOT / "hcqa").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"hcqa", "__future__"}


def test_every_module_level_import_is_a_declared_dependency() -> None:
    dists = importlib.metadata.packages_distributions()
    core = _names(PROJECT["dependencies"])
    undeclared = {
        mod: dists.get(mod, [mod])
        for mod in _module_level_imports()
        if not {d.lower() for d in dists.get(mod, [mod])} & core
    }
    assert undeclared == {}, "import these lazily or declare them in [project] dependencies"


def test_demo_only_dependencies_are_an_extra() -> None:
    extras = PROJECT["optional-dependencies"]
    assert "threadpoolctl" not in _names(PROJECT["dependencies"])
    assert "threadpoolctl" in _names(extras["demo"])
    assert "threadpoolctl" in _names(extras["test"])  # CI installs only .[test]


def test_license_and_authors_are_declared() -> None:
    assert PROJECT["license"] == "MIT"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "the hcqa developers" in text
    assert PROJECT["authors"]
    meta = importlib.metadata.metadata("hcqa")
    assert "MIT" in (meta.get("License-Expression") or meta.get("License") or "")
