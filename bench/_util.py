"""Small helpers shared by the benchmarks: percentiles, tables and their footer.

Percentiles are numpy's (linear interpolation); tables are rich's, in markdown form
(``hcqa.cli._console``), so a report pastes into docs/performance.md as it is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

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
