"""A model pipelined over two devices against the same model on one: ``models.pipeline``.

Usage: ``python -m bench.bench_models_pipeline [--quick]`` (needs ``pip install -e '.[models]'``).

Each case is one tinygrad function lifted by ``hcqa.models.from_tinygrad`` on ``cpu:0``, then
run three ways on the same calls (``calls`` arrays per batch):

* ``one device``: ``await m(x)`` per call, on ``cpu:0`` (a model runs its calls one at a time);
* ``by cost``: ``models.pipeline(m, devices=[cpu:0, cpu:1], depth=4).map(xs)``, the cut that
  balances tinygrad's per-kernel cost estimates;
* ``by count``: the same pipeline cut at half the kernels (``cuts=[n // 2]``), as a study of
  this host cut it before (1.35x on the GPT block).

The three alternate round by round (``interleave``, one batch per sample); a ratio is the
median of per-round ratios of the one-device time to the pipeline's: throughput. Every answer
is checked against the one-device model's, bit for bit, before timing.

1. ``gpt``: the GPT-like block of ``bench_models`` (2 layers, d=256, 4 heads, 32 tokens; its
   layers alike, so cost and count cut it the same way): target >= 1.6x with two free cores;
2. ``lopsided``: one wide layer (256 -> 2048 -> 256, batch 64) then a tail of a dozen small
   kernels (layer norms and a softmax): kernel counts put the wide layer in one stage, costs
   split it from the tail (report: by cost vs by count).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import hcqa
from bench._series import fmt_ns, fmt_ratio, info, interleave, paired_ratio, verdict
from bench._util import markdown_table, print_footer, run_quick_cli
from bench.bench_models import _weights, gpt

TARGET = 1.6


def lopsided(where: str, rng: np.random.Generator) -> tuple[Callable[..., Any], list[np.ndarray]]:
    w1, w2 = _weights(where, rng, 256, 2048), _weights(where, rng, 2048, 256)

    def fn(x: Any) -> Any:
        h = (x @ w1).relu() @ w2
        for _ in range(3):
            h = h.layernorm() * 2 + 1
        return h.softmax(-1)

    return fn, [rng.standard_normal((64, 256)).astype(np.float32)]


CASES = {"gpt": gpt, "lopsided": lopsided}


async def run(quick: bool, rows: list[list[object]], lines: list[str]) -> None:
    from hcqa import models

    rounds, calls = (3, 16) if quick else (7, 48)
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        where = models.tinygrad_device(d0)
        for case, make in CASES.items():
            fn, example = make(where, np.random.default_rng(0))
            m = await models.from_tinygrad(fn, example, device=d0, name=case)
            by_cost = models.pipeline(m, devices=[d0, d1], depth=4)
            n = by_cost.stages[-1].stop  # the model's kernels
            by_count = models.pipeline(m, devices=[d0, d1], depth=4, cuts=[n // 2])
            shape = example[0].shape
            xs = [
                np.random.default_rng(i).standard_normal(shape).astype(np.float32)
                for i in range(calls)
            ]
            want = [await m(x) for x in xs]
            exact = True
            for pipe in (by_cost, by_count):
                got = await pipe.map(xs)
                exact &= all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))

            async def one(m: Any = m, xs: list[np.ndarray] = xs) -> None:
                for x in xs:
                    await m(x)

            async def cost(p: Any = by_cost, xs: list[np.ndarray] = xs) -> None:
                await p.map(xs)

            async def count(p: Any = by_count, xs: list[np.ndarray] = xs) -> None:
                await p.map(xs)

            ops = {"one": one, "cost": cost, "count": count}
            units = dict.fromkeys(ops, calls)
            s = await interleave(ops, rounds=rounds, per_round=1, units=units, warmup=1)
            r_cost = 1 / paired_ratio(s["cost"], s["one"])
            r_count = 1 / paired_ratio(s["count"], s["one"])

            def cut_of(p: Any) -> str:
                a, b = p.stages
                share = a.cost / (a.cost + b.cost)
                return f"{a.stop}/{b.stop} ({share:.0%} of cost), {b.moved_bytes} B"

            rows.append([case, n, fmt_ns(s["one"].p50), fmt_ns(s["cost"].p50),
                         fmt_ratio(r_cost), cut_of(by_cost), fmt_ns(s["count"].p50),
                         fmt_ratio(r_count), cut_of(by_count),
                         "bit-exact" if exact else "DIFFERS"])  # fmt: skip
            if case == "gpt":
                lines.append(verdict(f"gpt over cpu:0/cpu:1 >= {TARGET}x one device",
                                     r_cost >= TARGET, fmt_ratio(r_cost)))  # fmt: skip
            else:
                same = "the same cut" if by_cost.stages[0].stop == n // 2 else "different cuts"
                lines.append(info(case, f"by cost {fmt_ratio(r_cost)} vs by count "
                                        f"{fmt_ratio(r_count)} ({same})"))  # fmt: skip
            lines.append(info(f"{case} answers", "bit-exact" if exact else "DIFFER"))


async def main(quick: bool) -> None:
    t0 = time.perf_counter()
    rows: list[list[object]] = []
    lines: list[str] = []
    await run(quick, rows, lines)
    print(f"# bench_models_pipeline{' --quick' if quick else ''}: models.pipeline over "
          "cpu:0/cpu:1 vs one device (per call; throughput ratios)")  # fmt: skip
    print(markdown_table(["case", "kernels", "one device", "by cost", "throughput",
                          "cut (stage 0 / kernels, cost share, bytes moved)", "by count",
                          "throughput", "cut", "answers"], rows))  # fmt: skip
    print_footer(None, lines, t0)


def cli(argv: Sequence[str] | None = None) -> None:
    run_quick_cli(main, __doc__, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    cli()
