"""Terminal output for the ``hcqa`` command and the benchmarks: tables and progress, via rich.

Theory of operation
-------------------
The tables (:func:`table`, :func:`render`, :func:`markdown`) are those of the trace viewer
(``hcqa/trace/_tables.py``), re-exported here for the command and the benchmarks.

:func:`progress` is one rich progress bar on stderr (transient: it disappears when done) that is
only drawn on a terminal; elsewhere it is a silent stand-in, so callers never branch. Nothing here
is imported by ``import hcqa``: only the command line pulls rich in.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TextIO

from hcqa.trace._tables import WIDTH, markdown, render, table

__all__ = ["WIDTH", "Bar", "markdown", "progress", "render", "table"]


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
