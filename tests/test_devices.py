"""Devices end to end: opening, programs, ordering, parallelism, faults, hangs, wrap, leaks."""

from __future__ import annotations

import gc
import os
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing
from _helpers import Counter
from _helpers import read as _read
from _kinds import Count, add1, spec, specs

import hcqa
from hcqa import (
    DeviceClosed,
    DeviceFault,
    DeviceStatistics,
    InvalidCommand,
    Signal,
    SignalTimeout,
    Variable,
)
from hcqa.actors import QueueStatistics

ADD1 = """
void add1(float *out, const float *a, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + 1.0f;
}
"""

SPIN = """
#define _POSIX_C_SOURCE 199309L
#include <time.h>
/* busy-waits for ms milliseconds: holds a core, not the GIL */
void spin(unsigned char *out, int ms) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) * 1000.0 + (t.tv_nsec - t0.tv_nsec) / 1e6 < ms);
    out[0] = 1;
}
"""

N = 64
F32 = np.float32


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _f32(seed: int, n: int = N) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal(n).astype(F32)


def _boom(out: npt.NDArray[Any]) -> None:
    raise ValueError("bad input 42")


# -- opening ---------------------------------------------------------------------------


async def test_open_device_name_timeline_synchronize(kind: str) -> None:
    async with hcqa.open_device(spec(kind)) as d:
        assert isinstance(d, hcqa.Device)
        assert isinstance(d, hcqa.CpuDevice) == (kind == "cpu")
        assert (d.name, d.kind) == (spec(kind), kind)
        assert isinstance(d.timeline, Signal)
        assert d.timeline.value == 0
        assert not d.closed
        await d.synchronize()  # nothing queued: returns
        fence = Count().program(d)(d.alloc(8))
        assert isinstance(fence, hcqa.Fence)
        assert fence.signal is d.timeline
        assert fence.value == 1
        await d.synchronize()
        assert fence.reached
        assert d.timeline.value == 1
    assert d.closed


async def test_open_devices_spec_spellings() -> None:
    async with hcqa.open_devices(" cpu:3 ", "cpu:0") as devices:
        assert [d.name for d in devices] == ["cpu:3", "cpu:0"]
    with pytest.raises(InvalidCommand, match=r"'cpu:N' .*\(got 'cpu'; did you mean 'cpu:0'\?\)"):
        async with hcqa.open_devices("cpu"):
            pass  # pragma: no cover


async def test_open_devices_yields_a_tuple(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind, 2)) as devices:
        assert isinstance(devices, tuple)
        d0, d1 = devices
        assert d0.name == spec(kind) and d1.name != d0.name  # opencl:0 twice: two devices
        assert d0.timeline is not d1.timeline
        await Count().program(d1)(d1.alloc(8))
        assert (d0.timeline.value, d1.timeline.value) == (0, 1)
        await d0.synchronize()
        await d1.synchronize()


