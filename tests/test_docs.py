"""The docs stay true: the API reference is current, links resolve, examples run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


def test_relative_links_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#]+\.md)\)", doc.read_text()):
            if not target.startswith("http") and not (doc.parent / target).exists():
                broken.append(f"{doc.name} -> {target}")
    assert broken == []


def test_the_getting_started_program_runs(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "getting-started.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    script = tmp_path / "first.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_the_readme_usage_example_runs(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    script = tmp_path / "usage.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "trace.json").stat().st_size > 0
