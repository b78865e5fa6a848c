"""OpenCL benchmarks: hcqa's ``opencl:0`` against raw PyOpenCL on the same device, in one run.

Run from the repository root::

    python -m bench.bench_opencl           # full run (about a minute)
    python -m bench.bench_opencl --quick   # short run (< 30 s)

The peer is PyOpenCL driving the same OpenCL device directly: its own context and in-order
queue, kernels built from the same source, every wait a blocking ``event.wait()`` (it blocks the
calling thread, here the event loop: that is what hcqa must not do, and what it is measured
against). The floor is hcqa's numpy-thread floor: a persistent thread woken through an eventfd
runs ``np.add`` on 16 ints (or 100 of them, or ``numpy.copyto``) and wakes the trio task
through a second eventfd -- the two wake-ups any launch needs and nothing else.

Every op of a section is interleaved with the others round by round, in a rotating order;
ratios are medians of per-round ratios (``paired``), which host-load drift between rounds
does not move.

1. launch + await of a one-work-item kernel: hcqa ``await k(buf)`` vs PyOpenCL
   ``enqueue_nd_range_kernel(...).wait()`` (target: hcqa <= 1.2x, paired).
2. 100 kernels per submit: an hcqa ``Queue`` of 100 execs, submitted and awaited, vs a loop of
   100 ``enqueue_nd_range_kernel`` and a wait on the last event (target <= 1.2x per kernel).
3. copies of 1 and 64 MiB, host -> device, device -> host, device -> device (two hcqa devices
   on ``opencl:0``; PyOpenCL between two of its buffers): ``copyin`` / ``copyout`` /
   ``hcqa.transfer`` vs ``enqueue_copy(...).wait()`` (target: >= 0.9x its bandwidth).
4. CPU while a queue waits 1 s on a signal nobody sets: hcqa with a ``wait`` queued and a
   kernel behind it, PyOpenCL with a kernel gated by a user event (target: hcqa < 1 % of a
   core, the OpenCL runtime's threads included).
5. A compute/copy chain: kernel, transfer, kernel, transfer, ... (8 steps, each reading what
   the last wrote), alternating the compute and copy queues of ``opencl:0``, against the same
   chain with the transfers as copy kernels on the compute queue alone (target <= 1.15x,
   paired): the cross-queue waits are kept by the driver (event wait lists). Beside them, the
   same alternating chain with every wait gated on the host (the path before driver-kept
   waits), for reference.
6. A changing Variable: a 200-exec ``Queue`` and a 200-launch graph resubmitted with a value
   that changes every submit, against the same with constants (target <= 1.5x, paired): the
   commands are sent as built and the launch records' arguments patched in place.

Pinned to one CPU (``taskset -c 0 python -m bench.bench_opencl``: wake-ups are fast and nothing
overlaps, so every µs of Python shows) the run also judges the pinned targets: launch + await
<= 2x PyOpenCL, 100 kernels per submit <= 1.3x, 1 MiB copies >= 0.8x its bandwidth.

Without an OpenCL device in this hcqa (or without PyOpenCL) the hcqa side is skipped and its
targets say so; the peer and the floor still run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import trio

import hcqa
from bench._opencl_path import _lat, chain_section, patch_section
from bench._series import (
    AsyncOp,
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

MiB = 1 << 20

# Pinned to one CPU (``taskset -c 0``): the run also judges the pinned-mode targets.
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
PINNED = CPUS == 1

CL_SOURCE = """
__kernel void inc(__global int *x) { x[0] += 1; }
"""


class Peer:
    """Raw PyOpenCL on the device ``opencl:0`` names: a context, an in-order queue, ``inc``."""

    def __init__(self) -> None:
        import pyopencl as cl

        from hcqa.devices.opencl import platforms

        self.cl = cl
        self.device = platforms.cl_device(0)
        self.ctx = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.ctx)
        self.kernel = cl.Program(self.ctx, CL_SOURCE).build().inc
        self.counter = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, 4)
        cl.enqueue_fill_buffer(self.queue, self.counter, np.int32(0), 0, 4).wait()
        self.kernel.set_args(self.counter)
        self.version = cl.VERSION_TEXT
        self.name = self.device.name.strip()

    def launch(self) -> None:
        self.cl.enqueue_nd_range_kernel(self.queue, self.kernel, (1,), (1,)).wait()

    def hundred(self) -> None:
        cl, q, k = self.cl, self.queue, self.kernel
        for _ in range(99):
            cl.enqueue_nd_range_kernel(q, k, (1,), (1,))
        cl.enqueue_nd_range_kernel(q, k, (1,), (1,)).wait()

    def count(self) -> int:
        out = np.zeros(1, np.int32)
        self.cl.enqueue_copy(self.queue, out, self.counter).wait()
        return int(out[0])

    def copies(self, size: int) -> dict[str, Callable[[], None]]:
        cl, q = self.cl, self.queue
        a = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, size)
        b = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, size)
        h_in = np.full(size, 7, np.uint8)
        h_out = np.zeros(size, np.uint8)
        return {
            "h2d": lambda: cl.enqueue_copy(q, a, h_in).wait(),
            "d2h": lambda: cl.enqueue_copy(q, h_out, a).wait(),
            "d2d": lambda: cl.enqueue_copy(q, b, a).wait(),
        }

    def gated(self) -> Callable[[], None]:
        """A kernel behind a user event nobody sets yet; returns what releases it."""
        gate = self.cl.UserEvent(self.ctx)
        event = self.cl.enqueue_nd_range_kernel(
            self.queue, self.kernel, (1,), (1,), wait_for=[gate]
        )

        def release() -> None:
            gate.set_status(self.cl.command_execution_status.COMPLETE)
            event.wait()

        return release


class Plan:
    def __init__(
        self,
        *,
        rounds: int,
        per_launch: int,
        per_batch: int,
        per_copy: dict[int, int],
        per_chain: int,
    ):
        self.rounds = rounds
        self.per_launch = per_launch
        self.per_batch = per_batch
        self.per_copy = per_copy
        self.per_chain = per_chain


FULL = Plan(
    rounds=30, per_launch=100, per_batch=5, per_copy={1 * MiB: 40, 64 * MiB: 3}, per_chain=20
)
QUICK = Plan(
    rounds=5, per_launch=40, per_batch=2, per_copy={1 * MiB: 10, 64 * MiB: 1}, per_chain=10
)


def _against_pyopencl(
    s: dict[str, Series],
    *,
    sec: str,
    hcqa: str,
    peer: str,
    floor: str,
    target: str,
    about: str,
    per: str = "",
    pinned: tuple[str, float] | None = None,
) -> tuple[list[list[str]], list[str]]:
    """Rows and verdicts of a section that measured ``pyopencl`` and the numpy ``floor``, and
    ``hcqa`` where an OpenCL device opened: hcqa <= 1.2x PyOpenCL, both against the floor;
    ``pinned``: (target, limit) judged too when the process runs on one CPU."""
    fl, cl = s["floor"], s["pyopencl"]
    rows = [
        [sec, peer, *_lat(cl), f"ref; {fmt_ratio(paired_ratio(cl, fl))} floor"],
        [sec, floor, *_lat(fl), "ref"],
    ]
    if "hcqa" not in s:
        return rows, [verdict(target, None, "no hcqa opencl device")]
    h = s["hcqa"]
    r = paired_ratio(h, cl)
    rows.insert(
        0, [sec, hcqa, *_lat(h), f"{fmt_ratio(r)} PyOpenCL; {fmt_ratio(paired_ratio(h, fl))} floor"]
    )
    seen = f"{fmt_ratio(r)}: {fmt_ns(h.p50)} vs {fmt_ns(cl.p50)}"
    lines = [verdict(target, r <= 1.2, seen)]
    if pinned is not None and PINNED:
        lines.append(verdict(pinned[0], r <= pinned[1], seen))
    return rows, [
        *lines,
        info(about, f"hcqa {fmt_ratio(paired_ratio(h, fl))}, PyOpenCL "
             f"{fmt_ratio(paired_ratio(cl, fl))} ({fmt_ns(fl.p50)}{per})"),
    ]  # fmt: skip


async def launch_section(dev: Any, peer: Peer, plan: Plan) -> tuple[list[list[str]], list[str]]:
    ints = np.zeros(16, np.int64)
    floor = EventfdFloor(lambda: np.add(ints, 1, out=ints))
    ops: dict[str, AsyncOp] = {"pyopencl": sync_op(peer.launch), "floor": floor.launch}
    if dev is not None:
        buf = dev.alloc(4)
        await buf.copyin(np.zeros(1, np.int32))
        k = dev.program("inc", CL_SOURCE, entry="inc")

        async def hcqa_launch() -> None:
            await k(buf)

        ops["hcqa"] = hcqa_launch
    try:
        s = await interleave(ops, rounds=plan.rounds, per_round=plan.per_launch)
    finally:
        floor.close()
    return _against_pyopencl(
        s,
        sec="1 launch+await",
        hcqa="hcqa `await k(buf)` on opencl:0",
        peer="PyOpenCL `enqueue_nd_range_kernel(...).wait()` (blocks the loop)",
        floor="floor: numpy thread (np.add, 16 ints) woken and waking by eventfd",
        target="1a launch+await of a tiny kernel <= 1.2x PyOpenCL enqueue + event.wait() (paired)",
        about="1 launch+await vs the numpy-thread floor",
        pinned=("1b pinned to one CPU: launch+await <= 2x PyOpenCL (paired)", 2.0),
    )


async def batch_section(dev: Any, peer: Peer, plan: Plan) -> tuple[list[list[str]], list[str]]:
    n = 100
    ints = np.zeros(16, np.int64)

    def hundred_adds() -> None:
        for _ in range(n):
            np.add(ints, 1, out=ints)

    floor = EventfdFloor(hundred_adds)
    ops: dict[str, AsyncOp] = {"pyopencl": sync_op(peer.hundred), "floor": floor.launch}
    if dev is not None:
        buf = dev.alloc(4)
        await buf.copyin(np.zeros(1, np.int32))
        k = dev.program("inc", CL_SOURCE, entry="inc")
        q = dev.compute_queue()
        for _ in range(n):
            q.exec(k, (buf,))

        async def hcqa_batch() -> None:
            await q.submit()

        ops["hcqa"] = hcqa_batch
    units = dict.fromkeys(ops, n)
    try:
        s = await interleave(ops, rounds=plan.rounds, per_round=plan.per_batch, units=units)
    finally:
        floor.close()
    return _against_pyopencl(
        s,
        sec="2 100 kernels/submit",
        hcqa="hcqa Queue of 100 × exec, `await q.submit()` (per kernel)",
        peer="PyOpenCL: 100 × `enqueue_nd_range_kernel`, wait on the last (per kernel)",
        floor="floor: numpy thread runs 100 np.add per wake (per add)",
        target="2a 100 kernels per submit <= 1.2x a PyOpenCL enqueue loop (paired, per kernel)",
        about="2 per kernel vs the numpy-thread floor",
        per=" per np.add",
        pinned=("2b pinned to one CPU: 100 kernels per submit <= 1.3x PyOpenCL (per kernel)", 1.3),
    )


async def copy_section(
    devs: tuple[Any, Any] | None, peer: Peer, plan: Plan
) -> tuple[list[list[str]], list[str]]:
    rows: list[list[str]] = []
    lines: list[str] = []
    sec = "3 copies"
    what = {"h2d": "host → device", "d2h": "device → host", "d2d": "device → device"}
    for size, per in plan.per_copy.items():
        label = f"{size // MiB} MiB"
        raw = peer.copies(size)
        h_src = np.full(size, 7, np.uint8)
        h_dst = np.zeros(size, np.uint8)

        def copyto(h_dst: Any = h_dst, h_src: Any = h_src) -> None:
            np.copyto(h_dst, h_src)

        ops: dict[str, AsyncOp] = {f"pyopencl {k}": sync_op(fn) for k, fn in raw.items()}
        ops["numpy"] = sync_op(copyto)
        if devs is not None:
            g0, g1 = devs
            x = g0.alloc(size)
            y = g1.alloc(size)
            h_in = np.full(size, 7, np.uint8)
            h_out = np.zeros(size, np.uint8)

            async def h2d(x: Any = x, h: Any = h_in) -> None:
                await x.copyin(h)

            async def d2h(x: Any = x, h: Any = h_out) -> None:
                await x.copyout(h)

            async def d2d(y: Any = y, x: Any = x) -> None:
                await hcqa.transfer(y, x)

            ops.update({"hcqa h2d": h2d, "hcqa d2h": d2h, "hcqa d2d": d2d})
        s = await interleave(ops, rounds=plan.rounds, per_round=per, warmup=2)
        ref = s["numpy"]
        for key, words in what.items():
            p = s[f"pyopencl {key}"]
            if devs is not None:
                h = s[f"hcqa {key}"]
                r = 1 / paired_ratio(h, p)
                hcqa_call = {"h2d": "copyin", "d2h": "copyout", "d2d": "hcqa.transfer"}[key]
                rows.append(
                    [sec, f"hcqa `{hcqa_call}` {words}, {label}", *_lat(h),
                     f"{gbps(size, h.p50)}; {fmt_ratio(r)} PyOpenCL's bandwidth"]
                )  # fmt: skip
                lines.append(
                    verdict(f"3 {words} {label} >= 0.9x PyOpenCL enqueue_copy bandwidth (paired)",
                            r >= 0.9, f"{fmt_ratio(r)}: {gbps(size, h.p50)} vs "
                            f"{gbps(size, p.p50)}")
                )  # fmt: skip
                if PINNED and size == MiB:
                    lines.append(
                        verdict(f"3b pinned to one CPU: {words} 1 MiB >= 0.8x PyOpenCL bandwidth",
                                r >= 0.8, f"{fmt_ratio(r)}: {gbps(size, h.p50)} vs "
                                f"{gbps(size, p.p50)}")
                    )  # fmt: skip
            else:
                lines.append(
                    verdict(f"3 {words} {label} >= 0.9x PyOpenCL enqueue_copy bandwidth",
                            None, "no hcqa opencl device")
                )  # fmt: skip
            rows.append(
                [sec, f"PyOpenCL `enqueue_copy(...).wait()` {words}, {label}", *_lat(p),
                 f"{gbps(size, p.p50)}; {fmt_ratio(1 / paired_ratio(p, ref))} numpy's"]
            )  # fmt: skip
        rows.append([sec, f"floor: numpy.copyto, {label}", *_lat(ref), f"{gbps(size, ref.p50)}"])
        if devs is not None:
            ok = (h_out[:: 1 << 12] == 7).all()
            if not ok:
                raise RuntimeError(f"hcqa's {label} copyout did not bring back what copyin sent")
    return rows, lines


def _cpu_during(seconds: float) -> Callable[[], Any]:
    """``async`` helper: the process CPU (all threads) while the loop sleeps ``seconds``."""

    async def measure() -> float:
        t0 = time.process_time()
        await trio.sleep(seconds)
        return (time.process_time() - t0) / seconds

    return measure


async def idle_section(dev: Any, peer: Peer) -> tuple[list[list[str]], list[str]]:
    sec = "4 idle CPU"
    measure = _cpu_during(1.0)
    release = peer.gated()
    raw = await measure()
    release()
    rows = [[sec, "PyOpenCL: a kernel gated by an unset user event, 1 s",
             f"{raw * 100:.2f} % of a core", "-", "-", "ref"]]  # fmt: skip
    name = "4a CPU while a queue waits 1 s < 1 % of a core"
    if dev is None:
        return rows, [verdict(name, None, "no hcqa opencl device")]
    buf = dev.alloc(4)
    k = dev.program("inc", CL_SOURCE, entry="inc")
    gate = hcqa.Signal(name="bench gate")
    fence = dev.compute_queue().wait(gate, 1).exec(k, (buf,)).submit()
    await trio.sleep(0.05)  # let the queue reach the wait before measuring
    used = await measure()
    gate.value = 1
    await fence
    rows.insert(
        0,
        [
            sec,
            "hcqa: a queue parked on `wait(signal, 1)`, a kernel behind it, 1 s",
            f"{used * 100:.2f} % of a core",
            "-",
            "-",
            f"PyOpenCL {raw * 100:.2f} %",
        ],
    )
    return rows, [verdict(name, used < 0.01, f"{used * 100:.2f} %; PyOpenCL {raw * 100:.2f} %")]


async def main(quick: bool) -> None:
    plan = QUICK if quick else FULL
    t_start = time.perf_counter()
    try:
        peer = Peer()
    except ImportError as exc:
        print(verdict("OpenCL benchmarks", None, f"needs PyOpenCL and an OpenCL device: {exc}"))
        return
    rows: list[list[str]] = []
    lines: list[str] = []
    why = ""
    async with contextlib.AsyncExitStack() as stack:
        devs: tuple[Any, Any, Any] | None = None
        try:  # two hcqa devices on one OpenCL device: transfers between them are device -> device
            devs = await stack.enter_async_context(
                hcqa.open_devices("opencl:0", "opencl:0", "opencl:0", inline_kernels=False)
            )
        except hcqa.InvalidCommand as exc:  # opencl:N unknown to this hcqa
            why = f"hcqa side skipped: {exc}"
        dev = devs[0] if devs is not None else None
        if devs is not None:  # the third gates every wait on the host (the path before)
            for actor in devs[2]._queues.values():
                actor._hold = None
        for part in (
            await launch_section(dev, peer, plan),
            await batch_section(dev, peer, plan),
            await copy_section(devs[:2] if devs is not None else None, peer, plan),
            await idle_section(dev, peer),
            await chain_section(devs, plan),
            await patch_section(dev, plan),
        ):
            rows.extend(part[0])
            lines.extend(part[1])
    if peer.count() <= 0:
        raise RuntimeError("the PyOpenCL kernel never ran")
    threads = os.environ.get("POCL_MAX_PTHREAD_COUNT", "PoCL's default")
    mode = "pinned to one CPU" if PINNED else f"{CPUS} CPUs"
    note = (
        f"peer: PyOpenCL {peer.version} on {peer.name}; POCL_MAX_PTHREAD_COUNT {threads}; "
        f"host mode: {mode}"
    )
    print(header("bench_opencl", quick, note))
    print(markdown_table(["section", "case", "p50", "mean", "p90", "rate / ratio"], rows))
    print_footer(why or None, lines, t_start)


def cli(argv: Sequence[str] | None = None) -> None:
    run_quick_cli(main, __doc__, argv)


if __name__ == "__main__":
    cli(sys.argv[1:])