@pytest.mark.parametrize(
    ("specs", "options", "error"),
    [
        ((), {}, InvalidCommand),
        (("cpu:0", "cpu:0"), {}, InvalidCommand),
        (("cpu:0", "cpu"), {}, InvalidCommand),
        (("opencl:99",), {}, InvalidCommand),  # no such device, or no OpenCL: said in words
        (("gpu:0",), {}, InvalidCommand),
        (("cpu:x",), {}, InvalidCommand),
        ((0,), {}, TypeError),
        (("cpu:0",), {"hang_limit": 0}, InvalidCommand),
        (("cpu:0",), {"hang_limit": "1"}, TypeError),
        (("cpu:0",), {"queue_depth": 0}, InvalidCommand),
        (("cpu:0",), {"host_visible": 1}, TypeError),
        (("cpu:0",), {"memory": 0}, InvalidCommand),
        (("cpu:0",), {"timeline_start": -1}, InvalidCommand),
        (("cpu:0",), {"colour": "red"}, TypeError),
    ],
)
async def test_open_devices_refuses_bad_arguments(
    specs: tuple[Any, ...], options: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        async with hcqa.open_devices(*specs, **options):
            pytest.fail("opened")


async def test_refused_open_leaks_no_fds_without_gc() -> None:
    gc.collect()
    gc.disable()
    try:
        before = fd_count()
        with pytest.raises(InvalidCommand):
            async with hcqa.open_devices("cpu:0", "cpu:0"):
                pass
        with pytest.raises(InvalidCommand):
            async with hcqa.open_devices("cpu:0", "nope:1"):
                pass
        assert fd_count() == before
    finally:
        gc.enable()
        gc.collect()


# -- programs ----------------------------------------------------------------------------


async def test_python_program_matches_numpy() -> None:
    def axpb(out: npt.NDArray[Any], a: npt.NDArray[Any], b: npt.NDArray[Any], k: int) -> None:
        out[:] = a * b + k

    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        prog = d.program("axpb", axpb)
        assert prog.kind == "python"
        a, b, out = (d.alloc(shape=(N,), dtype="float32") for _ in range(3))
        x, y = _f32(1), _f32(2)
        a.copyin(x)
        b.copyin(y)
        prog(out, a, b, vals=(3,))
        np.testing.assert_allclose(await _read(out), x * y + 3, rtol=1e-6)


async def test_c_program_matches_numpy() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        prog = d.program("add1", ADD1)
        assert prog.kind == "c"
        assert "add1" in repr(prog)
        a = d.alloc(shape=(N,), dtype="float32")
        out = d.alloc(shape=(N,), dtype="float32")
        x = _f32(3)
        a.copyin(x)
        out.copyin(np.zeros(N, F32))
        prog(out, a, vals=(N // 2,))
        got = await _read(out)
        np.testing.assert_array_equal(got[: N // 2], x[: N // 2] + 1)
        np.testing.assert_array_equal(got[N // 2 :], 0)
        # the same source again (cached), other entry name spelled out
        again = d.program("plus_one", ADD1, entry="add1")
        again(out, a, vals=(N,))
        np.testing.assert_array_equal(await _read(out), x + 1)


async def test_declared_writes_order_later_copies() -> None:
    """A program that writes its *second* buffer: a copyout of that buffer must wait for it."""

    def double_into(a: npt.NDArray[Any], out: npt.NDArray[Any]) -> None:
        time.sleep(0.02)  # a window for a copyout that forgot to wait
        out[:] = a * 2

    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        prog = d.program("double_into", double_into, writes=(1,), reads=(0,))
        a = d.alloc(shape=(N,), dtype="float32")
        out = d.alloc(shape=(N,), dtype="float32")
        x = _f32(4)
        a.copyin(x)
        out.copyin(np.zeros(N, F32))
        prog(a, out)
        np.testing.assert_array_equal(await _read(out), x * 2)
        # and a copyin into the read buffer waits for the program to have read it
        prog(a, out)
        a.copyin(np.zeros(N, F32))
        np.testing.assert_array_equal(await _read(out), x * 2)


async def test_declared_writes_positions_checked() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        with pytest.raises(InvalidCommand, match="writes"):
            d.program("add1", ADD1, writes=(2,))
        with pytest.raises(InvalidCommand, match="reads"):
            d.program("add1", ADD1, reads=(-1,))
        prog = d.program("py", Counter(), writes=(2,))
        a, b = d.alloc(8), d.alloc(8)
        before = d.statistics()
        with pytest.raises(InvalidCommand, match="position 2"):
            prog(a, b)
        assert d.statistics() == before


async def test_c_argument_count_errors(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = add1(d)
        a, b, c = (d.alloc(shape=(N,), dtype="float32") for _ in range(3))
        before = d.statistics()
        for bufs, vals in (((a,), (N,)), ((a, b, c), (N,)), ((a, b), ()), ((a, b), (N, 1))):
            with pytest.raises(InvalidCommand, match="takes 2 buffers and 1 vals"):
                prog(*bufs, vals=vals)
        assert d.statistics() == before


async def test_python_arity_errors() -> None:
    def two(out: Any, a: Any) -> None:
        pass

    def many(*args: Any) -> None:
        pass

    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        a, b = d.alloc(8), d.alloc(8)
        prog = d.program("two", two)
        with pytest.raises(InvalidCommand, match="takes 2 arguments"):
            prog(a)
        with pytest.raises(InvalidCommand, match="takes 2 arguments"):
            prog(a, b, vals=(1,))
        prog(a, vals=(1,))  # one buffer and one val: two arguments
        anything = d.program("many", many)
        anything(a, b, vals=(1, 2, 3))
        anything()
        await d.synchronize()


async def test_buffer_on_wrong_device(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind, 2), hang_limit=5) as (d0, d1):
        prog = add1(d0)
        a0 = d0.alloc(shape=(N,), dtype="float32")
        a1 = d1.alloc(shape=(N,), dtype="float32")
        with pytest.raises(InvalidCommand, match=re.escape(d1.name)):
            prog(a0, a1, vals=(N,))
        assert d0.statistics().timeline_reserved == 0
        assert d1.statistics().timeline_reserved == 0


async def test_c_compile_error_carries_compiler_message() -> None:
    src = "void broken(float *out) { out[0] = not_declared_anywhere; }"
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        with pytest.raises(InvalidCommand) as info:
            d.program("broken", src)
        assert "not_declared_anywhere" in str(info.value)
        assert "undeclared" in str(info.value)


async def test_c_val_out_of_int_range(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = add1(d)
        a, out = (d.alloc(shape=(N,), dtype="float32") for _ in range(2))
        for bad in (2**31, -(2**31) - 1, 2**64):
            with pytest.raises(InvalidCommand, match="'n'"):
                prog(out, a, vals=(bad,))
        await prog(out, a, vals=(-(2**31),))  # in range (a no-op loop)
        await prog(out, a, vals=(0,))


async def test_program_argument_types() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        prog = d.program("many", Counter())
        a = d.alloc(8)
        with pytest.raises(TypeError):
            prog(np.zeros(8))  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            prog(a, vals=(1.5,))  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            prog(a, vals=5)  # type: ignore[arg-type]
        with pytest.raises(InvalidCommand):
            prog(a, global_size=(0, 1, 1))
        with pytest.raises(TypeError):
            d.program("x", 42)
        with pytest.raises(InvalidCommand):
            d.program("", Counter())
        with pytest.raises(InvalidCommand, match="entry"):
            d.program("x", Counter(), entry="x")


async def test_unbound_variable_in_vals_outside_queue(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = add1(d)
        a, out = (d.alloc(shape=(N,), dtype="float32") for _ in range(2))
        n = Variable("n", 1, N)
        with pytest.raises(InvalidCommand, match="unbound"):
            prog(out, a, vals=(n,))
        assert d.statistics().timeline_reserved == 0


async def test_unbound_variable_in_global_size_outside_queue() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        prog = d.program("count", Counter())
        out = d.alloc(8)
        n = Variable("n", 1, N)
        with pytest.raises(InvalidCommand, match="unbound"):
            prog(out, global_size=(n, 1, 1))
        assert d.statistics().timeline_reserved == 0


# -- eager ordering across queues ------------------------------------------------------


async def test_eager_copyin_program_copyout(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = add1(d)
        a, out = (d.alloc(shape=(N,), dtype="float32") for _ in range(2))
        results = []
        for k in range(10):
            x = _f32(k)
            host = np.empty(N, F32)
            a.copyin(x)
            prog(out, a, vals=(N,))
            fence = out.copyout(host)
            results.append((fence, host, x + 1))
        for fence, host, want in results:
            await fence
            np.testing.assert_array_equal(host, want)


ADD_CL = f"""
__kernel void add(__global float *out, __global const float *a, int delay) {{
    for (int i = 0; i < {N}; i++) out[i] = a[i] + 1.0f;
}}
"""


@pytest.mark.parametrize("seed", range(6))
async def test_eager_random_interleavings(seed: int, kind: str) -> None:
    """Random copyins, programs, transfers and copyouts on shared buffers, never awaited
    in between: the hazard waits alone must give the sequential result."""
    rng = random.Random(seed)

    def add(out: npt.NDArray[Any], a: npt.NDArray[Any], delay_us: int) -> None:
        if delay_us:
            time.sleep(delay_us / 1e6)  # widens the window for a misordered copy
        out[:] = a + 1

    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = d.program("add", add) if kind == "cpu" else d.program("add", ADD_CL, entry="add")
        big = d.alloc(2 * N * 4)
        bufs = [d.alloc(shape=(N,), dtype="float32") for _ in range(3)]
        bufs.append(big.view(0, N * 4, dtype="float32"))
        bufs.append(big.view(N * 4, N * 4, dtype="float32"))
        model: list[npt.NDArray[np.float32]] = []
        for i, b in enumerate(bufs):
            x = _f32(100 * seed + i)
            b.copyin(x)
            model.append(x)
        checks: list[tuple[npt.NDArray[Any], npt.NDArray[Any]]] = []
        for step in range(40):
            op = rng.choice(["in", "prog", "prog", "xfer", "out"])
            i, j = rng.randrange(len(bufs)), rng.randrange(len(bufs))
            if op == "in":
                x = _f32(10_000 * seed + step)
                bufs[i].copyin(x)
                model[i] = x
            elif op == "prog":
                prog(bufs[i], bufs[j], vals=(rng.choice((0, 0, 1000)),))
                model[i] = model[j] + 1
            elif op == "xfer" and i != j:
                hcqa.transfer(bufs[i], bufs[j])
                model[i] = model[j].copy()
            else:
                host = np.empty(N, F32)
                bufs[i].copyout(host)
                checks.append((host, model[i].copy()))
        for i, b in enumerate(bufs):
            host = np.empty(N, F32)
            b.copyout(host)
            checks.append((host, model[i]))
        with trio.fail_after(10):
            await d.synchronize()
        for host, want in checks:
            np.testing.assert_array_equal(host, want)


# -- parallelism, responsiveness, no spinning ------------------------------------------


async def test_two_devices_run_in_parallel() -> None:
    """Each kernel waits at a barrier for the other: only concurrent execution passes it."""
    barrier = threading.Barrier(2, timeout=10)
    stamps: dict[str, tuple[float, float]] = {}

    def work(tag: str) -> Callable[[npt.NDArray[Any]], None]:
        def fn(out: npt.NDArray[Any]) -> None:
            t0 = time.perf_counter()
            barrier.wait()
            x = np.random.default_rng(0).random(200_000)
            for _ in range(5):
                x = np.sqrt(x * x + 1.0)
            out[:] = x[: out.size]
            stamps[tag] = (t0, time.perf_counter())

        return fn

    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=15) as (d0, d1):
        p0, p1 = d0.program("w0", work("a")), d1.program("w1", work("b"))
        o0 = d0.alloc(shape=(8,), dtype="float64")
        o1 = d1.alloc(shape=(8,), dtype="float64")
        f0, f1 = p0(o0), p1(o1)
        with trio.fail_after(15):
            await f0
            await f1
    (a0, a1), (b0, b1) = stamps["a"], stamps["b"]
    assert a0 < b1 and b0 < a1  # the intervals overlap


async def test_event_loop_stays_responsive_during_a_kernel() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        prog = d.program("spin", SPIN)
        out = d.alloc(8)
        await prog(out, vals=(1,))  # warm: compiled and loaded
        lags: list[float] = []
        stop = trio.Event()

        async def heartbeat() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                await trio.sleep(0.005)
                lags.append(time.perf_counter() - t - 0.005)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(heartbeat)
            t0 = time.perf_counter()
            with trio.fail_after(5):
                await prog(out, vals=(300,))
            elapsed = time.perf_counter() - t0
            stop.set()
        assert elapsed >= 0.29
        assert len(lags) >= 10
        assert max(lags) < 0.05


async def test_awaiting_a_long_kernel_burns_no_cpu() -> None:
    def nap(out: npt.NDArray[Any]) -> None:
        time.sleep(0.5)

    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        prog = d.program("nap", nap)
        out = d.alloc(8)
        fence = prog(out)
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        with trio.fail_after(5):
            await fence
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        assert wall >= 0.4
        assert cpu < 0.05 * wall


# -- faults ----------------------------------------------------------------------------


async def test_fault_has_cause_names_program_and_is_sticky() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        prog = d.program("boom", _boom)
        counter = Counter()
        after = d.program("after", counter)
        out = d.alloc(8)
        gate = hcqa.Signal()  # holds the queue so both are queued before the fault
        d.compute_queue().wait(gate, 1).submit()
        fence = prog(out)
        queued_after = after(out)
        gate.value = 1
        with pytest.raises(DeviceFault) as info:
            await fence
        gate.close()
        fault = info.value
        assert isinstance(fault.__cause__, ValueError)
        assert str(fault.__cause__) == "bad input 42"
        assert "'boom'" in str(fault)
        assert "cpu:0" in str(fault)
        assert (fault.device, fault.queue) == ("cpu:0", "compute")
        assert d.faulted is fault
        assert d.statistics().faulted
        with pytest.raises(DeviceFault) as again:
            await queued_after
        assert again.value is fault
        assert counter.calls == 0  # nothing runs after a fault
        for use in (
            lambda: prog(out),
            lambda: out.copyin(bytes(8)),
            lambda: d.alloc(8),
            lambda: d.compute_queue().signal(Signal(), 1),
        ):
            with pytest.raises(DeviceFault) as again:
                use()
            assert again.value is fault
        with pytest.raises(DeviceFault) as again:
            await d.synchronize()
        assert again.value is fault
    # observed already: leaving the block raises nothing


async def test_unobserved_fault_is_raised_at_exit() -> None:
    with pytest.raises(DeviceFault) as info:
        async with hcqa.open_device("cpu:0", hang_limit=5) as d:
            d.program("boom", _boom)(d.alloc(8))
    assert isinstance(info.value.__cause__, ValueError)
    assert "'boom'" in str(info.value)


async def test_fault_observed_by_synchronize_is_not_raised_again() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        d.program("boom", _boom)(d.alloc(8))
        with pytest.raises(DeviceFault):
            await d.synchronize()


async def test_body_exception_propagates_unchanged(kind: str) -> None:
    count = Count()
    gate = Signal()
    with pytest.raises(KeyError) as info:
        async with hcqa.open_device(spec(kind), hang_limit=5) as d:
            prog = count.program(d)
            out = d.alloc(8)
            done = prog(out)
            await done
            d.compute_queue().wait(gate, 1).submit()
            pending = prog(out)
            await trio.testing.wait_all_tasks_blocked()
            raise KeyError("from the body")
    assert type(info.value) is KeyError
    assert info.value.args == ("from the body",)
    if kind == "cpu":  # (an opencl device's memory can't be read once it is closed)
        assert count.python_calls == 1  # the pending run was cancelled, not run
    assert d.closed
    await done  # reached before close: returns
    with pytest.raises(DeviceClosed):
        await pending  # never reached


async def test_body_exception_wins_over_a_fault() -> None:
    with pytest.raises(KeyError):
        async with hcqa.open_device("cpu:0", hang_limit=5) as d:
            d.program("boom", _boom)(d.alloc(8))
            await trio.testing.wait_all_tasks_blocked()
            raise KeyError("body")


async def test_use_after_close_raises_device_closed(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = add1(d)
        a, out = (d.alloc(shape=(N,), dtype="float32") for _ in range(2))
        fence = prog(out, a, vals=(N,))
    assert fence.reached
    await fence  # a fence of a closed device returns when it was reached
    fence.wait_sync(timeout=1)
    with pytest.raises(DeviceClosed):
        d.alloc(8)
    with pytest.raises(DeviceClosed):
        prog(out, a, vals=(N,))
    with pytest.raises(DeviceClosed):
        a.copyin(np.zeros(N, F32))
    with pytest.raises(DeviceClosed):
        a.copyout(np.zeros(N, F32))
    with pytest.raises(DeviceClosed):
        Count().program(d)
    with pytest.raises(DeviceClosed):
        hcqa.transfer(out, a)
    assert d.statistics().closed


async def test_unreached_fence_of_closed_device_leaves_other_signals_alone(kind: str) -> None:
    """Regression: a wait on an already closed signal must not notify_closing its stale
    eventfd number, which a newer Signal may own (its waiter got ClosedResourceError)."""
    gate = Signal()
    with pytest.raises(KeyError):
        async with hcqa.open_device(spec(kind), hang_limit=5) as d:
            d.compute_queue().wait(gate, 1).submit()
            pending = Count().program(d)(d.alloc(8))
            await trio.testing.wait_all_tasks_blocked()
            raise KeyError("leave")
    stale = pending.signal.fd
    fresh = [Signal() for _ in range(20)]  # the lowest free fd numbers get reused
    others = [s for s in fresh if s.fd == stale]
    assert others, "no new signal reused the closed timeline's fd number"
    other = others[0]
    outcome: list[str] = []

    async def wait_other() -> None:
        try:
            await other.wait(1)
            outcome.append("reached")
        except Exception as exc:
            outcome.append(repr(exc))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_other)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(DeviceClosed):
                await pending
            await trio.testing.wait_all_tasks_blocked()
            other.value = 1
    assert outcome == ["reached"]


# -- hangs -------------------------------------------------------------------------------


async def test_hang_raises_signal_timeout_and_close_does_not_reraise() -> None:
    release = threading.Event()

    def stuck(out: npt.NDArray[Any]) -> None:
        release.wait(20)

    d: hcqa.Device | None = None
    try:
        with trio.fail_after(10):
            async with hcqa.open_device("cpu:0", hang_limit=1) as d:
                prog = d.program("stuck", stuck)
                out = d.alloc(8)
                fence = prog(out)
                with pytest.raises(SignalTimeout) as info:
                    await fence
                exc = info.value
                assert exc.signal == "cpu:0 timeline"
                assert exc.expected == fence.value == 1
                assert exc.seen == 0
                assert "'cpu:0 timeline' did not reach 1" in str(exc)
                assert "value 0" in str(exc)
                assert d.statistics().hung
                with pytest.raises(SignalTimeout) as again:
                    await d.synchronize()
                assert again.value is exc
        # leaving did not raise the timeout again, and did not wait for the stuck kernel
        assert d.closed
        assert not release.is_set()
    finally:
        release.set()
        if d is not None:
            assert d.compute.engine.join(timeout=10)


# -- timeline wrap ---------------------------------------------------------------------


async def test_timeline_wrap(kind: str) -> None:
    start = 2**31 - 5
    count = Count()
    async with hcqa.open_device(spec(kind), hang_limit=5, timeline_start=start) as d:
        first = d.timeline
        assert first.value == start
        prog = count.program(d)
        out, other = d.alloc(8), d.alloc(8)
        fences = [out.copyin(bytes(8))]  # the count starts at 0 (device memory is undefined)
        for k in range(20):
            fences.append(prog(out))
            if k % 3 == 0:  # mix in the copy queue: steps finish out of order
                fences.append(other.copyin(bytes([k]) * 8))
        with trio.fail_after(5):
            await d.synchronize()
            for f in fences:
                await f
        assert all(f.reached for f in fences)
        total = len(fences)
        assert d.statistics().timeline_reserved == start + total
        assert d.timeline is not first
        assert d.timeline.name == f"{d.name} timeline shadow"
        assert d.timeline.value == start + total - 2**31
        assert first.value == 2**31
        assert fences[0].signal is first
        assert fences[-1].signal is d.timeline
        # keeps working after the wrap
        await prog(out)
        await d.synchronize()
        assert d.timeline.value == start + total + 1 - 2**31
        assert await count.calls(out) == 21


# -- leaks, statistics -------------------------------------------------------------------


async def _cycle(host_visible: bool) -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=5, host_visible=host_visible) as (
        d0,
        d1,
    ):
        prog = d0.program("add1", ADD1)
        a, b = (d0.alloc(shape=(N,), dtype="float32") for _ in range(2))
        c = d1.alloc(shape=(N,), dtype="float32")
        x = _f32(7)
        a.copyin(x)
        prog(b, a, vals=(N,))
        hcqa.transfer(c, b)
        host = np.empty(N, F32)
        await c.copyout(host)
        np.testing.assert_array_equal(host, x + 1)
        await prog.timed(b, a, vals=(N,))
        await d0.synchronize()


async def test_open_close_cycles_leak_no_fds_or_threads() -> None:
    await _cycle(True)  # warm: signal pages, compiled kernel
    gc.collect()
    fds, threads = fd_count(), threading.active_count()
    idents = {t.ident for t in threading.enumerate()}
    for k in range(20):
        await _cycle(host_visible=bool(k % 2))
    gc.collect()
    # "<=" only so that a daemon thread another test left behind may end meanwhile: a leak
    # of one fd or thread per cycle would show as 20 more
    assert fd_count() <= fds
    assert threading.active_count() <= threads
    assert {t.ident for t in threading.enumerate()} <= idents  # no new thread survived


async def test_statistics_are_frozen_attrs(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        stats = d.statistics()
        assert attrs.has(DeviceStatistics)
        assert attrs.has(QueueStatistics)
        assert isinstance(stats, DeviceStatistics)
        assert all(isinstance(q, QueueStatistics) for q in stats.queues)
        assert [q.kind for q in stats.queues] == ["compute", "copy"]
        assert (stats.name, stats.timeline_value, stats.timeline_reserved) == (d.name, 0, 0)
        assert not (stats.faulted or stats.hung or stats.closed)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            stats.name = "x"  # type: ignore[misc]
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            stats.queues[0].submitted = 3  # type: ignore[misc]
        assert d.statistics() == stats
