"""The docs stay true: the API reference is current, links resolve, every snippet runs.

Every block fenced ```` ```python ```` in README.md and docs/*.md is a complete program and is
run as written: in a subprocess, in a fresh temporary directory, with a timeout. A block that
cannot run standalone (a fragment, a server that runs until stopped, a test function) is fenced
```` ```python notest ```` and skipped; one that needs the optional extra Ray is fenced
```` ```python ray ```` and runs only where ``ray`` is installed. The blocks all start at
once (one process each) so the suite pays for the slowest block, not for their sum.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

import hcqa

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_api_reference_is_generated_from_the_current_code() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_api_docs.py"), "--check"], check=False
    )
    assert proc.returncode == 0, "docs/api.md is stale: run python tools/gen_api_docs.py"


def test_every_public_name_is_in_the_api_reference() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in hcqa.__all__ if f"## `{name}`" not in text]
    assert missing == []


# The docs speak to users about the product: no development history (git log holds it), no
# machinery of the development host, nothing a user's checkout lacks.
_NOT_FOR_USERS = {
    "an issue number": r"\bissues?\s*#?\d+|\(issue|issue's",
    "the team": r"\bengineers?\b",
    "the development host's lock or paths": r"\bflock\b|bench lock|/work/|/tmp/[a-z]+\d",
    "a script not in the repository": r"not in the repository",
    "a commit hash": r"\bmain [0-9a-f]{7}\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b",
    "a development round": r"\b(?:since |in )?round \d's\b|\(round \d\)|\bround \d, ",
    "what was taken out or landed": r"\bnot landed\b|\blanded\b|\bbefore issue\b|\bused to\b",
}


def test_the_docs_speak_of_the_product_not_its_history() -> None:
    found = []
    for path in [*DOCS, *sorted((ROOT / "examples").glob("*.py"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in _NOT_FOR_USERS.items():
                if re.search(pattern, line, re.IGNORECASE):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {what}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_relative_links_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#]+\.md)\)", doc.read_text()):
            if not target.startswith("http") and not (doc.parent / target).exists():
                broken.append(f"{doc.name} -> {target}")
    assert broken == []


BLOCK = re.compile(r"^```python(?P<tag>[^\n]*)\n(?P<code>.*?)^```", re.M | re.S)
BLOCK_TIMEOUT = 120.0  # seconds for one block; they take ~1 s each on an idle machine


@attrs.frozen(kw_only=True)
class Snippet:
    doc: str
    line: int
    tag: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _snippets() -> list[Snippet]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            name = str(doc.relative_to(ROOT))
            out.append(Snippet(doc=name, line=line, tag=m["tag"].strip(), code=m["code"]))
    return out


SNIPPETS = _snippets()
HAVE_RAY = importlib.util.find_spec("ray") is not None
RUNNABLE = [s for s in SNIPPETS if s.tag == "" or (s.tag == "ray" and HAVE_RAY)]


@attrs.frozen(kw_only=True)
class Ran:
    returncode: int | None  # None: still running at the timeout (then killed)
    output: str
    cwd: Path
    seconds: float


@pytest.fixture(scope="module")
def ran() -> Iterator[dict[str, Ran]]:
    """Start every runnable block at once, each in its own temp dir, and collect them."""
    with tempfile.TemporaryDirectory(prefix="hcqa-docs-") as top:
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        procs = {}
        for i, s in enumerate(RUNNABLE):
            cwd = Path(top) / f"block{i}"
            cwd.mkdir()
            (cwd / "snippet.py").write_text(s.code)
            log = (cwd / "output.txt").open("w+")
            proc = subprocess.Popen(
                [sys.executable, "snippet.py"], cwd=cwd, env=env, stdout=log, stderr=log
            )
            procs[s.id] = (proc, log, cwd, time.monotonic())
        deadline = time.monotonic() + BLOCK_TIMEOUT
        results = {}
        for key, (proc, log, cwd, t0) in procs.items():
            try:
                code: int | None = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = None
            log.seek(0)
            results[key] = Ran(
                returncode=code, output=log.read(), cwd=cwd, seconds=time.monotonic() - t0
            )
            log.close()
        yield results


def test_every_python_block_is_tagged_runnable_or_notest() -> None:
    unknown = [f"{s.id} ```python{s.tag}" for s in SNIPPETS if s.tag not in ("", "notest", "ray")]
    assert unknown == [], "fence python blocks as ```python, ```python notest or ```python ray"
    assert len(RUNNABLE) >= 5, "the snippet extractor found (almost) nothing to run"


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[s.id for s in RUNNABLE])
def test_the_snippet_runs_as_written(snippet: Snippet, ran: dict[str, Ran]) -> None:
    result = ran[snippet.id]
    assert result.returncode is not None, (
        f"{snippet.id} still running after {BLOCK_TIMEOUT:.0f} s:\n{result.output}"
    )
    assert result.returncode == 0, f"{snippet.id} exited {result.returncode}:\n{result.output}"


def test_the_readme_usage_example_writes_its_trace(ran: dict[str, Ran]) -> None:
    (usage,) = [s for s in RUNNABLE if s.doc == "README.md" and "hcqa.Tracer" in s.code]
    result = ran[usage.id]
    assert result.returncode == 0, result.output
    assert (result.cwd / "trace.json").stat().st_size > 0


def test_the_extractor_reads_tags_and_bodies() -> None:
    doc = "```python\nraise SystemExit(3)\n```\n\n```python notest\nawait x\n```\n"
    found = [(m["tag"].strip(), m["code"]) for m in BLOCK.finditer(doc)]
    assert found == [("", "raise SystemExit(3)\n"), ("notest", "await x\n")]
