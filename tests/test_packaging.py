"""What pip sees: the declared dependencies match what hcqa imports, and the metadata is there."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _normal(name: str) -> str:
    """A name as PEP 503 compares them: ``prometheus_client`` is ``prometheus-client``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: list[str]) -> set[str]:
    return {_normal(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in requirements}


# Subpackages that are an optional extra: their imports may come from that extra, and
# nothing outside them may import them at module level (the core imports without it).
EXTRA_PACKAGES = {
    "ray": "ray",
    "serve": "serve",
    "devices/opencl": "opencl",
    "models": "models",
}  # hcqa/ray/ -> [ray]

# Modules of those subpackages imported only inside the call that needs them, never by the
# subpackage's import: their own imports are not what the subpackage pulls in (held by
# test_modules_imported_on_request_stay_out_of_their_packages_import).
ON_REQUEST = {"serve/hypercorn_worker.py"}  # serve(http="hypercorn") only


def _extra_of(path: Path) -> str | None:
    """The extra whose subpackage holds ``path`` (None: the core)."""
    rel = path.relative_to(ROOT / "hcqa").as_posix()
    for package, extra in EXTRA_PACKAGES.items():
        if rel.startswith(package + "/"):
            return extra
    return None


def _module_level_imports(extra: str | None = None) -> set[str]:
    """Top-level modules imported at module level (not inside functions) in hcqa/: outside
    the extras' subpackages, or (``extra``) inside that extra's subpackage."""
    found = set()
    for path in (ROOT / "hcqa").rglob("*.py"):
        if _extra_of(path) != extra or path.relative_to(ROOT / "hcqa").as_posix() in ON_REQUEST:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"hcqa", "__future__"}


def _undeclared(imports: set[str], declared: set[str]) -> dict[str, list[str]]:
    dists = importlib.metadata.packages_distributions()
    return {
        mod: dists.get(mod, [mod])
        for mod in imports
        if not {_normal(d) for d in dists.get(mod, [mod])} & declared
    }


def test_every_module_level_import_is_a_declared_dependency() -> None:
    core = _names(PROJECT["dependencies"])
    undeclared = _undeclared(_module_level_imports(), core)
    assert undeclared == {}, "import these lazily or declare them in [project] dependencies"
    for extra in set(EXTRA_PACKAGES.values()):
        declared = core | _names(PROJECT["optional-dependencies"][extra])
        assert _undeclared(_module_level_imports(extra), declared) == {}, extra


def test_the_core_imports_without_the_extras() -> None:
    code = "import sys, hcqa, hcqa.aio, hcqa.processes; print(sorted(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = set(ast.literal_eval(out.stdout))
    assert {"ray", "hcqa.ray", "starlette", "prometheus_client", "hcqa.serve"} & modules == set()
    assert {"pyopencl", "hcqa.devices.opencl"} & modules == set()  # opened on first use only


def test_opencl_is_an_extra_that_ci_installs() -> None:
    extras = PROJECT["optional-dependencies"]
    opencl = {"pyopencl", "pocl-binary-distribution"}
    assert opencl & _names(PROJECT["dependencies"]) == set()
    assert opencl <= _names(extras["opencl"])
    assert opencl <= _names(extras["test"])  # CI installs only .[test]: every OpenCL test runs


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


# Where users read install lines: the docs, the examples, docstrings, messages, the benchmarks.
_TEXT_DIRS = ("docs", "examples", "hcqa", "bench", "tools", "tests", ".ci")
_INDEX_INSTALL = re.compile(r"""pip install\s+(-U\s+)?['"]?hcqa\b|hcqa\[""")
_CHECKOUT_INSTALL = re.compile(r"""pip install -e ['"]?\.\[([a-z0-9_,-]+)\]""")


def _user_text() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in _TEXT_DIRS:
        files += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and (p.suffix in (".py", ".md", ".toml", ".txt") or p.name == "run")
        ]
    return files


def test_install_lines_work_from_a_checkout() -> None:
    # hcqa is on no package index: installing it by name fails in a fresh venv. Every
    # install line must be the checkout's (`pip install -e '.[serve]'`), naming a real extra.
    extras = set(PROJECT["optional-dependencies"])
    index_lines: list[str] = []
    unknown: list[str] = []
    for path in _user_text():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            if _INDEX_INSTALL.search(line):
                index_lines.append(where)
            for m in _CHECKOUT_INSTALL.finditer(line):
                unknown += [f"{where} ({e})" for e in m[1].split(",") if e not in extras]
    assert index_lines == [], "install lines that need a package index:\n" + "\n".join(index_lines)
    assert unknown == [], "install lines naming no extra of pyproject.toml:\n" + "\n".join(unknown)


def test_messages_name_the_checkout_install() -> None:
    from hcqa.errors import install_hint

    assert install_hint("plot") == "pip install -e '.[plot]' in the hcqa checkout"
    assert _CHECKOUT_INSTALL.search(install_hint("serve"))


def _closure(names: set[str]) -> set[str]:
    """``names`` and every distribution they require, transitively (as installed here)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [r for r in _names([r for r in reqs if "extra ==" not in r])]
    return seen


def _imports_of(tree: ast.Module) -> set[str]:
    """Top-level modules a script imports when it starts (its body, and try blocks in it)."""
    found: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, ast.Try):
            body += node.body
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_an_examples_install_line_installs_what_it_imports(example: str) -> None:
    # The example says what to install ("pip install -e '.[asyncio]'"); with exactly that, it
    # must start: every module it imports, and every one its hcqa subpackages import.
    tree = ast.parse((ROOT / "examples" / example).read_text())
    doc = ast.get_docstring(tree) or ""
    wanted = {e for m in _CHECKOUT_INSTALL.finditer(doc) for e in m[1].split(",")}
    plain = {_normal(n) for n in re.findall(r"pip install ([a-z][a-z0-9_-]+)\b", doc)}
    declared = _names(PROJECT["dependencies"]) | plain
    for extra in wanted:
        declared |= _names(PROJECT["optional-dependencies"][extra])
    declared = _closure(declared)
    modules = _imports_of(tree)
    top = {m.split(".")[0] for m in modules}
    for package, extra in EXTRA_PACKAGES.items():  # hcqa.serve pulls in what serve imports
        if any(
            m == "hcqa." + package.replace("/", ".")
            or m.startswith("hcqa." + package.replace("/", ".") + ".")
            for m in modules
        ):
            top |= _module_level_imports(extra)
    top -= set(sys.stdlib_module_names) | {"hcqa", "__future__"}
    missing = _undeclared(top, declared)
    assert missing == {}, f"{example}: its install line ({sorted(wanted | plain)}) lacks these"


def test_modules_imported_on_request_stay_out_of_their_packages_import() -> None:
    names = sorted("hcqa." + m.removesuffix(".py").replace("/", ".") for m in ON_REQUEST)
    packages = sorted({n.rsplit(".", 1)[0] for n in names})
    code = f"import sys, {', '.join(packages)}; print([n for n in {names!r} if n in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
