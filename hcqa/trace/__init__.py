"""Tracing: the instrument that records, and the viewer that reads a trace back.

* ``tracer.py`` -- :class:`Tracer`, a trio Instrument that records trio task steps and the
  device work of every engine (through the engines' tracing hook) into one Chrome-trace
  (Perfetto) JSON file; ``region(name)``, a named phase of the program on its own track;
  ``instruments_from_env()`` for ``trio.run``;
* ``view.py`` -- :func:`load`, :func:`summarize` and :func:`plot` (``hcqa trace summary|plot``):
  the summary, and the readers' names in one place;
* ``reading.py`` -- loading and checking a trace, and the tracks both readers use;
* ``plotting.py`` -- the timeline plot;
* ``_tables.py`` -- the plain-text tables the summary (and the command line) prints.

The core never imports this package: it emits events through hooks (``hcqa.actors.engine.
trace_hook``; the asyncio host's instruments factory) that the tracer sets.
"""

from hcqa.trace.tracer import TRIO_PID, Tracer, instruments_from_env, region
from hcqa.trace.view import PlotInfo, TraceFormatError, load, plot, summarize

__all__ = [
    "TRIO_PID",
    "PlotInfo",
    "TraceFormatError",
    "Tracer",
    "instruments_from_env",
    "load",
    "plot",
    "region",
    "summarize",
]
