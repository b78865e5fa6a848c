"""What every device benchmark shares: interleaved series, paired ratios, the report's format.

A section measures its ops round by round, in a rotating order (``interleave``), so host-load
drift hits every side alike; each op keeps a ``Series`` of per-op samples, and ratios are
medians of per-round ratios (``paired_ratio``). ``bench_devices``, ``bench_graph`` and
``bench_opencl`` import these; percentiles and the table come from ``bench._util``."""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import trio

import hcqa
from bench._util import percentile

# -- shared helpers --------------------------------------------------------------------------

AsyncOp = Callable[[], Awaitable[object]]
MiB = 1 << 20


@dataclass
class Series:
    """Per-op samples (ns per unit: per op, or per command for batched ops)."""

    name: str
    samples: list[float] = field(default_factory=list)
    rounds: list[list[float]] = field(default_factory=list)  # the same samples, per round

    @property
    def p50(self) -> float:
        return statistics.median(self.samples) if self.samples else math.nan

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else math.nan

    @property
    def p90(self) -> float:
        return percentile(self.samples, 90)


def paired_ratio(a: Series, b: Series) -> float:
    """The median over rounds of (a's p50 in the round / b's p50 in the same round): a
    ratio that slow drift of the host's load between rounds does not move."""
    ratios = [
        statistics.median(x) / statistics.median(y)
        for x, y in zip(a.rounds, b.rounds, strict=True)
        if x and y
    ]
    return statistics.median(ratios) if ratios else math.nan


def sync_op(fn: Callable[[], object]) -> AsyncOp:
    """An async op around a blocking call (the peer, numpy): it blocks the loop, as it would."""

    async def op() -> None:
        fn()

    return op


async def interleave(
    ops: dict[str, AsyncOp],
    *,
    rounds: int,
    per_round: dict[str, int] | int,
    units: dict[str, int] | None = None,
    warmup: int = 3,
) -> dict[str, Series]:
    """Time every op, round by round, rotating the order each round.

    Each call is one sample: its wall time (``perf_counter_ns``) divided by its ``units``
    (default 1). The GC is collected before each round and off while timing."""
    names = list(ops)
    out = {n: Series(n) for n in names}
    for name in names:
        for _ in range(warmup):
            await ops[name]()
    clock = time.perf_counter_ns
    gc_was = gc.isenabled()
    gc.collect()
    try:
        for r in range(rounds):
            gc.collect(1)  # the young generations: a full collection costs ~0.1 s with the peer
            gc.disable()
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                op = ops[name]
                k = per_round if isinstance(per_round, int) else per_round[name]
                u = 1 if units is None else units.get(name, 1)
                samples: list[float] = []
                for _ in range(k):
                    t0 = clock()
                    await op()
                    samples.append((clock() - t0) / u)
                out[name].samples.extend(samples)
                out[name].rounds.append(samples)
            if gc_was:
                gc.enable()
    finally:
        if gc_was:
            gc.enable()
    return out


def fmt_ns(ns: float) -> str:
    """A duration for the table: ns, µs, ms or s with 3 significant digits."""
    if math.isnan(ns):
        return "-"
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


def fmt_ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3g}x"


def gbps(nbytes: int, ns: float) -> str:
    return f"{nbytes / ns:.2f} GB/s"


def verdict(name: str, met: bool | None, detail: str) -> str:
    """One line per target: met / missed (``None``: skipped)."""
    state = "skipped" if met is None else ("met" if met else "MISSED")
    return f"- target {name}: {state} ({detail})"


def info(name: str, detail: str) -> str:
    return f"- info {name}: {detail}"


def header(title: str, quick: bool, peer_note: str) -> str:
    import os
    import platform

    mode = "quick" if quick else "full"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"## {title} ({mode} run)\n\n"
        f"python {platform.python_version()}, trio {trio.__version__}, numpy {np.__version__}, "
        f"hcqa {hcqa.__version__}, {os.cpu_count()} CPUs, load average {load} at the end; "
        f"{peer_note}\n"
    )
