"""Soak: a pipeline, graph replays and transfers across two cpu devices at full load,
with resident memory, open fds and threads sampled as it goes: none of them may grow.

Run from the repository root::

    python bench/soak.py                 # 10 minutes
    python bench/soak.py --minutes 2
    python bench/soak.py --quick         # 20 s

What runs, all at once, until the time is up:

* ``--workers`` tasks (default 4), each with its own buffers on ``cpu:0`` and ``cpu:1`` and
  its own captured graph: ``x = 3x + k`` on cpu:0, transfer to cpu:1, ``z = 3y + k`` there,
  transfer back to cpu:0; replayed back to back with new variable values (``n``, ``k``),
  plus an eager transfer pair and a host round trip every few replays;
* a 2-stage ``hcqa.Pipeline`` (cpu:0 -> cpu:1) fed by ``depth`` tasks back to back;
* churn, where leaks usually hide: every 25 replays a worker allocates and frees a buffer
  and makes and closes a signal; every 200 it captures a fresh graph and drops the old one;
  every 100 it checks one replay against numpy (wrong results stop the soak);
* a sampler: every ``--interval`` seconds it records VmRSS (``/proc/self/status``), the
  number of open fds (``/proc/self/fd``) and of threads.

Verdict: after a warm-up (the first fifth of the run, at least two samples), the fd and
thread counts must stay exactly flat, and resident memory must not grow: the median of the
last third of the samples may exceed the median of the first third by at most
``max(4 MiB, 2 %)``. The least-squares slope (MiB per minute) is printed as well. Exit status
0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import trio

import hcqa
from hcqa import Variable

SCALE = """
void scale(unsigned int *out, const unsigned int *a, int n, int k) {
    for (int i = 0; i < n; i++) out[i] = a[i] * 3u + (unsigned int)k;
}
"""
U32 = np.uint32


@dataclass
class Sample:
    t: float  # seconds since the start
    rss_mib: float
    fds: int
    threads: int
    replays: int


@dataclass
class Totals:
    replays: int = 0
    microbatches: int = 0
    transfers: int = 0
    checks: int = 0
    graphs: int = 0
    samples: list[Sample] = field(default_factory=list)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return math.nan


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1


class Worker:
    """One worker's buffers, programs and graph."""

    def __init__(self, d0: hcqa.Device, d1: hcqa.Device, size: int, seed: int) -> None:
        self.d0, self.d1, self.size = d0, d1, size
        self.x = d0.alloc(shape=(size,), dtype=U32)
        self.w = d0.alloc(shape=(size,), dtype=U32)
        self.y = d1.alloc(shape=(size,), dtype=U32)
        self.z = d1.alloc(shape=(size,), dtype=U32)
        self.f0 = d0.program("scale", SCALE)
        self.f1 = d1.program("scale", SCALE)
        self.n = Variable("n", 1, size)
        self.k = Variable("k", 0, 1 << 20)
        self.rng = np.random.default_rng(seed)
        self.graph = self.capture()

    def capture(self) -> hcqa.Graph:
        with hcqa.capture() as g:
            self.f0(self.x, self.x, vals=(self.n, self.k))
            hcqa.transfer(self.y, self.x)
            self.f1(self.z, self.y, vals=(self.n, self.k))
            hcqa.transfer(self.w, self.z)
        return g

    async def check(self) -> None:
        """One replay from known data, compared with numpy."""
        data = self.rng.integers(0, 1 << 32, self.size, dtype=U32)
        k = int(self.rng.integers(0, 1 << 20))
        self.x.copyin(data)
        await self.graph(n=self.size, k=k)
        got = np.empty(self.size, U32)
        await self.w.copyout(got)
        want = (data * U32(3) + U32(k)) * U32(3) + U32(k)
        if not np.array_equal(got, want):
            raise AssertionError("soak: a replay computed the wrong result")


