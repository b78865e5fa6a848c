"""Small helpers shared by the benchmarks: percentiles, tables and their footer."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no samples."""
    if not samples:
        return math.nan
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; columns padded so it also reads well as plain text."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    out = [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


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
