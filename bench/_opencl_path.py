"""bench_opencl's device-path sections: the compute/copy chain (5) and a changing Variable (6).

Theory of operation
-------------------
Both measure what the driver is asked to keep rather than the host: section 5 runs a chain of
kernels and transfers alternating the compute and copy queues of ``opencl:0`` (each step
reading what the last wrote), against the same chain on one queue and against the chain with
every wait gated on the host; section 6 resubmits a 200-exec ``Queue`` and a 200-launch graph
with a value that changes every submit, against constants. Each op is interleaved round by
round with the others and reported as a median of per-round ratios (``paired_ratio``), as in
the rest of ``bench/bench_opencl.py``, which runs them with its plan (``rounds``,
``per_chain``, ``per_batch``).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

import hcqa
from bench._series import (
    AsyncOp,
    Series,
    fmt_ns,
    fmt_ratio,
    info,
    interleave,
    paired_ratio,
    verdict,
)

__all__ = ["chain_section", "patch_section"]


class Plan(Protocol):
    """What the sections read of bench_opencl's plan."""

    rounds: int
    per_batch: int
    per_chain: int


def _lat(s: Series) -> list[str]:
    return [fmt_ns(s.p50), fmt_ns(s.mean), fmt_ns(s.p90)]


CHAIN_SOURCE = """
__kernel void bump(__global int *x, int n, int spin) {
    int i = get_global_id(0);
    int acc = x[i];
    for (int k = 0; k < spin; k++) acc = acc * 1103515245 + 12345;
    if (i < n) x[i] += 1 + (acc == 7 && spin < 0);
}
__kernel void move(__global int *d, __global const int *s, int n) {
    int i = get_global_id(0);
    if (i < n) d[i] = s[i];
}
"""
CHAIN_STEPS = 8
CHAIN_SPIN = 3000  # the first kernel's loop: a few hundred µs on PoCL, to enqueue the rest


