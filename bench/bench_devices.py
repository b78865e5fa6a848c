"""Device benchmarks: launch latency, command throughput, copies -- against floors
and the peer, measured side by side in one run.

Run from the repository root::

    python -m bench.bench_devices           # full run (about a minute)
    python -m bench.bench_devices --quick   # short run (< 30 s)

What is measured (every row of one section is interleaved with the others, round by round, in
a rotating order, so host-load drift hits all sides alike; ratios are what to quote):

1. launch + await of a tiny kernel -- a Python callable that does nothing to a 64-byte buffer,
   and a C no-op -- ``await prog(buf)`` vs ``await trio.to_thread.run_sync(same_fn, ...)``;
   per-op p50 / mean (target: hcqa at most 1.0x of to_thread), and the floor: a
   persistent thread woken by an eventfd runs the C no-op and wakes the task through another
   eventfd (targets, as medians of per-round ratios: hcqa C <= 2.0x the floor and <= 1.0x
   tinygrad's call + synchronize).
2. commands per second through one queue: a ``Queue`` of 100 execs of a C no-op, and one of
   100 signals, submitted again and again (end to end: first submit to last fence reached),
   vs the floor, a trio memory channel carrying 100 commands per message to a task that
   dispatches each (target: 100 execs per submit <= 3x the floor per command). A queue of C
   kernels submitted again goes fused (one native call over an argument table), so the
   signals' queue is the one that measures a command's own way through the queue.
3. ``hcqa.transfer`` cpu:0 -> cpu:1 of 1 MiB (target p50 <= 100 us or <= 2x numpy.copyto),
   64 and 256 MiB vs ``numpy.copyto`` (target >= 0.8x its bandwidth, aim 0.95x); copyin /
   copyout of 64 MiB with ``host_visible=True`` and ``False`` (the staging ring).
   ``--quick`` skips 256 MiB.
4. the peer, tinygrad 0.14's CPU device, when importable: a direct program call + synchronize
   of a tiny kernel, cross-device copies of 1 and 256 MiB (``CPU:0`` -> ``CPU:1``).

The helpers (``interleave``, ``Series``, the formatting) are in ``bench._series``, shared with
``bench.bench_graph`` and ``bench.bench_opencl``; percentiles and the table come from
``bench._util``.
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

import hcqa
from bench._series import (
    AsyncOp,
    MiB,
    Series,
    fmt_ns,
    fmt_ratio,
    gbps,
    header,
    info,
    interleave,
    paired_ratio,
    sync_op,
    verdict,
)
from bench._util import EventfdFloor, markdown_table, print_footer, run_quick_cli

# -- the benchmark ------------------------------------------------------------------------

NOOP_C = "void noop(unsigned char *out) { (void)out; }\n"


def noop(out: Any) -> None:
    """The Python kernel: does nothing to its 64-byte buffer."""


@dataclass
class Plan:
    rounds_launch: int
    per_launch: int
    rounds_cmds: int
    per_cmds: int
    batches: int  # batches of 100 commands per timed op
    rounds_copy: int
    per_copy: dict[int, int]  # size -> ops per round


FULL = Plan(
    rounds_launch=60,
    per_launch=100,
    rounds_cmds=20,
    per_cmds=4,
    batches=50,
    rounds_copy=20,
    per_copy={1 * MiB: 100, 64 * MiB: 4, 256 * MiB: 2},
)
QUICK = Plan(
    rounds_launch=6,
    per_launch=50,
    rounds_cmds=4,
    per_cmds=2,
    batches=20,
    rounds_copy=3,
    per_copy={1 * MiB: 30, 64 * MiB: 2},  # no 256 MiB: its first touches alone take seconds
)


async def launch_section(
    d0: hcqa.Device, d_inline: hcqa.Device, peer: Any, plan: Plan
) -> tuple[list[list[str]], list[str]]:
    """``d0`` has the default (every kernel on its engine thread); ``d_inline`` is opened
    with ``inline_kernels=True``: its short repeat C launches run on the caller's thread."""
    buf = d0.alloc(64)
    arr = np.zeros(64, np.uint8)
    py = d0.program("noop", noop)
    c = d0.program("noop", NOOP_C)
    ebuf = d_inline.alloc(64)
    ec = d_inline.program("noop", NOOP_C)
    assert c.kernel is not None
    cfn, addr = c.kernel.fn, buf.va_addr
    to_thread = trio.to_thread.run_sync

    async def hcqa_py() -> None:
        await py(buf)

    async def thread_py() -> None:
        await to_thread(noop, arr)

    async def hcqa_c() -> None:
        await c(buf)

    async def thread_c() -> None:
        await to_thread(cfn, addr)

    async def hcqa_c_inline() -> None:
        await ec(ebuf)

    floor = EventfdFloor(functools.partial(cfn, addr))  # the C no-op
    ops: dict[str, AsyncOp] = {
        "hcqa py": hcqa_py,
        "to_thread py": thread_py,
        "hcqa c": hcqa_c,
        "to_thread c": thread_c,
        "hcqa c inline": hcqa_c_inline,
        "floor": floor.launch,
    }
    if peer is not None:
        ops["tinygrad"] = sync_op(peer.call_program)
    try:
        s = await interleave(ops, rounds=plan.rounds_launch, per_round=plan.per_launch)
    finally:
        floor.close()
    pf_c = paired_ratio(s["hcqa c"], s["floor"])
    pf_py = paired_ratio(s["hcqa py"], s["floor"])
    pf_ci = paired_ratio(s["hcqa c inline"], s["floor"])
    lane = type(d0.compute.engine).__name__ == "LaneEngine"
    how = "the native lane" if lane else "the engine thread"
    r_py = s["hcqa py"].p50 / s["to_thread py"].p50
    r_c = s["hcqa c"].p50 / s["to_thread c"].p50
    rm_py = s["hcqa py"].mean / s["to_thread py"].mean
    rm_c = s["hcqa c"].mean / s["to_thread c"].mean
    pr_py = paired_ratio(s["hcqa py"], s["to_thread py"])
    pr_c = paired_ratio(s["hcqa c"], s["to_thread c"])
    sec = "1 launch+await"
    rows = [
        [sec, "Python no-op, hcqa `await prog(buf)`", *_lat(s["hcqa py"]),
         f"{fmt_ratio(r_py)} to_thread (mean {fmt_ratio(rm_py)}, paired {fmt_ratio(pr_py)})"],
        [sec, "Python no-op, `await trio.to_thread.run_sync(fn, arr)`",
         *_lat(s["to_thread py"]), "ref"],
        [sec, "C no-op, hcqa `await prog(buf)`", *_lat(s["hcqa c"]),
         f"{fmt_ratio(r_c)} to_thread (mean {fmt_ratio(rm_c)}, paired {fmt_ratio(pr_c)})"],
        [sec, "C no-op, `await trio.to_thread.run_sync(cfn, addr)`",
         *_lat(s["to_thread c"]), "ref"],
        [sec, "C no-op, hcqa inline on the caller's thread (opt-in `inline_kernels=True`)",
         *_lat(s["hcqa c inline"]), f"{fmt_ratio(pf_ci)} the floor (paired)"],
        [sec, "floor: eventfd-woken thread runs the C no-op, eventfd wakes the task",
         *_lat(s["floor"]), f"ref; hcqa C {fmt_ratio(pf_c)}, Python {fmt_ratio(pf_py)} (paired)"],
    ]  # fmt: skip
    lines = [
        verdict("1a launch+await Python kernel <= 1.0x to_thread (p50)", r_py <= 1.0,
                f"{fmt_ratio(r_py)}: {fmt_ns(s['hcqa py'].p50)} vs "
                f"{fmt_ns(s['to_thread py'].p50)}; per-round paired ratio {fmt_ratio(pr_py)}"),
        verdict("1b launch+await C kernel <= 1.0x to_thread (p50)", r_c <= 1.0,
                f"{fmt_ratio(r_c)}: {fmt_ns(s['hcqa c'].p50)} vs "
                f"{fmt_ns(s['to_thread c'].p50)}; per-round paired ratio {fmt_ratio(pr_c)}"),
        verdict("1c launch+await C kernel <= 2.0x the eventfd floor (paired)", pf_c <= 2.0,
                f"{fmt_ratio(pf_c)}: {fmt_ns(s['hcqa c'].p50)} vs {fmt_ns(s['floor'].p50)}"),
        info("1e C launch+await inline (opt-in inline_kernels=True) vs the floor",
             f"{fmt_ratio(pf_ci)} paired: {fmt_ns(s['hcqa c inline'].p50)} vs "
             f"{fmt_ns(s['floor'].p50)}"),
        verdict(f"1f launch+await C kernel through {how} <= 1.25x the eventfd floor (paired)",
                pf_c <= 1.25, f"{fmt_ratio(pf_c)}"),
        verdict(f"1g launch+await Python kernel through {how} <= 1.25x the eventfd floor "
                "(paired)", pf_py <= 1.25, f"{fmt_ratio(pf_py)}: {fmt_ns(s['hcqa py'].p50)} vs "
                f"{fmt_ns(s['floor'].p50)}"),
    ]  # fmt: skip
    if peer is not None:
        tg = s["tinygrad"]
        pt_c = paired_ratio(s["hcqa c"], tg)
        lines.append(
            verdict("1d launch+await C kernel <= 1.0x tinygrad call+synchronize (paired)",
                    pt_c <= 1.0, f"{fmt_ratio(pt_c)}: {fmt_ns(s['hcqa c'].p50)} vs "
                    f"{fmt_ns(tg.p50)}")
        )  # fmt: skip
        rows.append(
            ["4 peer", f"tinygrad {peer.version} CPU: `prg(buf)` + `synchronize()`, C no-op",
             *_lat(tg), f"hcqa C is {fmt_ratio(s['hcqa c'].p50 / tg.p50)} of it"]
        )  # fmt: skip
        lines.append(
            info("4a launch vs tinygrad", f"hcqa C launch+await p50 is "
                 f"{fmt_ratio(s['hcqa c'].p50 / tg.p50)} of tinygrad's call+synchronize "
                 f"({fmt_ns(s['hcqa c'].p50)} vs {fmt_ns(tg.p50)})")
        )  # fmt: skip
    return rows, lines


