"""Plain-text tables: what ``hcqa trace summary``, ``hcqa bench`` and the benchmarks print.

Theory of operation
-------------------
Every table hcqa prints is built by :func:`table` and turned into plain text by
:func:`render`: no colours or box-drawing verticals, so the text is the same on a terminal,
in a pipe, in a log or in a test, and a row still splits on whitespace into its cells. Text
columns are left-aligned, the rest right-aligned. rich is imported only when a table is made,
never by ``import hcqa``. The trace viewer and the command line both use these; they live with
the viewer, the lower of the two.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["WIDTH", "markdown", "render", "table"]

WIDTH = 120  # wide enough for every table hcqa prints; rich wraps cells past it


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    title: str | None = None,
    text_columns: int = 1,
    caption: str | None = None,
) -> Table:
    """A table of ``rows``; the first ``text_columns`` columns are left-aligned."""
    from rich import box
    from rich.table import Table
    from rich.text import Text  # cells are text, never markup: "native[add1 x3]" stays as is

    t = Table(
        box=box.SIMPLE_HEAD,
        title=Text(title) if title is not None else None,
        title_justify="left",
        caption=Text(caption) if caption is not None else None,
        caption_justify="left",
        show_edge=False,
        pad_edge=False,
    )
    for i, h in enumerate(headers):
        t.add_column(Text(h), justify="left" if i < text_columns else "right")
    for row in rows:
        t.add_row(*(Text(str(c)) for c in row))
    return t


def markdown(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (``| a | b |``), columns padded so it also reads well as plain text."""
    from rich import box

    t = table(headers, rows, text_columns=len(headers))
    t.box, t.show_edge, t.pad_edge = box.MARKDOWN, True, True
    return render(t, width=max(WIDTH, 400))  # a markdown row must never wrap


def render(*items: Any, width: int = WIDTH) -> str:
    """Plain text of rich renderables (tables) or strings, separated by blank lines."""
    from rich.console import Console

    buf = io.StringIO()
    console = Console(
        file=buf, width=width, color_system=None, force_terminal=False, highlight=False
    )
    for i, item in enumerate(items):
        if i:
            console.print()
        console.print(item, markup=False)
    lines = [line.rstrip() for line in buf.getvalue().splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return "\n".join(lines)
