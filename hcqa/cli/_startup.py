"""``hcqa serve``'s start-up status: each model loading, building, warming up, ready or failed.

Theory of operation
-------------------
:class:`Startup` takes one call of :meth:`Startup.event` per step of a model's start, on the
trio thread: ``loading ...`` (the CLI), ``building`` (said only for a model the CLI is not
loading) or ``rebuilding (why)``, ``warming up``, ``ready`` and ``failed: why`` (the server,
through ``hcqa.serve.Model.progress``), and ``building batch size k of n``
(``hcqa.models.load_onnx``'s ``progress``). A model's clock starts at its first event
(again at a rebuild after a fault): ``ready`` is shown as ``ready in X s``.

On a terminal the start-up is a rich ``Live`` status on stderr: one line per model, a spinner
and the seconds so far while it works, a tick or a cross once it is ready or has failed. It
stops when every model is ready or failed (or the block is left), leaving the last lines
drawn. Anywhere else (CI, a log file), and after the start-up on a terminal too, each event
is one plain line, ``hcqa: model m: building batch size 2 of 6``, with no control codes. A
model that fails before it was ever ready ends the command with one error line naming it
(the CLI's), so off a terminal its ``failed`` event prints nothing more.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

import attrs

from hcqa.cli._base import PROG

__all__ = ["Startup", "startup"]


@attrs.define
class _Model:
    name: str
    step: str = "waiting"
    began: float = attrs.field(factory=time.monotonic)
    done: bool = False  # ready or failed
    ready_once: bool = False


class Startup:
    """The models' start-up status on ``stream`` (see the module doc)."""

    def __init__(self, names: Sequence[str], stream: TextIO, *, live: bool) -> None:
        self.stream = stream
        self._models = {n: _Model(n) for n in names}
        self._live: Any = None
        if live:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=stream)
            self._live = Live(get_renderable=self._render, console=console, refresh_per_second=8)
            self._live.start()

    def event(self, name: str, step: str) -> None:
        """Model ``name`` is at ``step`` now (see the module doc for the steps)."""
        m = self._models.setdefault(name, _Model(name))
        if step == "building" and m.step.startswith("loading"):
            return  # the server's first build of what the CLI is loading: said already
        if m.done and step != "ready" and not step.startswith("failed"):
            m.began, m.done = time.monotonic(), False  # a rebuild after a fault
        if step == "ready":
            m.done = m.ready_once = True
            step = f"ready in {time.monotonic() - m.began:.1f} s"
        elif step.startswith("failed"):
            m.done = True
        m.step = step
        if self._live is not None:
            self._live.refresh()
            if all(x.done for x in self._models.values()):
                self.stop()
            return
        if step.startswith("failed") and not m.ready_once:
            return  # the command's error line says it
        print(f"{PROG}: model {name}: {step}", file=self.stream, flush=True)

    def stop(self) -> None:
        """Stop the live status (drawn for the last time); later events are plain lines."""
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()

    def _render(self) -> Any:
        from rich.console import Group
        from rich.spinner import Spinner
        from rich.text import Text

        now = time.monotonic()
        lines: list[Any] = []
        for m in list(self._models.values()):  # (drawn from rich's refresh thread)
            if m.done:
                ok = m.step.startswith("ready")
                mark = Text("✔ " if ok else "✘ ", style="green" if ok else "red")
                lines.append(Text.assemble(mark, f"model {m.name}: {m.step}"))
            else:
                text = f"model {m.name}: {m.step} ({now - m.began:.1f} s)"
                lines.append(Spinner("dots", text=text))
        return Group(*lines)


@contextmanager
def startup(names: Sequence[str], stream: TextIO | None = None) -> Iterator[Startup]:
    """A :class:`Startup` of the models ``names`` for the block: live on a terminal (when
    there are any), plain lines elsewhere."""
    stream = sys.stderr if stream is None else stream
    status = Startup(names, stream, live=bool(names) and stream.isatty())
    try:
        yield status
    finally:
        status.stop()