async def worker(w: Worker, deadline: float, totals: Totals) -> None:
    i = 0
    host = np.empty(w.size, U32)
    while trio.current_time() < deadline:
        i += 1
        await w.graph(n=w.size if i % 2 else w.size // 2, k=i & 0xFFFFF)
        totals.replays += 1
        if i % 5 == 0:
            hcqa.transfer(w.y, w.x)
            await hcqa.transfer(w.w, w.y)
            totals.transfers += 2
        if i % 10 == 0:
            await w.w.copyout(host)
        if i % 25 == 0:
            tmp = w.d1.alloc(shape=(w.size,), dtype=U32)
            await hcqa.transfer(tmp, w.x)
            tmp.free()
            sig = hcqa.Signal()
            sig.value = 1
            await sig.wait(1)
            sig.close()
        if i % 100 == 0:
            await w.check()
            totals.checks += 1
        if i % 200 == 0:
            w.graph = w.capture()
            totals.graphs += 1


async def pipeline_feeder(pipe: hcqa.Pipeline, size: int, deadline: float, totals: Totals) -> None:
    """The pipeline at full load: microbatches through cpu:0 -> cpu:1, checked now and then."""
    rng = np.random.default_rng(7)
    i = 0
    while trio.current_time() < deadline:
        i += 1
        x = rng.standard_normal(size).astype(np.float32)
        y = await pipe(x)
        totals.microbatches += 1
        if i % 50 == 0 and not np.allclose(y, (x * 2 + 1) * 2 + 1):
            raise AssertionError("soak: the pipeline computed the wrong result")


def _affine(out: npt.NDArray[np.float32], x: npt.NDArray[np.float32]) -> None:
    np.multiply(x, 2, out=out)
    np.add(out, 1, out=out)


async def sampler(start: float, deadline: float, interval: float, totals: Totals) -> None:
    while True:
        now = trio.current_time()
        totals.samples.append(
            Sample(now - start, _rss_mib(), _fds(), threading.active_count(), totals.replays)
        )
        if now >= deadline:
            return
        await trio.sleep(min(interval, max(0.0, deadline - now)))


async def soak(seconds: float, interval: float, workers: int, size: int) -> Totals:
    totals = Totals()
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=30.0) as (d0, d1):
        pool = [Worker(d0, d1, size, seed) for seed in range(workers)]
        for w in pool:  # warm: compile, first replays
            await w.check()
        pipe = hcqa.Pipeline([(d0, _affine), (d1, _affine)], in_shape=(size,), depth=3)
        start = trio.current_time()
        deadline = start + seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler, start, deadline, interval, totals)
            for w in pool:
                nursery.start_soon(worker, w, deadline, totals)
            for _ in range(pipe.depth):
                nursery.start_soon(pipeline_feeder, pipe, size, deadline, totals)
    return totals


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def report(totals: Totals, seconds: float) -> bool:
    samples = totals.samples
    print(f"{'t (s)':>7} {'RSS (MiB)':>10} {'fds':>5} {'threads':>8} {'replays':>9} {'/s':>7}")
    prev: Sample | None = None
    for s in samples:
        rate = ""
        if prev is not None and s.t > prev.t:
            rate = f"{(s.replays - prev.replays) / (s.t - prev.t):7.0f}"
        print(f"{s.t:7.1f} {s.rss_mib:10.1f} {s.fds:5d} {s.threads:8d} {s.replays:9d} {rate:>7}")
        prev = s
    warm = max(2, len(samples) // 5)
    steady = samples[warm:]
    if len(steady) < 3:
        print("FAIL: too few samples after the warm-up (run longer or sample more often)")
        return False
    third = max(1, len(steady) // 3)
    early = statistics.median(s.rss_mib for s in steady[:third])
    late = statistics.median(s.rss_mib for s in steady[-third:])
    growth = late - early
    allowed = max(4.0, 0.02 * early)
    slope = _slope([s.t / 60 for s in steady], [s.rss_mib for s in steady])
    fds = sorted({s.fds for s in steady})
    threads = sorted({s.threads for s in steady})
    print()
    print(
        f"ran {seconds:.0f} s: {totals.replays} replays ({totals.replays / seconds:.0f}/s), "
        f"{totals.transfers} eager transfers, {totals.microbatches} pipeline microbatches, "
        f"{totals.checks} numpy checks, "
        f"{totals.graphs} graphs re-captured"
    )
    print(
        f"after warm-up ({steady[0].t:.0f} s on): RSS {early:.1f} -> {late:.1f} MiB "
        f"(growth {growth:+.1f} MiB, allowed {allowed:.1f}; slope {slope:+.2f} MiB/min), "
        f"fds {fds}, threads {threads}"
    )
    ok = growth <= allowed and len(fds) == 1 and len(threads) == 1
    print(f"verdict: {'PASS' if ok else 'FAIL'}: ", end="")
    if ok:
        print("no growth in memory, fds or threads")
    else:
        why = []
        if growth > allowed:
            why.append(f"RSS grew {growth:.1f} MiB")
        if len(fds) > 1:
            why.append(f"fds varied {fds}")
        if len(threads) > 1:
            why.append(f"threads varied {threads}")
        print("; ".join(why))
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    parser.add_argument("--quick", action="store_true", help="20 s, sampling every second")
    parser.add_argument("--interval", type=float, default=None, help="seconds between samples")
    parser.add_argument("--workers", type=int, default=4, help="concurrent workers (default 4)")
    parser.add_argument("--size", type=int, default=1 << 16, help="uint32 per buffer")
    args = parser.parse_args(argv)
    seconds = 20.0 if args.quick else args.minutes * 60
    interval = args.interval or (1.0 if args.quick else 5.0)
    if seconds <= 0 or interval <= 0 or args.workers < 1 or args.size < 2:
        parser.error("--minutes, --interval, --workers and --size must be positive")
    print(
        f"soak: {seconds:.0f} s, {args.workers} workers, {args.size} x uint32 per buffer, "
        f"sampling every {interval:g} s (pid {os.getpid()}, {os.cpu_count()} CPUs)"
    )
    began = time.monotonic()
    totals = trio.run(soak, seconds, interval, args.workers, args.size)
    ok = report(totals, totals.samples[-1].t if totals.samples else time.monotonic() - began)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
