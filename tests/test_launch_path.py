"""The launch path (issue 18): the engine's doorbell, and short copies run inline.

Inline copies must keep every ordering guarantee of the queued path: queue order on a
busy queue, hazards on other queues, faults, staging; the engine's doorbell must lose no
wake-up and close its eventfd with the device.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

import hcqa
import hcqa.testing as ht
from hcqa import DeviceFault, Signal
from hcqa import commands as cmd
from hcqa._native.lane import library
from hcqa._signals.rereader import watch
from hcqa.actors.engine import Engine
from hcqa.devices.cpu import INLINE_COPY_MAX, CpuDevice

MIB = 1 << 20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1


async def test_short_transfer_on_idle_queues_is_done_when_the_call_returns() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        src, dst = d0.alloc(MIB), d1.alloc(MIB)
        data = np.random.default_rng(1).integers(0, 256, MIB, dtype=np.uint8)
        await src.copyin(data)
        await d1.synchronize()
        fence = hcqa.transfer(dst, src)
        assert fence.reached  # ran inline: no engine hop
        assert np.array_equal(dst.numpy_view(), data)
        await fence
        assert d0.timeline.value == d0._timeline.reserved  # the source's step completed too
        out = np.zeros(MIB, np.uint8)
        f_out = dst.copyout(out)
        assert f_out.reached
        assert np.array_equal(out, data)


async def test_short_copy_behind_a_waiting_queue_keeps_queue_order() -> None:
    async with hcqa.open_device("cpu:0") as d:
        buf = d.alloc(MIB)
        gate = Signal(name="gate")
        try:
            d.copy_queue().wait(gate, 1).submit()  # holds the copy queue
            await trio.testing.wait_all_tasks_blocked()
            ones = np.ones(MIB, np.uint8)
            fence = buf.copyin(ones)
            assert not fence.reached  # queued behind the wait, not run inline
            assert not buf.numpy_view().any()
            gate.value = 1
            await fence
            assert (buf.numpy_view() == 1).all()
        finally:
            gate.close()


async def test_short_copy_waits_for_a_hazard_on_another_queue() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        x, y = d0.alloc(MIB), d1.alloc(MIB)
        hold, gate = ht.hanging_kernel(d0)
        fill = d0.program("fill", lambda a: a.fill(9))
        try:
            hold(x)
            fill(x)  # writes x, behind the held kernel
            fence = hcqa.transfer(y, x)  # must wait for that write
            assert not fence.reached
        finally:
            gate.close()
        await fence
        assert (y.numpy_view() == 9).all()


async def test_inline_copy_fault_is_the_device_fault() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        x, y = d0.alloc(4096), d1.alloc(4096)
        with ht.fail_next_copy(d1) as inj:
            fence = hcqa.transfer(y, x)
        assert inj.fired == 1
        with pytest.raises(DeviceFault) as info:
            await fence
        assert info.value is d1.faulted
        assert isinstance(info.value.__cause__, ht.InjectedFault)
        assert d0.faulted is None  # the source only lent its memory


@pytest.mark.parametrize("host_visible", [True, False])
async def test_which_copies_may_run_inline(host_visible: bool) -> None:
    async with hcqa.open_device("cpu:0", host_visible=host_visible) as d:
        assert isinstance(d, CpuDevice)
        a, b = d.alloc(INLINE_COPY_MAX + 1), d.alloc(INLINE_COPY_MAX + 1)
        host = np.zeros(INLINE_COPY_MAX, np.uint8)
        ref = cmd.HostMemoryRef(va_addr=host.ctypes.data, nbytes=host.nbytes, keep=host)
        assert d._inline(cmd.Copy(dest=a, src=b, nbytes=INLINE_COPY_MAX))
        assert not d._inline(cmd.Copy(dest=a, src=b, nbytes=INLINE_COPY_MAX + 1))
        assert not d._inline(cmd.Copy(dest=a, src=b, nbytes=hcqa.Variable("n", 1, 8)))
        # host copies through the staging ring stay on the copy engine
        assert d._inline(cmd.Copy(dest=a, src=ref, nbytes=host.nbytes)) is host_visible
        assert not d._inline(cmd.Load(dest=a, path="/dev/null", offset=0, nbytes=1))


async def test_a_short_copy_of_a_file_mapping_goes_to_the_copy_engine(tmp_path: Any) -> None:
    """A host array that maps a file may page-fault on the disk: never copied inline
    (nor a view of it, nor an ``mmap``), and copied right by the engine. Plain host memory
    of the same size may run inline."""
    import mmap

    from hcqa.devices.hostarrays import host_ref

    path = tmp_path / "data.bin"
    data = np.arange(4096, dtype=np.uint8)
    data.tofile(path)
    async with hcqa.open_device("cpu:0") as d:
        buf = d.alloc(4096)

        def inline(host: Any, *, out: bool = False) -> bool:
            ref = host_ref(host, buf, writable=out)
            ends = {"dest": ref, "src": buf} if out else {"dest": buf, "src": ref}
            return d._inline(cmd.Copy(nbytes=4096, **ends))

        assert inline(np.zeros(4096, np.uint8))
        assert inline(np.zeros(4096, np.uint8), out=True)
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        with open(path, "rb") as f:
            raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            for src in (mapped, mapped[:], np.frombuffer(raw, np.uint8), memoryview(raw)):
                assert not inline(src), type(src)
                buf.numpy_view()[:] = 0
                await buf.copyin(src)
                assert np.array_equal(buf.numpy_view(), data)
            del src
            out = np.memmap(tmp_path / "out.bin", dtype=np.uint8, mode="w+", shape=(4096,))
            assert not inline(out, out=True)
            await buf.copyout(out)
            assert np.array_equal(out, data)
            del out
        finally:
            del mapped
            gc.collect()
            raw.close()


async def test_copies_of_every_size_land_in_order_on_one_queue() -> None:
    # Inline and engine copies interleaved on one queue: each later copy sees the earlier.
    async with hcqa.open_device("cpu:0") as d:
        big = d.alloc(3 * MIB)
        small = d.alloc(MIB)
        out = np.zeros(MIB, np.uint8)
        for k in range(1, 6):
            f1 = big.copyin(np.full(3 * MIB, k, np.uint8))  # engine
            f2 = d.copy_queue().copy(small, big.view(2 * MIB, MIB), MIB).submit()
            f3 = small.copyout(out)
            await f1
            await f2
            await f3
            assert (out == k).all()


async def test_doorbell_wakes_for_every_burst_and_is_closed_with_the_device() -> None:
    before = _fds()
    async with hcqa.open_device("cpu:0") as d:
        buf = d.alloc(8)
        count = d.program("count", lambda a: a.view(np.int64).__iadd__(1))
        for burst in (1, 2, 7, 1, 64):
            fences = [count(buf) for _ in range(burst)]
            await fences[-1]
            assert all(f.reached for f in fences)
        assert int(buf.numpy_view().view(np.int64)[0]) == 75
    assert _fds() == before  # the doorbells went with the engines


async def test_writes_below_every_target_do_not_wake_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = Signal(name="stepping")
    drains = 0
    drain = Signal._drain

    def counting(self: Signal) -> None:
        nonlocal drains
        drains += 1
        drain(self)

    monkeypatch.setattr(Signal, "_drain", counting)
    rereader = watch()  # its timer may also write the eventfd (memory-only producers)
    ticks = rereader.ticks
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.wait, 30)
            nursery.start_soon(s.wait, 15)  # parked behind the owner: woken at 15
            await trio.testing.wait_all_tasks_blocked()
            for k in range(1, 31):
                s.value = k
                for _ in range(3):  # loop turns: a written eventfd would be seen here
                    await trio.lowlevel.checkpoint()
            assert s.value == 30
        # at 15 and at 30 (plus any re-reader tick), none for the 28 writes below both
        assert drains <= 2 + (rereader.ticks - ticks)
    finally:
        s.close()


async def test_a_timeline_wakes_its_waiter_only_at_the_awaited_step() -> None:
    async with hcqa.open_device("cpu:0") as d:
        buf = d.alloc(8)
        count = d.program("count", lambda a: a.view(np.int64).__iadd__(1))
        fences = [count(buf) for _ in range(50)]
        await fences[-1]
        assert all(f.reached for f in fences)
        assert int(buf.numpy_view().view(np.int64)[0]) == 50


async def test_a_fence_wait_needs_no_re_reader_yet_keeps_its_hang_limit() -> None:
    # Every write of a timeline goes through the engine's set, which writes the eventfd
    # for a listed waiter: the owner of a fence's wait sleeps without the re-reader's
    # timer, and its hang limit is still timed.
    async with hcqa.open_device("cpu:0") as d:
        buf = d.alloc(8)
        gate = Signal(name="gate")
        try:
            d.compute_queue().wait(gate, 1).submit()
            fence = d.program("one", lambda a: a.__setitem__(0, 1))(buf)
            rereader = watch()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fence.wait)
                await trio.testing.wait_all_tasks_blocked()
                assert fence.signal.statistics().owner == "task"
                assert fence.signal not in rereader.watched
                assert [t.signal for t in rereader.timed.values()].count(fence.signal) == 1
                gate.value = 1
            assert fence.reached and buf.numpy_view()[0] == 1
            assert not rereader.timed
        finally:
            gate.close()


# -- short C kernels run inline once measured ---------------------------------------------------

# Writes the id of the thread that runs it into out[0:8]; first spins out[8:16] times.
TID_C = """
#include <sys/syscall.h>
#include <unistd.h>
void tid(unsigned char *out) {
    long long *p = (long long *)out;
    for (volatile long long i = 0; i < p[1]; i++) {}
    p[0] = (long long)syscall(SYS_gettid);
}
"""
SPIN = 3_000_000  # iterations: milliseconds, far over SHORT_CALL_NS


async def _ran_on(d: hcqa.Device, prog: hcqa.Program, buf: hcqa.Buffer) -> tuple[str, bool]:
    """Call ``prog(buf)``; which thread ran it ("loop" or "engine"), and whether its fence
    was reached when the call returned."""
    fence = prog(buf)
    reached = fence.reached
    await fence
    tid = int(buf.numpy_view().view(np.int64)[0])
    return ("loop" if tid == threading.get_native_id() else "engine"), reached


async def test_a_short_kernel_runs_inline_once_measured_and_stays_exact() -> None:
    from hcqa.devices.launch import INLINE_AFTER

    async with hcqa.open_device("cpu:0", inline_kernels=True) as d:
        buf = d.alloc(16)
        prog = d.program("tid", TID_C)
        seen = [await _ran_on(d, prog, buf) for _ in range(1 + INLINE_AFTER)]
        assert all(where == "engine" for where, _ in seen)  # the first call, then measured
        for _ in range(200):  # a measured call slowed by the host starts the count again
            where, reached = await _ran_on(d, prog, buf)
            if where == "loop":
                assert reached  # done when the call returned: no engine hop
                break
        else:
            pytest.fail("a short kernel never ran inline")
        before = d.compute.statistics()
        fences = [prog(buf) for _ in range(3)]  # back to back: the queue stays idle
        assert all(f.reached for f in fences)
        assert d.compute.statistics().completed == before.completed + 3
        other = d.alloc(16)  # other arguments: a new record, measured again
        assert (await _ran_on(d, prog, other))[0] == "engine"


async def test_a_kernel_slow_from_the_start_never_runs_inline() -> None:
    async with hcqa.open_device("cpu:0", inline_kernels=True) as d:
        buf = d.alloc(16)
        buf.numpy_view().view(np.int64)[1] = SPIN
        prog = d.program("tid", TID_C)
        for _ in range(6):
            assert (await _ran_on(d, prog, buf))[0] == "engine"


async def test_an_inline_kernel_that_turns_slow_goes_back_to_the_engine() -> None:
    async with hcqa.open_device("cpu:0", inline_kernels=True) as d:
        buf = d.alloc(16)
        prog = d.program("tid", TID_C)
        for _ in range(200):
            if (await _ran_on(d, prog, buf))[0] == "loop":
                break
        else:
            pytest.fail("a short kernel never ran inline")
        buf.numpy_view().view(np.int64)[1] = SPIN  # same arguments, more work
        assert (await _ran_on(d, prog, buf))[0] == "loop"  # this one is measured long ...
        for _ in range(3):  # ... so the next ones run on the engine again
            assert (await _ran_on(d, prog, buf))[0] == "engine"


@pytest.mark.parametrize("options", [{}, {"inline_kernels": False}])
async def test_by_default_every_kernel_runs_on_its_engine(options: dict[str, bool]) -> None:
    """The event loop never runs a kernel unless the device opted in: not a short repeat
    C kernel (far past INLINE_AFTER short calls in a row), not a Python kernel."""
    async with hcqa.open_device("cpu:0", **options) as d:
        assert d.inline_kernels is False
        buf = d.alloc(16)
        prog = d.program("tid", TID_C)
        for _ in range(50):
            where, _ = await _ran_on(d, prog, buf)
            assert where == "engine"
        ran_on: list[int] = []
        py = d.program("py", lambda out: ran_on.append(threading.get_native_id()))
        for _ in range(10):
            await py(buf)
        assert threading.get_native_id() not in ran_on
    with pytest.raises(hcqa.InvalidCommand, match=r"'inline_kernels' must be a bool \(got int\)"):
        async with hcqa.open_device("cpu:0", inline_kernels=1):
            pass


# Spins until CLOCK_MONOTONIC has advanced out[0] ns (0: returns at once).
SPIN_NS_C = """
#define _POSIX_C_SOURCE 200809L
#include <time.h>
static long long now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}
void spin_ns(long long *ns) {
    long long end = now() + ns[0];
    while (now() < end) {}
}
"""


async def _loop_lag_during(d: hcqa.Device, long_ns: int) -> float:
    """Warm ``spin_ns`` with short repeat calls, make the same call long and return the
    longest gap (s) a 1 ms heartbeat saw on the event loop while it ran."""
    buf = d.alloc(shape=(1,), dtype="int64")
    prog = d.program("spin_ns", SPIN_NS_C)
    for _ in range(20):  # short: measured, and inline where allowed
        await prog(buf)
    gaps: list[float] = []
    done = False

    async def heartbeat() -> None:
        last = trio.current_time()
        while not done:
            await trio.sleep(0.001)
            now = trio.current_time()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat)
        await trio.testing.wait_all_tasks_blocked()
        buf.numpy_view()[0] = long_ns  # same buffers, same vals: a repeat call, long now
        await prog(buf)
        done = True
    return max(gaps)


async def test_a_long_c_kernel_leaves_the_loop_running_by_default() -> None:
    """A repeat C kernel that turns long (300 ms) runs on the engine: the loop's
    heartbeat keeps beating. Opted in, the same call holds the loop for its whole time
    (what the opt-in's documentation warns of)."""
    long_ns = 300_000_000
    async with hcqa.open_device("cpu:0") as d:
        lag = await _loop_lag_during(d, long_ns)
    assert lag < 0.1, f"the event loop stalled {lag * 1e3:.0f} ms while a kernel ran"
    async with hcqa.open_device("cpu:0", inline_kernels=True) as d:
        for _ in range(20):  # a host under load can make a short call slow: retry
            lag = await _loop_lag_during(d, long_ns)
            if lag >= 0.25:
                break
        assert lag >= 0.25, "the opted-in kernel never ran inline"


# -- a program's launch record (the repeat-call fast path) ------------------------------------

SETV_C = "void setv(unsigned char *out, int v) { out[0] = (unsigned char)v; }\n"


async def test_repeat_calls_reuse_the_record_and_still_run_with_their_own_arguments() -> None:
    async with hcqa.open_device("cpu:0") as d:
        a, b = d.alloc(8), d.alloc(8)
        setv = d.program("setv", SETV_C, entry="setv")
        await setv(a, vals=(5,))
        record = setv._launch
        assert record is not None
        await setv(a, vals=(5,))
        assert setv._launch is record  # matched: no new record
        assert a.numpy_view()[0] == 5
        await setv(a, vals=[7])  # equal ints in a list: vals compared, not reused
        assert a.numpy_view()[0] == 7
        await setv(b, vals=(7,))  # another buffer: a new record, the right address
        assert b.numpy_view()[0] == 7
        vals = [9]
        await setv(b, vals=vals)
        vals[0] = 11  # a list changed in place after a call is seen on the next
        await setv(b, vals=vals)
        assert b.numpy_view()[0] == 11
        await setv(b, vals=(np.int32(12),))  # numpy ints take the checked path, accepted
        assert b.numpy_view()[0] == 12


async def test_repeat_calls_refuse_exactly_what_a_first_call_refuses() -> None:
    async with hcqa.open_device("cpu:0") as d:
        a = d.alloc(8)
        setv = d.program("setv", SETV_C, entry="setv")
        await setv(a, vals=(1,))
        with pytest.raises(hcqa.InvalidCommand, match="val 0 must be an int"):
            setv(a, vals=(True,))  # equal to 1, but a bool
        with pytest.raises(hcqa.InvalidCommand, match="val 0 must be an int"):
            setv(a, vals=(1.0,))
        with pytest.raises(hcqa.InvalidCommand, match="must be in"):
            setv(a, vals=(2**40,))
        with pytest.raises(hcqa.InvalidCommand, match="can't receive 'global_size'"):
            setv(a, vals=(1,), global_size=(2, 1, 1))
        await setv(a, vals=(1,))  # the record still serves
        a.free()
        with pytest.raises(hcqa.InvalidCommand, match="was freed"):
            setv(a, vals=(1,))
        assert d.timeline.value == d._timeline.reserved  # nothing queued by a refusal


async def test_repeat_calls_on_a_faulted_or_closed_device_raise_its_error() -> None:
    async with hcqa.open_device("cpu:0") as d:
        buf = d.alloc(8)
        fail = [False]

        def flaky(a: object) -> None:
            if fail[0]:
                raise ht.InjectedFault("flaky kernel")

        prog = d.program("flaky", flaky)
        await prog(buf)
        fail[0] = True
        with pytest.raises(DeviceFault) as info:
            await prog(buf)  # a recorded call
        with pytest.raises(DeviceFault) as again:
            prog(buf)  # sticky: the record does not skip the device check
        assert again.value is info.value
    with pytest.raises(hcqa.DeviceClosed):
        prog(buf)


async def test_launch_record_holds_its_buffers_weakly() -> None:
    async with hcqa.open_device("cpu:0") as d:
        noop = d.program("noop", lambda a: None)
        flush = d.program("flush", lambda a: None)
        buf = d.alloc(4096)
        await noop(buf)
        assert noop._launch is not None
        await flush(d.alloc(8))  # the engine has moved on to another run: it holds none of buf
        ref = weakref.ref(buf)
        del buf
        gc.collect()
        assert ref() is None  # the program kept no buffer alive
        again = d.alloc(4096)  # maybe at the same address: a new record, not the old one
        await noop(again)
        assert noop._launch is not None and noop._launch.buffers[0]() is again


async def test_a_recorded_call_inside_a_capture_is_captured_not_run() -> None:
    async with hcqa.open_device("cpu:0") as d:
        a = d.alloc(8)
        setv = d.program("setv", SETV_C, entry="setv")
        await setv(a, vals=(3,))
        with hcqa.capture() as g:
            setv(a, vals=(3,))
        a.numpy_view()[0] = 0
        await d.synchronize()
        assert a.numpy_view()[0] == 0  # recorded, not run
        await g()
        assert a.numpy_view()[0] == 3


# -- the engine's direct native calls ----------------------------------------------------------


async def test_an_exec_carries_its_native_call_and_evolve_rebuilds_it() -> None:
    async with hcqa.open_device("cpu:0") as d:
        a, b = d.alloc(8), d.alloc(8)
        setv = d.program("setv", SETV_C, entry="setv")
        e = setv.validate((a,), (4,), (1, 1, 1), (1, 1, 1))
        assert e.call is not None
        moved = attrs.evolve(e, buffers=(b,), args=setv.c_args((b,), (6,)))
        assert moved.call is not e.call
        moved.call()  # the new arguments, not the old ones
        assert (a.numpy_view()[0], b.numpy_view()[0]) == (0, 6)
        py = d.program("py", lambda x: None)
        assert py.validate((a,), (), (1, 1, 1), (1, 1, 1)).call is None  # Python: a handler


async def test_a_failing_direct_call_faults_the_device_like_a_handler() -> None:
    # the Python engine's direct call (a native lane calls the kernel from C instead)
    async with hcqa.open_device("cpu:0", inline_kernels=True) as d:
        a = d.alloc(8)
        setv = d.program("setv", SETV_C, entry="setv")
        e = setv.validate((a,), (4,), (1, 1, 1), (1, 1, 1))

        def boom() -> None:
            raise ht.InjectedFault("native call failed")

        object.__setattr__(e, "call", boom)
        bad = setv._enqueue(e)
        try:
            after: hcqa.Fence | None = setv(a, vals=(9,))  # behind it: skipped
        except DeviceFault:
            after = None  # or refused, if the fault came first: sticky either way
        with pytest.raises(DeviceFault, match="program 'setv' failed") as info:
            await bad
        assert isinstance(info.value.__cause__, ht.InjectedFault)
        if after is not None:
            with pytest.raises(DeviceFault):
                await after
        assert a.numpy_view()[0] == 0  # nothing ran after the fault


def test_an_engine_without_native_calls_runs_every_exec_through_its_handler() -> None:
    seen: list[object] = []
    engine = Engine("fake", {cmd.Exec: seen.append}, on_fault=lambda c, e: None)
    try:

        class Kernel:
            fn = staticmethod(lambda *args: seen.append("direct"))

        class Prog:
            kernel = Kernel()

        e = cmd.Exec(program=Prog(), buffers=(), args=(1,))  # type: ignore[arg-type]
        assert e.call is not None
        engine.run_inline([e])
        assert seen == [e]  # the handler, never the direct call
    finally:
        engine.join()


def test_a_lean_command_maker_builds_what_the_class_builds() -> None:
    sig = Signal(name="maker")
    try:
        make = cmd.maker(cmd.Signal)
        lean, full = make(sig, 7, None), cmd.Signal(signal=sig, value=7)
        assert lean == full and type(lean) is cmd.Signal
        assert [getattr(lean, f.name) for f in attrs.fields(cmd.Signal)] == [sig, 7, None]
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            lean.value = 8  # type: ignore[misc]
        with pytest.raises(TypeError):
            make(sig, 7)  # every field, positionally: none is filled in
    finally:
        sig.close()


async def test_a_repeat_call_makes_the_exec_a_first_call_makes() -> None:
    async with hcqa.open_device("cpu:0") as d:
        a = d.alloc(8)
        setv = d.program("setv", SETV_C, entry="setv")
        py = d.program("py", lambda x: None)
        for prog, vals in ((setv, (4,)), (py, ())):
            await prog(a, vals=vals)
            launch = prog._launch
            assert launch is not None
            first = prog.validate((a,), vals, (1, 1, 1), (1, 1, 1))
            again = launch.exec_for(prog, (a,))
            assert again == first
            assert (again.args, again.inline, again.native) == (first.args, False, None)
            # a C kernel's call is the timed one (the record's); a Python kernel has none
            assert (again.call is None) == (first.call is None) == (prog is py)
        # Once a repeat call went through the native lane, the next ones carry its record
        # (C) or its "needs Python" (Python), and still run every time.
        for prog, vals in ((setv, (4,)), (py, ())):
            await prog(a, vals=vals)
            launch = prog._launch
            assert launch is not None
            if library() is not None:
                assert launch.native is not None
            assert launch.exec_for(prog, (a,)).native is launch.native
        a.numpy_view()[0] = 0
        for _ in range(3):
            await setv(a, vals=(4,))
            assert a.numpy_view()[0] == 4
            a.numpy_view()[0] = 0


async def test_a_launch_record_keeps_no_executor_record_that_may_hold_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(CpuDevice, "shares_native", False)  # as a device whose records do
    async with hcqa.open_device("cpu:0") as d:
        a = d.alloc(8)
        setv = d.program("setv", SETV_C, entry="setv")
        for _ in range(3):
            await setv(a, vals=(4,))
        assert setv._launch is not None and setv._launch.native is None
        assert a.numpy_view()[0] == 4
