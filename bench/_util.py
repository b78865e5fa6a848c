"""Small helpers shared by the benchmarks: percentiles, tables and their footer.

Percentiles are numpy's (linear interpolation); tables are rich's, in markdown form
(``hcqa.cli._console``), so a report pastes into docs/performance.md as it is.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
import trio

from hcqa.cli._console import markdown


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no samples."""
    if len(samples) == 0:
        return math.nan
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; columns padded so it also reads well as plain text."""
    return markdown(headers, rows)


def print_footer(missing_peer: str | None, lines: Sequence[str], started: float) -> None:
    """After a bench's table: why its peer is missing (if it is), its verdict lines, and
    how long it ran (``started``: a ``time.perf_counter()`` reading)."""
    print()
    if missing_peer is not None:
        print(missing_peer)
    for line in lines:
        print(line)
    print(f"\n(ran in {time.perf_counter() - started:.1f} s)")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    print(markdown_table(headers, rows))


def run_quick_cli(
    main: Callable[[bool], Awaitable[None]], doc: str | None, argv: Sequence[str] | None
) -> None:
    """``python -m bench.X [--quick]``: parse the flag and run ``main(quick)`` under trio."""
    import argparse

    import trio

    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--quick", action="store_true", help="a short run (< 30 s)")
    args = parser.parse_args(argv)
    trio.run(main, args.quick)


class EventfdFloor:
    """The floor of one launch+await: a persistent thread, woken through an eventfd, runs
    ``work`` and wakes the waiting trio task through a second eventfd -- the two wake-ups any
    launch needs, and nothing else (no queue, no bookkeeping, no error handling)."""

    def __init__(self, work: Callable[[], object]) -> None:
        self._go = os.eventfd(0, os.EFD_CLOEXEC)  # the thread blocks in read
        self._done = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._stop = False

        def worker() -> None:
            while True:
                os.eventfd_read(self._go)
                if self._stop:
                    return
                work()
                os.eventfd_write(self._done, 1)

        self._thread = threading.Thread(target=worker, name="bench floor", daemon=True)
        self._thread.start()

    async def launch(self) -> None:
        os.eventfd_write(self._go, 1)
        await trio.lowlevel.wait_readable(self._done)
        os.eventfd_read(self._done)

    def close(self) -> None:
        self._stop = True
        os.eventfd_write(self._go, 1)
        self._thread.join()
        os.close(self._go)
        os.close(self._done)
