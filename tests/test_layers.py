"""hcqa's modules import each other one way: no import cycle inside ``hcqa/``.

The layers themselves are import-linter contracts in pyproject.toml (``lint-imports``, run by
.ci/run). This test proves the stronger property those contracts don't: no cycle at all, between
any two modules, counting imports inside functions. Type-only imports (under ``TYPE_CHECKING``)
count too, except the few listed in ``TYPE_ONLY``: each names a higher module's public type in an
annotation where a Protocol would change what users read (``Fence.signal: Signal``,
``Buffer.device: Device``), and each must stay type-only and still exist. ``RUNTIME`` lists the
imports inside functions known to close a cycle, each to be broken by its package.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import grimp
import pytest

# importer -> imported, type-only, allowed to close a cycle (see the module doc)
TYPE_ONLY = {
    ("hcqa._signals.fence", "hcqa.signals"),  # Fence.signal: Signal
    ("hcqa.devices.base", "hcqa.queue"),  # Device.compute_queue() -> Queue
    ("hcqa.devices.buffer", "hcqa.devices.base"),  # Buffer.device: Device
    ("hcqa.devices.program", "hcqa.devices.base"),  # Program.device: Device
    ("hcqa.devices.timing", "hcqa.devices.base"),  # TimedSpan(device: Device, ...)
}

# importer -> imported, at run time (an import inside a function), known to close a cycle that
# its package's owners break; listed so that no new cycle slips in beside it
RUNTIME: set[tuple[str, str]] = set()


@functools.cache
def _graph(*, type_only: bool) -> grimp.ImportGraph:
    return grimp.build_graph(
        "hcqa",
        include_external_packages=False,
        exclude_type_checking_imports=not type_only,
        cache_dir=None,
    )


def _cycles(graph: grimp.ImportGraph, skip: Iterable[tuple[str, str]] = ()) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    skipped = set(skip)
    edges = {
        m: sorted(n for n in graph.find_modules_directly_imported_by(m) if (m, n) not in skipped)
        for m in graph.modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for m in ("a", "b", "c", "d"):
        graph.add_module(m)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")
    graph.add_import(importer="c", imported="d")
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles(graph, skip=[("c", "a")]) == []


def test_no_import_cycle_at_runtime() -> None:
    assert _cycles(_graph(type_only=False), skip=RUNTIME) == []


def test_no_import_cycle_counting_type_only_imports() -> None:
    assert _cycles(_graph(type_only=True), skip=TYPE_ONLY | RUNTIME) == []


@pytest.mark.parametrize(("importer", "imported"), sorted(RUNTIME))
def test_each_listed_runtime_import_still_exists(importer: str, imported: str) -> None:
    # once it is gone, drop it from RUNTIME
    assert _graph(type_only=False).direct_import_exists(importer=importer, imported=imported)


@pytest.mark.parametrize(("importer", "imported"), sorted(TYPE_ONLY))
def test_each_allowed_type_only_import_is_type_only(importer: str, imported: str) -> None:
    assert _graph(type_only=True).direct_import_exists(importer=importer, imported=imported)
    assert not _graph(type_only=False).direct_import_exists(importer=importer, imported=imported)
