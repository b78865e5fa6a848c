"""The docs and the product in step, where a test can hold them: every device kind a doc
names opens here (or is skipped, with the product's own reason, where its extra, driver or
GPU is missing -- a GPU run covers it), a
kind that opens is never called "planned", every device spec in a docstring is one that
``parse_spec`` accepts and whose backend exists, and serving.md's access-log sample has the
shape of a line the server really writes, and the README's commands each make an
environment of their own.

(Every ```python block of the docs is run by ``test_docs.py``.)
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import trio

import hcqa
from hcqa.devices import backends

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a device spec as the docs write it: `cpu:N`, `opencl:0`, "cpu:1", open_device("cuda:0")
SPEC = re.compile(r"""[`"']([a-z][a-z0-9_]*):(N|\d+)(?:#\d+)?[`"']""")


def _doc_kinds() -> dict[str, list[str]]:
    """Each device kind the docs name, with the clauses that name it (a line cut at
    '.', ';' and '|': a table cell or a clause of a sentence)."""
    named: dict[str, list[str]] = {}
    for path in DOCS:
        for line in path.read_text().splitlines():
            for clause in re.split(r"(?<!\w)\.(?!\w)|[;|]", line):
                for kind in dict.fromkeys(
                    m.group(1)
                    for m in SPEC.finditer(clause)
                    if m.group(2) == "N" or m.group(1) in backends.kinds()  # not `mlp:256`
                ):
                    named.setdefault(kind, []).append(f"{path.name}: {clause.strip()}")
    return named


NAMED = _doc_kinds()


def _exists(kind: str) -> bool:
    """Whether ``kind`` is registered and its backend's module is in this hcqa."""
    if kind not in backends.kinds():
        return False
    module = backends._BACKENDS[kind].target.partition(":")[0]
    return importlib.util.find_spec(module) is not None


def test_the_docs_name_the_kinds_that_run() -> None:
    assert {"cpu", "opencl"} <= set(NAMED), sorted(NAMED)
    unknown = {k: lines[:2] for k, lines in NAMED.items() if k not in backends.kinds()}
    assert not unknown, f"the docs name device kinds hcqa does not know: {unknown}"


@pytest.mark.parametrize("kind", sorted(NAMED))
def test_every_device_kind_a_doc_names_opens(kind: str) -> None:
    """``<kind>:0`` opens and runs a copy; where it can't, the reason is a missing extra or
    driver (the test is skipped, saying so) -- or the kind is not in this hcqa yet, and then
    every doc line naming it must say it is planned."""
    if not _exists(kind):
        with pytest.raises(hcqa.InvalidCommand, match="planned"):
            trio.run(_open_and_copy, f"{kind}:0")
        silent = [line for line in NAMED[kind] if not _says_planned(line, kind)]
        assert not silent, f"{kind}: not in this hcqa, but the docs don't say it is planned"
        return
    if kind == "opencl":
        from _kinds import opencl_missing

        if opencl_missing() is not None:
            pytest.skip(f"opencl:0 can't open here: {opencl_missing()}")
    try:
        trio.run(_open_and_copy, f"{kind}:0")
    except hcqa.InvalidCommand as exc:  # a GPU kind without its driver or extra: it says why
        if kind in ("cpu", "opencl"):
            raise
        pytest.skip(f"{kind}:0 can't open here: {exc}")
    planned = [line for line in NAMED[kind] if _says_planned(line, kind)]
    assert not planned, f"{kind} opens, but the docs still call it planned: {planned}"


def _says_planned(clause: str, kind: str) -> bool:
    """Whether a doc clause naming ``kind`` calls it planned, not available or refused."""
    low = clause.lower()
    return any(word in low for word in ("planned", "not available", "refused", "no cuda"))


async def _open_and_copy(spec: str) -> None:
    async with hcqa.open_devices(spec) as (d,):
        buf = d.alloc(shape=(4,), dtype="float32")
        await buf.copyin(np.arange(4, dtype=np.float32))
        out = np.zeros(4, np.float32)
        await buf.copyout(out)
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


def _docstring_specs() -> list[tuple[str, str]]:
    """(where, spec) for each quoted device spec in a docstring of hcqa's code."""
    found = []
    for path in sorted((ROOT / "hcqa").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            ):
                continue
            doc = ast.get_docstring(node)
            for m in SPEC.finditer(doc or ""):
                if m.group(2) != "N":
                    where = f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')}"
                    found.append((where, m.group(0).strip("`\"'")))
    return found


def test_every_spec_in_a_docstring_is_one_this_hcqa_opens() -> None:
    """``"cuda:1"`` as the example of ``open_devices`` was a spec no user could open."""
    specs = _docstring_specs()
    assert any(s.startswith("opencl:") for _, s in specs), specs  # the scan finds them
    for where, spec in specs:
        kind, _, _ = backends.parse_spec(spec)  # accepted: an InvalidCommand fails here
        assert _exists(kind), f"{where}: {spec!r} names a kind this hcqa can't open"


def test_the_readme_commands_each_make_their_own_environment() -> None:
    """Both README commands made ``.venv`` in the same folder: the test run reused the demo's
    environment instead of the fresh one it looked like."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    made = [m for block in blocks for m in re.findall(r"python3 -m venv (\S+)", block)]
    assert len(made) >= 2, blocks
    assert len(set(made)) == len(made), f"README commands share a venv: {made}"
    for name in made:
        assert f". {name}/bin/activate" in text, name  # each activates the one it made


def test_the_access_log_sample_is_the_shape_of_a_real_line(tmp_path: Path) -> None:
    """serving.md shows access-log lines: each must have the shape of the line the server
    writes (same fields and separators; digits may differ)."""
    from hcqa.serve import serve

    httpx = pytest.importorskip("httpx")
    log = tmp_path / "access.log"

    def double(out: np.ndarray, x: np.ndarray) -> None:
        np.multiply(x, 2, out=out)

    async def main() -> None:
        async with hcqa.open_devices("cpu:0") as (d,):
            pipe = hcqa.Pipeline([(d, double)], in_shape=(2, 3))
            async with trio.open_nursery() as nursery:
                port = await nursery.start(_serve, serve, pipe, str(log))
                async with httpx.AsyncClient() as client:
                    r = await client.post(
                        f"http://127.0.0.1:{port}/infer", json={"inputs": [1, 2, 3]}
                    )
                    assert r.status_code == 200
                    r = await client.get(f"http://127.0.0.1:{port}/health")
                nursery.cancel_scope.cancel()

    trio.run(main)
    real = log.read_text().splitlines()
    assert len(real) == 2, real
    text = (ROOT / "docs" / "serving.md").read_text()
    section = text.split("## Access log", 1)[1].split("```", 2)[1]
    samples = [line for line in section.splitlines() if line.strip()]
    assert len(samples) == 2, section
    for sample, line in zip(samples, real, strict=True):
        assert _shape(sample) == _shape(line), f"doc: {sample}\nreal: {line}"


def _shape(line: str) -> str:
    """A line with every run of digits as 9 (values differ, the form must not)."""
    return re.sub(r"\d+", "9", line)


async def _serve(serve: object, pipe: hcqa.Pipeline, log: str, *, task_status: object) -> None:
    await serve(pipe, port=0, access_log=log, task_status=task_status)  # type: ignore[operator]