async def chain_section(
    devs: tuple[Any, Any, Any] | None, plan: Plan
) -> tuple[list[list[str]], list[str]]:
    """Section 5: the compute/copy chain (see the module doc); ``devs``: two devices on
    ``opencl:0`` (the second unused here) and a third whose queues gate every wait on the
    host. The chain's first kernel runs long enough for the whole chain to be enqueued while
    it runs, so the chain measures the hand-offs on the device, not Python's enqueue calls."""
    sec = "5 compute/copy chain"
    name = "5a compute/copy chain on opencl:0 <= 1.15x the same chain on one queue (paired)"
    if devs is None:
        return [], [verdict(name, None, "no hcqa opencl device")]
    n = 64  # one work-group: the chain's cost is its hand-offs, not its work
    size = {"global_size": (1, 1, 1), "local_size": (n, 1, 1)}
    ops: dict[str, AsyncOp] = {}
    checks: list[Any] = []
    for key, dev in (("cross", devs[0]), ("host", devs[2])):
        a = dev.alloc(shape=(n,), dtype="int32")
        b = dev.alloc(shape=(n,), dtype="int32")
        await a.copyin(np.zeros(n, np.int32))
        bump = dev.program("bump", CHAIN_SOURCE, entry="bump")
        move = dev.program("move", CHAIN_SOURCE, entry="move")

        async def cross(a: Any = a, b: Any = b, bump: Any = bump) -> None:
            for j in range(CHAIN_STEPS // 4):
                bump(a, vals=(n, CHAIN_SPIN if j == 0 else 0), **size)
                hcqa.transfer(b, a)
                bump(b, vals=(n, 0), **size)
                fence = hcqa.transfer(a, b)
            await fence

        async def one(a: Any = a, b: Any = b, bump: Any = bump, move: Any = move) -> None:
            for j in range(CHAIN_STEPS // 4):
                bump(a, vals=(n, CHAIN_SPIN if j == 0 else 0), **size)
                move(b, a, vals=(n,), **size)
                bump(b, vals=(n, 0), **size)
                fence = move(a, b, vals=(n,), **size)
            await fence

        ops[key] = cross
        if key == "cross":
            ops["one"] = one
        checks.append(a)
    s = await interleave(ops, rounds=plan.rounds, per_round=plan.per_chain, warmup=3)
    for a in checks:  # each chain adds CHAIN_STEPS // 2 to every element, in order
        out = np.empty(n, np.int32)
        await a.copyout(out)
        if not (out == out[0]).all() or out[0] % (CHAIN_STEPS // 2):
            raise RuntimeError(f"a chain lost an ordering: {out[:8]}")
    cross, one, host = s["cross"], s["one"], s["host"]
    r, rh = paired_ratio(cross, one), paired_ratio(host, one)
    rows = [
        [sec, f"{CHAIN_STEPS} steps alternating compute and copy queues", *_lat(cross),
         f"{fmt_ratio(r)} one queue"],
        [sec, "the same chain, every wait gated on the host", *_lat(host),
         f"{fmt_ratio(rh)} one queue"],
        [sec, "the same chain on the compute queue (copy kernels)", *_lat(one), "ref"],
    ]  # fmt: skip
    return rows, [
        verdict(name, r <= 1.15, f"{fmt_ratio(r)}: {fmt_ns(cross.p50)} vs {fmt_ns(one.p50)}"),
        info("5 the chain gated on the host", f"{fmt_ratio(rh)} one queue"),
    ]


PATCH_SOURCE = """
__kernel void k(__global float *out, __global const float *a, int n) {
    out[0] = a[0] + (float)(n & 1);
}
"""
PATCH_KERNELS = 200


async def patch_section(dev: Any, plan: Plan) -> tuple[list[list[str]], list[str]]:
    """Section 6: changing vs constant values, a queue and a graph (see the module doc)."""
    sec = "6 changing Variable"
    if dev is None:
        return [], [verdict("6 changing Variable <= 1.5x constants", None, "no hcqa opencl device")]
    n = hcqa.Variable("n", 0, 1 << 30)
    prog = dev.program("k", PATCH_SOURCE)
    bufs = [dev.alloc(shape=(16,), dtype="float32") for _ in range(PATCH_KERNELS + 1)]
    q_sym, q_const = dev.compute_queue(), dev.compute_queue()
    for i in range(PATCH_KERNELS):
        q_sym.exec(prog, (bufs[i + 1], bufs[i]), vals=(n,))
        q_const.exec(prog, (bufs[i + 1], bufs[i]), vals=(3,))
    with hcqa.capture() as g_sym:
        for i in range(PATCH_KERNELS):
            prog(bufs[i + 1], bufs[i], vals=(n,))
    with hcqa.capture() as g_const:
        for i in range(PATCH_KERNELS):
            prog(bufs[i + 1], bufs[i], vals=(3,))
    count = iter(range(1, 1 << 30))

    async def queue_changing() -> None:
        await q_sym.submit({n: next(count)})

    async def graph_changing() -> None:
        await g_sym(n=next(count))

    async def queue_const() -> None:
        await q_const.submit()

    async def graph_const() -> None:
        await g_const()

    ops: dict[str, AsyncOp] = {
        "queue changing": queue_changing,
        "queue constants": queue_const,
        "graph changing": graph_changing,
        "graph constants": graph_const,
    }
    s = await interleave(ops, rounds=plan.rounds, per_round=plan.per_batch, warmup=3)
    rows: list[list[str]] = []
    lines: list[str] = []
    for what in ("queue", "graph"):
        ch, co = s[f"{what} changing"], s[f"{what} constants"]
        r = paired_ratio(ch, co)
        rows.append([sec, f"{PATCH_KERNELS}-exec {what}, value changing each submit", *_lat(ch),
                     f"{fmt_ratio(r)} constants"])  # fmt: skip
        rows.append([sec, f"{PATCH_KERNELS}-exec {what}, constants", *_lat(co), "ref"])
        lines.append(
            verdict(f"6 {what}: changing Variable <= 1.5x constants (paired)", r <= 1.5,
                    f"{fmt_ratio(r)}: {fmt_ns(ch.p50)} vs {fmt_ns(co.p50)}")
        )  # fmt: skip
    return rows, lines
