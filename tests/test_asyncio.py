"""hcqa under asyncio: the same public calls, hosted in a trio guest run (hcqa.aio).

These tests are plain functions that call ``asyncio.run`` (pytest-trio leaves them alone).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import sniffio
import trio

import hcqa
from hcqa import aio
from hcqa.errors import DeviceClosed, DeviceFault, InvalidCommand, SignalTimeout
from hcqa.signals import Signal

TIMEOUT = 30.0

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


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    """``asyncio.run(fn())`` within TIMEOUT; afterwards no task, host or trio run is left."""

    async def bounded() -> Any:
        result = await asyncio.wait_for(fn(), TIMEOUT)
        assert asyncio.all_tasks() == {asyncio.current_task()}
        assert not aio._hosts
        assert not trio.lowlevel.in_trio_run()
        return result

    return asyncio.run(bounded())


def inc(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
    np.add(a, 1, out=out)


def double(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
    np.multiply(a, 2, out=out)


def gated(gate: threading.Event) -> Callable[..., None]:
    """A kernel that runs until ``gate`` is set, then adds 1."""

    def kernel(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
        assert gate.wait(TIMEOUT)
        np.add(a, 1, out=out)

    return kernel


def boom(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
    raise ValueError("kernel failed")


def test_detection() -> None:
    assert not aio.asyncio_caller()  # no async library at all

    async def under_asyncio() -> None:
        assert aio.asyncio_caller()

    async def under_trio() -> None:
        assert not aio.asyncio_caller()

    asyncio.run(under_asyncio())
    trio.run(under_trio)


# -- every public await ----------------------------------------------------------------


def test_every_public_await_under_asyncio() -> None:
    a = np.arange(64, dtype=np.float32)

    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            # between guest ticks trio's run is installed in this thread, but no trio task
            # runs: sniffio sees asyncio, and trio's task-level calls refuse
            assert trio.lowlevel.in_trio_run() and not trio.lowlevel.in_trio_task()
            assert sniffio.current_async_library() == "asyncio"
            with pytest.raises(RuntimeError):
                trio.lowlevel.current_task()
            x = d0.alloc(shape=(64,), dtype="float32")
            out = d0.alloc(shape=(64,), dtype="float32")
            y = d1.alloc(shape=(64,), dtype="float32")
            await x.copyin(a)
            prog = d0.program("inc", inc)
            await prog(out, x)
            await hcqa.transfer(y, out)
            host = np.empty(64, np.float32)
            await y.copyout(host)
            np.testing.assert_array_equal(host, a + 1)
            secs = await prog.timed(out, out)
            assert 0 < secs < TIMEOUT
            await d0.synchronize()
            await d1.synchronize()

            with hcqa.capture() as g:
                prog(out, x)
                hcqa.transfer(y, out)
            await x.copyin(a * 3)
            await g()
            await y.copyout(host)
            np.testing.assert_array_equal(host, a * 3 + 1)

            s = Signal()
            q = d0.compute_queue().wait(s, 1).exec(prog, (out, x)).signal(s, 2)
            fence = await q.submit_async()
            assert not fence.reached
            s.value = 1
            await s.wait(2)
            await fence
            s.close()

            pipe = hcqa.Pipeline([(d0, inc), (d1, double)], in_shape=(64,), depth=2)
            np.testing.assert_array_equal(await pipe(a), (a + 1) * 2)
            results = await pipe.map([a, a + 1, a + 2])
            for k, r in enumerate(results):
                np.testing.assert_array_equal(r, (a + k + 1) * 2)
        assert d0.closed and d1.closed
        with pytest.raises(DeviceClosed):
            prog(out, x)

    run(main)


def test_open_device_and_a_signal_without_any_device() -> None:
    async def main() -> None:
        async with hcqa.open_device("cpu:3") as d:
            assert d.name == "cpu:3"
        s = Signal()  # no host is running: a plain signal needs none
        thread = threading.Thread(target=lambda: setattr(s, "value", 5))
        waiting = asyncio.ensure_future(s.wait(5))
        await asyncio.sleep(0)
        assert s.statistics().owner == "thread" or s.statistics().waiters == 1
        thread.start()
        await waiting
        thread.join()
        s.close()

    run(main)


def test_process_pipeline_under_asyncio() -> None:
    x = np.arange(16, dtype=np.float32)

    async def main() -> None:
        async with hcqa.open_process_pipeline(
            ["hcqa.workers:add_one", "hcqa.workers:add_one"], in_shape=(16,), depth=2
        ) as pipe:
            results = await asyncio.gather(*(pipe(x + i) for i in range(6)))
            for i, y in enumerate(results):
                np.testing.assert_array_equal(y, x + i + 2)
            async with pipe.item() as item:  # zero-copy items too
                item.input[:] = x * 10
                np.testing.assert_array_equal(await item.run(), x * 10 + 2)
            pids = [w.pid for w in pipe.workers]
        for pid in pids:
            with pytest.raises(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)

    run(main)


def test_batcher_under_asyncio() -> None:
    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            pipe = hcqa.Pipeline([(d0, inc), (d1, double)], in_shape=(8, 4), depth=2)
            async with hcqa.open_batcher(pipe, max_wait=0.005) as batch:
                rows = [np.full(4, k, np.float32) for k in range(24)]
                outs = await asyncio.gather(*(batch(r) for r in rows))
                for r, y in zip(rows, outs, strict=True):
                    np.testing.assert_array_equal(y, (r + 1) * 2)
                stats = batch.statistics()
                assert stats.samples == 24 and stats.batches < 24  # rows were batched
                with pytest.raises(InvalidCommand, match="got float32"):
                    await batch(np.zeros(3, np.float32))

    run(main)


def test_asyncio_tasks_share_devices() -> None:
    a = np.arange(32, dtype=np.float32)

    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            pipe = hcqa.Pipeline([(d0, inc), (d1, double)], in_shape=(32,), depth=3)
            prog = d1.program("inc", inc)

            async def user(k: int) -> None:
                for j in range(5):
                    y = await pipe(a + k + j)
                    np.testing.assert_array_equal(y, (a + k + j + 1) * 2)
                    out = d1.alloc(shape=(32,), dtype="float32")
                    src = d1.alloc(shape=(32,), dtype="float32")
                    await src.copyin(y)
                    await prog(out, src)
                    host = np.empty(32, np.float32)
                    await out.copyout(host)
                    np.testing.assert_array_equal(host, y + 1)

            await asyncio.gather(*(user(k) for k in range(12)))
            assert pipe.statistics().completed == 60

    run(main)


# -- cancellation ------------------------------------------------------------------------


def test_wait_for_timeout_on_a_fence_leaves_the_work_to_complete() -> None:
    gate = threading.Event()
    a = np.arange(8, dtype=np.float32)

    async def main() -> None:
        async with hcqa.open_device("cpu:0", hang_limit=TIMEOUT) as d:
            x = d.alloc(shape=(8,), dtype="float32")
            out = d.alloc(shape=(8,), dtype="float32")
            await x.copyin(a)
            fence = d.program("slow", gated(gate))(out, x)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(fence.wait(), 0.05)
            assert not fence.reached
            assert d.timeline.statistics().waiters == 0  # the cancelled waiter left
            gate.set()
            await fence  # the queued kernel still ran
            host = np.empty(8, np.float32)
            await out.copyout(host)
            np.testing.assert_array_equal(host, a + 1)

    try:
        run(main)
    finally:
        gate.set()


def test_task_cancel_of_a_replay_and_a_pipeline_call() -> None:
    gate = threading.Event()
    a = np.arange(8, dtype=np.float32)

    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=TIMEOUT) as (d0, d1):
            x = d0.alloc(shape=(8,), dtype="float32")
            out = d0.alloc(shape=(8,), dtype="float32")
            y = d1.alloc(shape=(8,), dtype="float32")
            await x.copyin(a)
            slow = d0.program("slow", gated(gate))
            with hcqa.capture() as g:
                slow(out, x)
                hcqa.transfer(y, out)
            replay = asyncio.ensure_future(g())
            while g.statistics().replays < 1:  # the replay is queued ...
                await asyncio.sleep(0)
            replay.cancel()
            with pytest.raises(asyncio.CancelledError):
                await replay
            pipe = hcqa.Pipeline(
                [(d0, gated(gate)), (d1, double)], in_shape=(8,), depth=1, check=False
            )
            call = asyncio.ensure_future(pipe(a))
            while pipe.statistics().in_flight < 1:
                await asyncio.sleep(0)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert pipe.statistics().cancelled == 1
            gate.set()  # ... and still completes
            await d0.synchronize()
            await d1.synchronize()
            host = np.empty(8, np.float32)
            await y.copyout(host)
            np.testing.assert_array_equal(host, a + 1)
            np.testing.assert_array_equal(await pipe(a), (a + 1) * 2)  # the slot came back
            assert pipe.statistics().in_flight == 0

    try:
        run(main)
    finally:
        gate.set()


def test_cancelled_waiter_hands_the_eventfd_on() -> None:
    async def main() -> None:
        s = Signal()
        first = asyncio.ensure_future(s.wait(1))  # becomes the owner (add_reader)
        await asyncio.sleep(0)
        second = asyncio.ensure_future(s.wait(1))  # parked
        await asyncio.sleep(0)
        got: list[str] = []
        thread = threading.Thread(target=lambda: (s.wait_sync(1, 10), got.append("thread")))
        thread.start()
        while s.statistics().waiters < 3:
            await asyncio.sleep(0.001)
        assert s.statistics().owner == "thread" or s.statistics().owner == "none"
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        threading.Thread(target=lambda: setattr(s, "value", 1)).start()
        await asyncio.wait_for(second, TIMEOUT)
        await asyncio.to_thread(thread.join)
        assert got == ["thread"]
        s.close()

    run(main)


# -- errors ------------------------------------------------------------------------------


def test_errors_reach_asyncio_as_the_same_types() -> None:
    a = np.arange(8, dtype=np.float32)

    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            x = d0.alloc(shape=(8,), dtype="float32")
            with pytest.raises(InvalidCommand, match="32 bytes"):
                x.copyin(np.zeros(3, np.float32))
            with pytest.raises(InvalidCommand):
                await hcqa.Pipeline([(d0, inc)], in_shape=(8,))(np.zeros(3, np.float32))
            out = d0.alloc(shape=(8,), dtype="float32")
            y = d1.alloc(shape=(8,), dtype="float32")
            bad = d0.program("boom", boom)
            with hcqa.capture() as g:
                bad(out, x)
                hcqa.transfer(y, out)
            with pytest.raises(DeviceFault) as info:
                await g()
            assert type(info.value) is DeviceFault
            assert isinstance(info.value.__cause__, ValueError)
            with pytest.raises(DeviceFault) as again:
                await d0.synchronize()
            assert again.value is info.value
            with pytest.raises(DeviceFault):
                await x.copyin(a)

    run(main)


def test_unobserved_fault_is_raised_at_close() -> None:
    async def main() -> None:
        async with hcqa.open_device("cpu:0") as d:
            x = d.alloc(shape=(8,), dtype="float32")
            d.program("boom", boom)(x, x)

    with pytest.raises(DeviceFault):
        run(main)


def test_block_left_by_an_exception_cancels_and_propagates_unchanged() -> None:
    seen: list[BaseException] = []

    async def main() -> None:
        gate = Signal()  # never set: the queue stays blocked on it
        try:
            async with hcqa.open_device("cpu:0", hang_limit=TIMEOUT) as d:
                x = d.alloc(shape=(8,), dtype="float32")
                d.compute_queue().wait(gate, 1).submit()
                pending = d.program("inc", inc)(x, x)
                waiter = asyncio.ensure_future(pending.wait())
                await asyncio.sleep(0)
                raise KeyError("body")
        except KeyError as exc:
            seen.append(exc)
        with pytest.raises(DeviceClosed):
            await waiter  # parked on the device: woken with DeviceClosed
        with pytest.raises(DeviceClosed):
            await pending
        assert d.closed and not pending.reached
        gate.close()

    run(main)
    assert len(seen) == 1 and type(seen[0]) is KeyError


def test_block_cancelled_by_asyncio() -> None:
    gate = threading.Event()

    async def main() -> None:
        async def body() -> None:
            async with hcqa.open_device("cpu:0", hang_limit=TIMEOUT) as d:
                x = d.alloc(shape=(8,), dtype="float32")
                await d.program("slow", gated(gate))(x, x)

        task = asyncio.ensure_future(body())
        await asyncio.sleep(0.05)
        task.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        run(main)
    finally:
        gate.set()


def test_hang_limit_under_asyncio() -> None:
    gate = threading.Event()
    holder: list[hcqa.Device] = []

    async def main() -> None:
        async with hcqa.open_device("cpu:0", hang_limit=0.2) as d:
            holder.append(d)
            x = d.alloc(shape=(8,), dtype="float32")
            fence = d.program("stuck", gated(gate))(x, x)
            with pytest.raises(SignalTimeout) as info:
                await fence
            assert info.value.expected == fence.value and info.value.seen == 0
            assert d.statistics().hung

    try:
        run(main)
    finally:
        gate.set()
        assert holder[0].compute.engine.join(timeout=TIMEOUT)


# -- the loop stays free, nothing leaks --------------------------------------------------


def test_asyncio_loop_heartbeat_while_kernels_run() -> None:
    async def main() -> None:
        async with hcqa.open_device("cpu:0", hang_limit=10) as d:
            prog = d.program("spin", SPIN)
            out = d.alloc(8)
            await prog(out, vals=(1,))  # compiled and loaded
            lags: list[float] = []
            stop = asyncio.Event()

            async def heartbeat() -> None:
                while not stop.is_set():
                    t = time.perf_counter()
                    await asyncio.sleep(0.005)
                    lags.append(time.perf_counter() - t - 0.005)

            beat = asyncio.ensure_future(heartbeat())
            t0 = time.perf_counter()
            for _ in range(3):
                await prog(out, vals=(100,))
            elapsed = time.perf_counter() - t0
            stop.set()
            await beat
        assert elapsed >= 0.29
        assert len(lags) >= 10
        assert max(lags) < 0.05, f"asyncio loop lagged {max(lags) * 1e3:.1f} ms"

    run(main)


def test_awaiting_from_asyncio_burns_no_cpu() -> None:
    def nap(out: npt.NDArray[Any]) -> None:
        time.sleep(0.5)  # the work being waited for (a thread asleep), not synchronisation

    async def main() -> tuple[float, float]:
        async with hcqa.open_device("cpu:0") as d:
            prog = d.program("nap", nap)
            out = d.alloc(8)
            fence = prog(out)
            cpu, wall = time.process_time(), time.monotonic()
            await fence
            return time.process_time() - cpu, time.monotonic() - wall

    cpu, wall = run(main)
    assert wall >= 0.45
    assert cpu < 0.05 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s"


def _threads() -> set[int]:
    # trio's thread cache keeps an idle worker (the guest run's I/O waits) for a while
    return {t.ident for t in threading.enumerate() if not t.name.startswith("Trio thread")}


def test_nothing_leaks_after_the_block_and_200_cycles() -> None:
    a = np.arange(4, dtype=np.float32)
    Signal().close()  # warm the signal slot page

    async def cycles() -> None:
        for _ in range(200):
            async with hcqa.open_device("cpu:0") as d:
                x = d.alloc(shape=(4,), dtype="float32")
                await x.copyin(a)
            assert not aio._hosts

    async def full() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            pipe = hcqa.Pipeline([(d0, inc), (d1, double)], in_shape=(4,))
            await pipe(a)

    run(full)  # warm caches (compiler, thread cache)
    fds, threads = len(os.listdir("/proc/self/fd")), _threads()
    t0 = time.monotonic()
    run(cycles)
    elapsed = time.monotonic() - t0
    run(full)
    assert len(os.listdir("/proc/self/fd")) == fds
    assert _threads() <= threads
    assert elapsed < 20  # a few seconds on a quiet host; bounded so a regression shows


def test_a_host_started_by_itself_traces_per_hcqa_trace(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the core imports no tracer: hcqa.trace registered its instruments_from_env with aio
    assert aio.default_instruments is hcqa.trace.instruments_from_env
    path = tmp_path / "env.json"
    monkeypatch.setenv("HCQA_TRACE", str(path))

    async def main() -> None:
        async with hcqa.open_device("cpu:0") as d:  # no open_asyncio_host: a host of its own
            await d.alloc(shape=(8,), dtype="float32").copyin(np.ones(8, np.float32))
        assert not aio._hosts

    asyncio.run(main())
    doc = hcqa.trace.load(path)
    assert any(e["name"] == "copy" and e.get("cat") == "device" for e in doc["traceEvents"])


def test_open_asyncio_host_traces_the_guest_tasks(tmp_path: Any) -> None:
    path = tmp_path / "trace.json"
    a = np.arange(8, dtype=np.float32)

    async def main() -> None:
        async with hcqa.aio.open_asyncio_host(instruments=[hcqa.Tracer(path)]):
            for _ in range(2):  # one trio run across two device blocks
                async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
                    pipe = hcqa.Pipeline([(d0, inc), (d1, double)], in_shape=(8,))
                    await pipe(a)  # runs on this asyncio task: its fence is parked here
                    await pipe.map([a, a])  # runs as a trio task of the host
                assert aio._hosts  # the host outlives the device block
        assert not aio._hosts

    asyncio.run(main())
    doc = hcqa.trace.load(path)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("ph") == "M"}
    assert {"cpu:0 compute actor", "cpu:1 copy actor"} <= names, names
    assert any(n.endswith(": open_devices") for n in names), names  # holds the block
    assert any(n.endswith(": Pipeline.map") for n in names), names  # a routed call
    assert any(e.get("cat") == "device" for e in doc["traceEvents"])


def test_open_asyncio_host_refuses_trio_and_a_second_host() -> None:
    async def under_trio() -> None:
        with pytest.raises(hcqa.HcqaError, match="asyncio"):
            async with aio.open_asyncio_host():
                pass

    trio.run(under_trio)

    async def bad() -> None:
        with pytest.raises(TypeError, match=r"trio Instruments \(got str\)"):
            async with aio.open_asyncio_host(instruments=["trace.json"]):  # type: ignore[list-item]
                pass

    run(bad)

    async def twice() -> None:
        async with aio.open_asyncio_host():
            with pytest.raises(hcqa.HcqaError, match="already"):
                async with aio.open_asyncio_host():
                    pass

    run(twice)


def test_memory_only_write_wakes_an_asyncio_owner_within_100ms() -> None:
    # an asyncio task owning the eventfd re-reads memory on the backoff timer too
    import ctypes

    async def main() -> float:
        s = Signal()
        waiting = asyncio.ensure_future(s.wait(2))
        await asyncio.sleep(0.5)  # the idle stretch under test: the backoff reaches its cap
        assert not waiting.done()
        written = time.monotonic()
        ctypes.c_uint64.from_address(s.address).value = 2  # memory only, no eventfd
        await asyncio.wait_for(waiting, TIMEOUT)
        late = time.monotonic() - written
        stats = s.statistics()
        assert (stats.waiters, stats.owner) == (0, "none")
        s.close()
        return late

    late = run(main)
    assert late < 0.1, late


def test_cancel_at_every_step_of_a_block_leaves_nothing() -> None:
    """Cancel a task using devices after 0, 1, 2, ... loop iterations: whatever the await it
    is in (host start, entering the block, a fence, a pipeline step, leaving the block), it
    gets CancelledError, the devices end closed and no host, task or trio run is left."""
    a = np.arange(8, dtype=np.float32)
    reached_end = False

    async def user(devices: list[hcqa.Device]) -> None:
        nonlocal reached_end
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            devices += [d0, d1]
            pipe = hcqa.Pipeline([(d0, inc), (d1, double)], in_shape=(8,))
            np.testing.assert_array_equal(await pipe(a), (a + 1) * 2)
            x = d0.alloc(shape=(8,), dtype="float32")
            await x.copyin(a)
            await d1.synchronize()
        reached_end = True

    async def main() -> None:
        for ticks in range(200):
            devices: list[hcqa.Device] = []
            task = asyncio.ensure_future(user(devices))
            for _ in range(ticks):
                await asyncio.sleep(0)
            if task.done():
                await task
                assert ticks > 10  # the cancellations above hit many different awaits
                break
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert all(d.closed for d in devices)
            assert not aio._hosts
        assert reached_end

    run(main)


def test_one_host_per_loop_in_several_threads() -> None:
    a = np.arange(8, dtype=np.float32)
    results: list[Any] = []

    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            pipe = hcqa.Pipeline([(d0, inc), (d1, double)], in_shape=(8,))
            results.append(await pipe.map([a] * 4))

    threads = [threading.Thread(target=asyncio.run, args=(main(),)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(results) == 3
    for r in results:
        for y in r:
            np.testing.assert_array_equal(y, (a + 1) * 2)


def test_an_opener_decides_who_holds_its_block_when_it_is_entered() -> None:
    """``aio.rehosts``: the block made outside any loop, entered from asyncio, is hosted;
    the same opener entered from trio runs as plain trio; a block is entered once."""
    made_outside = hcqa.open_devices("cpu:0")  # no loop, no library: nothing runs yet
    a = np.arange(4, dtype=np.float32)

    async def under_asyncio() -> None:
        async with made_outside as (d,):
            assert len(aio._hosts) == 1  # held by the loop's trio host
            buf = d.alloc(shape=4, dtype="float32")
            out = np.zeros_like(a)
            await buf.copyin(a)
            await buf.copyout(out)
            np.testing.assert_array_equal(out, a)
        with pytest.raises(RuntimeError, match=r"open_devices\(\) block can be entered only once"):
            async with made_outside:
                pass

    run(under_asyncio)

    async def under_trio() -> None:
        async with hcqa.open_devices("cpu:0") as (d,):
            assert trio.lowlevel.in_trio_task() and not aio._hosts
            assert d.name == "cpu:0"

    trio.run(under_trio)


def test_an_asyncio_cancellation_cuts_a_hosted_set_up_short() -> None:
    """Cancelled while the hosted opener sets up, the set-up gets trio's Cancelled at the
    await it is in (as under trio) instead of running to its end first: an opener whose
    set-up would never end still leaves, its clean-up run; so does a process pipeline."""
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager

    seen: list[str] = []
    release = trio.Event()  # ends the set-up if the cancellation does not (the failure)

    @aio.rehosts
    @asynccontextmanager
    async def slow_to_open() -> AsyncIterator[None]:
        try:
            seen.append("setting up")
            await release.wait()  # a set-up that only a cancellation ends
            yield
        except trio.Cancelled:
            seen.append("cancelled in set-up")
            raise

    async def main() -> None:
        task = asyncio.ensure_future(slow_to_open().__aenter__())
        while not seen:
            await asyncio.sleep(0.001)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=10)
        if not done:
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            pytest.fail("the hosted set-up ran on after its caller was cancelled")
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["setting up", "cancelled in set-up"]
        assert not aio._hosts
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):  # long before its workers are up
                async with hcqa.open_process_pipeline(["hcqa.workers:add_one"], in_shape=(4,)):
                    pytest.fail("opened")
        assert time.monotonic() - t0 < 5.0  # the workers' start-up was cut short

    run(main)