def _lat(s: Series) -> list[str]:
    return [fmt_ns(s.p50), fmt_ns(s.mean), fmt_ns(s.p90)]


async def commands_section(d0: hcqa.Device, plan: Plan) -> tuple[list[list[str]], list[str]]:
    per_batch = 100
    buf = d0.alloc(64)
    c = d0.program("noop", NOOP_C)
    q_exec = d0.compute_queue()
    for _ in range(per_batch):
        q_exec.exec(c, (buf,))
    sig = hcqa.Signal(name="bench signal-only")
    q_sig = d0.compute_queue()
    for k in range(1, per_batch + 1):
        q_sig.signal(sig, k)
    m = plan.batches
    submit_side: dict[str, list[float]] = {"exec": [], "signal": []}
    clock = time.perf_counter_ns

    def through(q: hcqa.Queue, key: str) -> AsyncOp:
        side = submit_side[key]

        async def op() -> None:
            t0 = clock()
            for _ in range(m - 1):
                q.submit()
            fence = q.submit()
            side.append((clock() - t0) / (m * per_batch))
            await fence

        return op

    # The floor: a trio memory channel, 100 commands per message, to a task that
    # dispatches each command through a table (what a queue actor does at the least).
    send, recv = trio.open_memory_channel[list[Any] | None](math.inf)
    commands = [("exec", i) for i in range(per_batch)]
    done: list[trio.Event] = [trio.Event()]
    table: dict[type, int] = {tuple: 1}

    async def consumer() -> None:
        async for msg in recv:
            if msg is None:
                done[0].set()
                continue
            for command in msg:
                table.get(type(command))

    async def floor() -> None:
        done[0] = trio.Event()
        for _ in range(m):
            await send.send(commands)
        await send.send(None)
        await done[0].wait()

    units = m * per_batch
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        s = await interleave(
            {
                "hcqa exec": through(q_exec, "exec"),
                "hcqa signal": through(q_sig, "signal"),
                "floor": floor,
            },
            rounds=plan.rounds_cmds,
            per_round=plan.per_cmds,
            units={"hcqa exec": units, "hcqa signal": units, "floor": units},
        )
        await send.aclose()
    fl = s["floor"].p50
    sec = "2 commands/s"

    def rate(x: Series) -> str:
        return f"{1e3 / x.p50:.3g} M cmd/s"

    sub_exec = statistics.median(submit_side["exec"])
    sub_sig = statistics.median(submit_side["signal"])
    rows = [
        [sec, f"hcqa Queue of 100 × exec(C no-op), {m} submits → fence (per command)",
         *_lat(s["hcqa exec"]), f"{rate(s['hcqa exec'])}; "
         f"{fmt_ratio(s['hcqa exec'].p50 / fl)} floor"],
        [sec, "… of which caller-side `submit()` (per command)", fmt_ns(sub_exec), "-", "-",
         f"{fmt_ratio(sub_exec / fl)} floor"],
        [sec, f"hcqa Queue of 100 × signal, {m} submits → fence (per command)",
         *_lat(s["hcqa signal"]), f"{rate(s['hcqa signal'])}; "
         f"{fmt_ratio(s['hcqa signal'].p50 / fl)} floor"],
        [sec, "… of which caller-side `submit()` (per command)", fmt_ns(sub_sig), "-", "-",
         f"{fmt_ratio(sub_sig / fl)} floor"],
        [sec, "floor: trio memory channel, 100 commands/message (per command)",
         *_lat(s["floor"]), f"{rate(s['floor'])}; ref"],
    ]  # fmt: skip
    pr_exec = paired_ratio(s["hcqa exec"], s["floor"])
    pr_sig = paired_ratio(s["hcqa signal"], s["floor"])
    lines = [
        verdict("2a per-command cost (100 execs/submit) <= 3x the channel floor (paired)",
                pr_exec <= 3.0, f"{fmt_ratio(pr_exec)}; 100 signals/submit {fmt_ratio(pr_sig)}"),
        verdict("2b per-command cost (100 signals/submit) <= 3x the channel floor (paired)",
                pr_sig <= 3.0, f"{fmt_ratio(pr_sig)}"),
        info("2 commands/s vs floor",
             f"exec {fmt_ns(s['hcqa exec'].p50)}/cmd = {fmt_ratio(s['hcqa exec'].p50 / fl)} the "
             f"floor's {fmt_ns(fl)}/cmd; signal {fmt_ns(s['hcqa signal'].p50)}/cmd = "
             f"{fmt_ratio(s['hcqa signal'].p50 / fl)}"),
    ]  # fmt: skip
    return rows, lines


