"""Pipeline benchmark: 2 stages on 2 cpu devices vs a 2-process numpy control.

Run from the repository root::

    python -m bench.bench_pipeline           # full run (about 15 s)
    python -m bench.bench_pipeline --quick   # short run (a few seconds; sizes too small to judge)

The work is ``hcqa demo``'s: a 4-layer float32 MLP (``relu(x @ W + b)`` per layer), microbatches
of ``batch_size x hidden``, BLAS held to one thread everywhere.

* **hcqa**: the demo's two-stage Pipeline (layers 1-2 on ``cpu:0``, 3-4 on ``cpu:1``, depth 3,
  weights loaded from a file with ``Buffer.load``) against the same work as one stage on
  ``cpu:0`` at the same depth: ``S_hcqa = t(1 device) / t(2 devices)``.
* **control**: the ideal 2-core speedup on this host right now. Two worker processes, forked
  before any hcqa thread exists, each with one BLAS thread and the same weights and inputs;
  the same batches run in one worker, then split in halves across both:
  ``S_ctrl = t(1 process) / t(2 processes)``.

Target: ``S_hcqa / S_ctrl >= 0.95``. The four measurements are interleaved round by round, in
an order that flips every round, so a change in the host's load hits both sides; the verdict
is the median of the per-round ratios (a round that another process disturbed moves it
little), and the table's speedups are ratios of the summed times over all rounds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import trio
from threadpoolctl import threadpool_limits

import hcqa
from bench._util import markdown_table
from hcqa.cli.demo import (
    MlpSpec,
    build_pipelines,
    drive,
    make_inputs,
    make_weights,
    mlp_kernel,
    save_weights,
)

TARGET = 0.95


@dataclass(frozen=True)
class Plan:
    spec: MlpSpec
    rounds: int


FULL = Plan(MlpSpec(batches=32, batch_size=256, hidden=1024), rounds=5)
QUICK = Plan(MlpSpec(batches=8, batch_size=64, hidden=256), rounds=2)


# -- the control: forked numpy workers -------------------------------------------------------


# Microbatches in flight: with 2 stages, depth 2 leaves a bubble in stage 1 while the
# caller collects a result and feeds the next; one more keeps both devices busy.
DEPTH = 3


def _worker(conn: Connection, spec: MlpSpec) -> None:
    threadpool_limits(1)
    weights, xs = make_weights(spec), make_inputs(spec)
    kernel = mlp_kernel(spec.layers, spec.batch_size, spec.hidden)
    out = np.empty((spec.batch_size, spec.hidden), np.float32)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        lo, hi = job
        for i in range(lo, hi):
            kernel(out, xs[i], *weights)
        conn.send(hi - lo)


class Control:
    """Two forked workers; ``run(n)`` splits the batches over ``n`` of them, returns seconds."""

    def __init__(self, spec: MlpSpec) -> None:
        self.spec = spec
        ctx = mp.get_context("fork")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, spec), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        for c in self.conns:
            assert c.recv() == "ready"

    def run(self, n: int) -> float:
        b = self.spec.batches
        cuts = [b * k // n for k in range(n + 1)]
        start = time.perf_counter()
        for k in range(n):
            self.conns[k].send((cuts[k], cuts[k + 1]))
        done = sum(self.conns[k].recv() for k in range(n))
        secs = time.perf_counter() - start
        assert done == b
        return secs

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


# -- the measurement -------------------------------------------------------------------------


async def _measure(plan: Plan, control: Control, workdir: str) -> list[dict[str, float]]:
    spec = plan.spec
    weights, xs = make_weights(spec), make_inputs(spec)
    path = os.path.join(workdir, "mlp-weights.bin")
    layout = save_weights(weights, path)
    rounds: list[dict[str, float]] = []
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        pipe, seq = await build_pipelines(d0, d1, spec, path, layout, depth=DEPTH)
        for p in (pipe, seq):
            await p(xs[0])  # warm-up
        for r in range(plan.rounds):
            times: dict[str, float] = {}
            outs: dict[str, list[Any]] = {}
            order = ["pipe", "seq", "ctrl2", "ctrl1"]
            for what in order if r % 2 == 0 else order[::-1]:
                if what in ("pipe", "seq"):
                    outs[what], times[what] = await drive(pipe if what == "pipe" else seq, xs)
                else:
                    n = 2 if what == "ctrl2" else 1
                    times[what] = await trio.to_thread.run_sync(control.run, n)
            for a, b in zip(outs["pipe"], outs["seq"], strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            rounds.append(times)
    return rounds


def _fmt_rate(batches: int, secs: float) -> str:
    return f"{batches / secs:.1f}/s ({secs * 1e3:.0f} ms)"


def rows(quick: bool = False) -> list[dict[str, str]]:
    """Run the benchmark; rows of the summary table (``hcqa bench`` prints them)."""
    plan = QUICK if quick else FULL
    control = Control(plan.spec)  # fork before any hcqa thread exists
    try:
        with threadpool_limits(1), tempfile.TemporaryDirectory(prefix="hcqa-bench-") as tmp:
            rounds = trio.run(_measure, plan, control, tmp)
    finally:
        control.close()
    total = {k: sum(r[k] for r in rounds) for k in rounds[0]}
    s_hcqa = total["seq"] / total["pipe"]
    s_ctrl = total["ctrl1"] / total["ctrl2"]
    n = plan.spec.batches * plan.rounds
    ratios = [(r["seq"] / r["pipe"]) / (r["ctrl1"] / r["ctrl2"]) for r in rounds]
    ratio = statistics.median(ratios)
    per_round = ", ".join(f"{x:.2f}" for x in ratios)
    met = "met" if ratio >= TARGET else "MISSED"
    if quick:
        met += " (quick: sizes too small to judge)"
    return [
        {"case": "hcqa, 1 device (4 layers on cpu:0)", "throughput": _fmt_rate(n, total["seq"])},
        {
            "case": "hcqa, 2 stages (cpu:0 -> cpu:1)",
            "throughput": _fmt_rate(n, total["pipe"]),
            "speedup": f"S_hcqa {s_hcqa:.2f}x",
        },
        {"case": "numpy, 1 process", "throughput": _fmt_rate(n, total["ctrl1"])},
        {
            "case": "numpy, 2 processes",
            "throughput": _fmt_rate(n, total["ctrl2"]),
            "speedup": f"S_ctrl {s_ctrl:.2f}x",
        },
        {
            "case": "S_hcqa / S_ctrl",
            "speedup": f"median {ratio:.2f} (rounds: {per_round}; pooled {s_hcqa / s_ctrl:.2f})",
            "target": f">= {TARGET}",
            "verdict": met,
        },
    ]


def _table(table: Sequence[dict[str, str]]) -> str:
    headers = list(dict.fromkeys(k for row in table for k in row))
    return markdown_table(headers, [[row.get(h, "") for h in headers] for row in table])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run (sizes too small)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    s = plan.spec
    print(
        f"# bench_pipeline{' --quick' if args.quick else ''}: {s.layers}-layer MLP, hidden "
        f"{s.hidden}, batch {s.batch_size}, {s.batches} microbatches x {plan.rounds} rounds, "
        f"BLAS 1 thread, {os.cpu_count()} cpus\n"
    )
    start = time.perf_counter()
    table = rows(args.quick)
    print(_table(table))
    print(f"\n(ran in {time.perf_counter() - start:.1f} s)")
    missed = table[-1]["verdict"].startswith("MISSED")
    return 1 if missed and not args.quick else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
