"""Write docs/api.md from hcqa's public names (``hcqa.__all__``) and their docstrings.

Run from the repo root: ``python tools/gen_api_docs.py``. tests/test_docs.py checks
that the file is up to date, so the reference can't drift from the code. Signatures are
fenced ```` ```python notest ````: they are not programs (tests/test_docs.py runs the others).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import hcqa

HEADER = """# API reference

Every public name of `hcqa` (its `__all__`), with its signature and documentation.
Generated from the code by `tools/gen_api_docs.py`; do not edit by hand.
"""


def _doc(obj: Any) -> str:
    doc = inspect.getdoc(obj) or "(no documentation)"
    return doc.strip()


def _signature(name: str, obj: Any) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name


def _own_and_inherited(cls: type) -> dict[str, Any]:
    """The class's attributes, then those it inherits from hcqa's own (mixin) bases."""
    found: dict[str, Any] = {}
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "hcqa":
            for name, member in vars(klass).items():
                found.setdefault(name, member)
    return found


def _members(cls: type) -> list[tuple[str, Any]]:
    out = []
    for name, member in _own_and_inherited(cls).items():
        if name.startswith("_") and name not in ("__call__", "__await__"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if callable(member) or isinstance(member, property):
            out.append((name, member))
    return out


def render() -> str:
    parts = [HEADER]
    for name in sorted(hcqa.__all__, key=str.lower):
        obj = getattr(hcqa, name)
        kind = "class" if inspect.isclass(obj) else "function"
        parts.append(f"\n## `{name}` ({kind})\n")
        if inspect.isclass(obj):
            parts.append(f"```python notest\n{_signature(name, obj)}\n```\n")
            parts.append(_doc(obj) + "\n")
            for mname, member in _members(obj):
                if isinstance(member, property):
                    parts.append(f"\n- `{name}.{mname}` (property): {_first(member)}")
                else:
                    sig = _signature(mname, member).replace("(self, ", "(").replace("(self)", "()")
                    parts.append(f"\n- `{name}.{sig}`: {_first(member)}")
            parts.append("\n")
        else:
            parts.append(f"```python notest\n{_signature(name, obj)}\n```\n")
            parts.append(_doc(obj) + "\n")
    return "".join(parts)


def _first(obj: Any) -> str:
    doc = inspect.getdoc(obj)
    if not doc:
        return ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def main() -> int:
    path = Path(__file__).resolve().parent.parent / "docs" / "api.md"
    text = render()
    if "--check" in sys.argv:
        return 0 if path.exists() and path.read_text() == text else 1
    path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
