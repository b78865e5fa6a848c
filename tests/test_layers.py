"""hcqa's modules import each other one way: no import cycle inside ``hcqa/``.

The layers themselves are import-linter contracts in pyproject.toml (``lint-imports``, run by
.ci/run). This test proves the stronger property those contracts don't: no cycle at all, between
any two modules, counting imports inside functions and type-only imports (under
``TYPE_CHECKING``), with nothing allowed. A lower module that must name a higher one's type
names it through a Protocol (``Buffer.device: DeviceRef``, ``Fence.signal: SignalRef``,
``Device.compute_queue() -> QueueBuilder``).
"""

from __future__ import annotations

import functools

import grimp


@functools.cache
def _graph(*, type_only: bool) -> grimp.ImportGraph:
    return grimp.build_graph(
        "hcqa",
        include_external_packages=False,
        exclude_type_checking_imports=not type_only,
        cache_dir=None,
    )


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
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
    graph.remove_import(importer="c", imported="a")
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_type_only_cycle_in_hcqa() -> None:
    # the graph counts type-only imports: one added from the device core up to the builder
    # (what Device.compute_queue() -> Queue was) closes a cycle the test must see
    graph = _graph.__wrapped__(type_only=True)  # a fresh graph: the cached one stays as built
    graph.add_import(importer="hcqa.devices.base", imported="hcqa.queue")
    assert any("hcqa.devices.base" in c and "hcqa.queue" in c for c in _cycles(graph))


def test_no_import_cycle_at_runtime() -> None:
    assert _cycles(_graph(type_only=False)) == []


def test_no_import_cycle_counting_type_only_imports() -> None:
    assert _cycles(_graph(type_only=True)) == []
