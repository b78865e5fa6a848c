"""Terminal output for the ``hcqa`` command and the benchmarks: tables and progress, via rich.

Theory of operation
-------------------
Every table hcqa prints (``hcqa trace summary``, ``hcqa bench``, the benchmarks' reports) is
built by :func:`table` and turned into plain text by :func:`render`: no colours or box-drawing
verticals, so the text is the same on a terminal, in a pipe, in a log or in a test, and a row
still splits on whitespace into its cells. Text columns are left-aligned, the rest right-aligned.

:func:`progress` is one rich progress bar on stderr (transient: it disappears when done) that is
only drawn on a terminal; elsewhere it is a silent stand-in, so callers never branch. Nothing here
is imported by ``import hcqa``: only the command line and the trace readers pull rich in.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, TextIO

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["Bar", "markdown", "progress", "render", "table"]

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


class Bar(Protocol):
    """What :func:`progress` yields: ``advance`` one step; ``describe`` the current phase."""

    def advance(self, steps: int = 1) -> None: ...

    def describe(self, text: str, total: int | None = None) -> None: ...


class _Silent:
    def advance(self, steps: int = 1) -> None:
        pass

    def describe(self, text: str, total: int | None = None) -> None:
        pass


class _Rich:
    def __init__(self, progress: Any, task: Any) -> None:
        self._progress, self._task = progress, task

    def advance(self, steps: int = 1) -> None:
        self._progress.advance(self._task, steps)

    def describe(self, text: str, total: int | None = None) -> None:
        if total is None:
            self._progress.update(self._task, description=text)
        else:
            self._progress.reset(self._task, description=text, total=total)


@contextmanager
def progress(
    text: str, total: int | None, *, enabled: bool = True, stream: TextIO | None = None
) -> Iterator[Bar]:
    """A transient progress bar on ``stream`` (stderr) while the block runs.

    Drawn only when ``enabled`` and the stream is a terminal; ``total=None`` shows a spinner
    and the elapsed time instead of a bar (for work of unknown length)."""
    stream = sys.stderr if stream is None else stream
    if not enabled or not stream.isatty():
        yield _Silent()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
    columns += [MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=Console(file=stream), transient=True) as p:
        yield _Rich(p, p.add_task(text, total=total))