async def copy_section(
    d0: hcqa.Device, d1: hcqa.Device, d2: hcqa.Device, peer: Any, plan: Plan
) -> tuple[list[list[str]], list[str]]:
    rows: list[list[str]] = []
    lines: list[str] = []
    sec = "3 copies"
    peer_sizes = {1 * MiB, 256 * MiB}
    results: dict[int, dict[str, Series]] = {}
    for size in plan.per_copy:
        src = d0.alloc(size)
        dst = d1.alloc(size)
        h_src = np.full(size, 7, np.uint8)
        h_dst = np.zeros(size, np.uint8)
        await src.copyin(h_src)
        await hcqa.transfer(dst, src)

        async def transfer(dst: hcqa.Buffer = dst, src: hcqa.Buffer = src) -> None:
            await hcqa.transfer(dst, src)

        def copyto(h_dst: Any = h_dst, h_src: Any = h_src) -> None:
            np.copyto(h_dst, h_src)

        ops: dict[str, AsyncOp] = {"hcqa": transfer, "numpy": sync_op(copyto)}
        if size == 64 * MiB:
            host_in = np.full(size, 7, np.uint8)  # src keeps its value: dst is checked
            host_out = np.zeros(size, np.uint8)
            staged = d2.alloc(size)
            for name, b in (("visible", src), ("staged", staged)):

                async def cin(b: hcqa.Buffer = b, h: Any = host_in) -> None:
                    await b.copyin(h)

                async def cout(b: hcqa.Buffer = b, h: Any = host_out) -> None:
                    await b.copyout(h)

                ops[f"copyin {name}"] = cin
                ops[f"copyout {name}"] = cout
        if peer is not None and size in peer_sizes:
            ops["tinygrad"] = sync_op(peer.copier(size))
        s = await interleave(ops, rounds=plan.rounds_copy, per_round=plan.per_copy[size], warmup=2)
        results[size] = s
        if not ((h_dst[::4096] == 7).all() and (dst.numpy_view()[::4096] == 7).all()):
            raise RuntimeError(f"a {size}-byte copy did not copy")
        label = f"{size // MiB} MiB"
        ref = s["numpy"].p50
        rows.append(
            [sec, f"hcqa.transfer cpu:0 → cpu:1, {label}", *_lat(s["hcqa"]),
             f"{gbps(size, s['hcqa'].p50)}; {fmt_ratio(ref / s['hcqa'].p50)} numpy bandwidth"]
        )  # fmt: skip
        rows.append([sec, f"numpy.copyto, {label}", *_lat(s["numpy"]), f"{gbps(size, ref)}; ref"])
        if size == 64 * MiB:
            for name, what in (
                ("copyin visible", "copyin, host_visible=True"),
                ("copyout visible", "copyout, host_visible=True"),
                ("copyin staged", "copyin, host_visible=False (staging ring)"),
                ("copyout staged", "copyout, host_visible=False (staging ring)"),
            ):
                x = s[name]
                rows.append(
                    [sec, f"{what}, {label}", *_lat(x),
                     f"{gbps(size, x.p50)}; {fmt_ratio(ref / x.p50)} numpy bandwidth"]
                )  # fmt: skip
        if "tinygrad" in s:
            tg = s["tinygrad"]
            rows.append(
                ["4 peer", f"tinygrad {peer.version} CPU:0 → CPU:1 eager `.to().realize()` + "
                 f"sync, {label}", *_lat(tg),
                 f"{gbps(size, tg.p50)}; {fmt_ratio(ref / tg.p50)} numpy bandwidth"]
            )  # fmt: skip
            lines.append(
                info(f"4 copy {label} vs tinygrad", f"hcqa transfer p50 is "
                     f"{fmt_ratio(s['hcqa'].p50 / tg.p50)} of tinygrad's "
                     f"({fmt_ns(s['hcqa'].p50)} vs {fmt_ns(tg.p50)})")
            )  # fmt: skip
        if size >= 64 * MiB:
            src.free()
            dst.free()
    one = results[1 * MiB]["hcqa"].p50
    pr_one = paired_ratio(results[1 * MiB]["hcqa"], results[1 * MiB]["numpy"])
    lines.insert(
        0,
        verdict("3a transfer 1 MiB p50 <= 100 µs or <= 2x numpy.copyto (paired)",
                one <= 100_000 or pr_one <= 2.0,
                f"{fmt_ns(one)}; numpy.copyto {fmt_ns(results[1 * MiB]['numpy'].p50)}; "
                f"paired {fmt_ratio(pr_one)}"),
    )  # fmt: skip
    for i, size in enumerate((64 * MiB, 256 * MiB)):
        name = f"3{'bc'[i]} transfer {size // MiB} MiB >= 0.8x numpy.copyto bandwidth"
        if size not in results:
            lines.insert(1 + i, verdict(name, None, "not measured in a quick run"))
            continue
        s = results[size]
        r = s["numpy"].p50 / s["hcqa"].p50
        pr = 1 / paired_ratio(s["hcqa"], s["numpy"])
        aim = "aim 0.95x reached" if r >= 0.95 else "aim 0.95x not reached"
        lines.insert(
            1 + i,
            verdict(name, r >= 0.8, f"{fmt_ratio(r)}, {gbps(size, s['hcqa'].p50)} vs "
                    f"{gbps(size, s['numpy'].p50)}; per-round paired {fmt_ratio(pr)}; {aim}"),
        )  # fmt: skip
    s64 = results[64 * MiB]
    ref = s64["numpy"].p50
    lines.insert(
        3,
        info("3d copyin/copyout 64 MiB vs numpy.copyto bandwidth (no numeric target)",
             ", ".join(f"{n} {fmt_ratio(ref / s64[n].p50)}" for n in
                       ("copyin visible", "copyout visible", "copyin staged", "copyout staged"))),
    )  # fmt: skip
    return rows, lines


async def main(quick: bool) -> None:
    from bench import _peer_tinygrad

    plan = QUICK if quick else FULL
    t_start = time.perf_counter()
    peer, why = _peer_tinygrad.load()
    note = f"peer: tinygrad {peer.version} CPU device" if peer is not None else why
    rows: list[list[str]] = []
    lines: list[str] = []
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        async with (
            hcqa.open_device("cpu:2", host_visible=False) as d2,
            hcqa.open_device("cpu:3", inline_kernels=True) as d3,
        ):
            for part in (
                await launch_section(d0, d3, peer, plan),
                await commands_section(d0, plan),
                await copy_section(d0, d1, d2, peer, plan),
            ):
                rows += part[0]
                lines += part[1]
    print(header("bench_devices", quick, note))
    print(markdown_table(["section", "case", "p50", "mean", "p90", "rate / ratio"], rows))
    print_footer(why if peer is None else None, lines, t_start)


def cli(argv: Sequence[str] | None = None) -> None:
    run_quick_cli(main, __doc__, argv)


if __name__ == "__main__":
    cli(sys.argv[1:])
