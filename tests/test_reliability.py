"""Reliability: injected faults, hangs, engine deaths, cancellation, leaks and the way back.

Every fault ends in the documented error within the hang limit, never in a hang; every
cancellation leaves no thread, fd or parked waiter behind. The helpers come from
``hcqa.testing``; nothing here sleeps to synchronise (gates, signals and
``trio.testing.wait_all_tasks_blocked`` do).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing
from _helpers import Counter
from _helpers import read as _read

import hcqa
import hcqa.testing as ht
from hcqa import DeviceClosed, DeviceFault, InvalidCommand, Signal, SignalTimeout

HANG = 0.5  # hang limit for tests that hang on purpose: errors come in 0.5-1.0 s
SLACK = 1.0  # scheduling slack on top of two hang limits
SAFE = 30.0  # hang limit for tests that must not time out

# A killed engine thread ends with an exception escaping it: pytest reports that as a warning.
KILLS_AN_ENGINE = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")

ADD1 = """
void add1(float *out, const float *a, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + 1.0f;
}
"""
N = 16


def _f32(seed: int) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def _warm_signal_pool() -> None:
    """Signal slots live in memfd pages that are never unmapped: make sure enough slots are
    free that a test under a leak check never maps a new page (an fd) for its signals."""
    spare = [Signal() for _ in range(300)]
    for s in spare:
        s.close()


@contextmanager
def no_leaks() -> Iterator[None]:
    """Assert that the block leaves no fd and no thread behind (no gc needed)."""
    _warm_signal_pool()
    before = ht.Resources.now()
    yield
    after = ht.Resources.now()
    assert after.leaked_since(before) == {}, (before, after)


async def settled_waiters(*objects: hcqa.Device | Signal) -> int:
    """Parked waiters once every task has run: queue actors whose wait just ended (a signal
    broken by a fault, say) leave their parking lot when they next run."""
    await trio.testing.wait_all_tasks_blocked()
    return ht.parked_waiters(*objects)


@asynccontextmanager
async def elapsed_below(seconds: float) -> AsyncIterator[None]:
    start = trio.current_time()
    yield
    took = trio.current_time() - start
    assert took < seconds, f"took {took:.2f} s (limit {seconds} s)"


# -- kernels that raise ---------------------------------------------------------------------


async def test_failing_kernel_faults_with_its_exception_as_cause() -> None:
    boom = ValueError("boom 17")
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        buf = d.alloc(shape=(N,), dtype="float32")
        await buf.copyin(_f32(1))
        prog = ht.failing_kernel(d, boom, name="bad")
        async with elapsed_below(SLACK):
            with pytest.raises(DeviceFault) as info:
                await prog(buf)
        fault = info.value
        assert fault.__cause__ is boom
        assert (fault.device, fault.queue) == ("cpu:0", "compute")
        assert "'bad'" in str(fault) and "boom 17" in str(fault)
        assert d.faulted is fault
        # sticky: every later enqueue and wait raises the same instance
        with pytest.raises(DeviceFault) as again:
            buf.copyout(np.empty(N, np.float32))
        assert again.value is fault
        with pytest.raises(DeviceFault) as again:
            await d.synchronize()
        assert again.value is fault
        assert await settled_waiters(d) == 0


async def test_failing_kernel_after_some_good_runs() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        buf = d.alloc(8)
        prog = ht.failing_kernel(d, KeyError, after=2)
        await prog(buf)
        await prog(buf, vals=(1, 2))  # any number of buffers and vals
        with pytest.raises(DeviceFault) as info:
            await prog(buf)
        assert isinstance(info.value.__cause__, KeyError)


async def test_fault_breaks_user_signals_queued_behind_it() -> None:
    s = Signal(name="after the fault")
    counter = Counter()
    try:
        async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
            buf = d.alloc(8)
            hold, gate = ht.hanging_kernel(d)
            try:  # the engine is held until everything is queued: the fault can't come first
                hold(buf)
                ht.failing_kernel(d)(buf)
                d.compute_queue().exec(d.program("count", counter), (buf,)).signal(s, 1).submit()
            finally:
                gate.close()
            async with elapsed_below(SLACK):
                with pytest.raises(DeviceFault) as info:
                    await s.wait(1)  # broken with the device's fault, not left hanging
            assert info.value is d.faulted
            assert isinstance(info.value.__cause__, ht.InjectedFault)
            assert counter.calls == 0
    finally:
        s.close()


async def test_fault_crosses_devices_as_the_same_instance() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=SAFE) as (d0, d1):
        x = d0.alloc(shape=(N,), dtype="float32")
        y = d1.alloc(shape=(N,), dtype="float32")
        hold, gate = ht.hanging_kernel(d0)
        try:  # d0 is held until the transfer is queued: the fault can't come first
            hold(x)
            ht.failing_kernel(d0)(x)  # writes x
            fence = hcqa.transfer(y, x)  # d1's copy queue waits for that write
        finally:
            gate.close()
        async with elapsed_below(SLACK):  # far below the 30 s hang limit
            with pytest.raises(DeviceFault) as info:
                await fence
        fault = info.value
        assert fault.device == "cpu:0"
        assert d0.faulted is fault
        assert d1.faulted is fault
        assert await settled_waiters(d0, d1) == 0
    # observed once: neither device raises it again at close


async def test_replay_with_one_fault_raises_that_fault() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=SAFE) as (d0, d1):
        x = d0.alloc(shape=(N,), dtype="float32")
        y = d1.alloc(shape=(N,), dtype="float32")
        z = d1.alloc(shape=(N,), dtype="float32")
        bad = ht.failing_kernel(d0, after=1)
        add1 = d1.program("add1", ADD1)
        with hcqa.capture() as g:
            bad(x)
            hcqa.transfer(y, x)
            add1(z, y, vals=(N,))
        await g()  # the first run is good
        async with elapsed_below(SLACK):
            with pytest.raises(DeviceFault) as info:
                await g()
        assert info.value is d0.faulted is d1.faulted
        assert await settled_waiters(d0, d1) == 0


async def test_replay_with_independent_faults_raises_them_never_hangs() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=SAFE) as (d0, d1):
        a, b = d0.alloc(8), d1.alloc(8)
        bad0, bad1 = ht.failing_kernel(d0, OSError), ht.failing_kernel(d1, KeyError)
        with hcqa.capture() as g:
            bad0(a)
            bad1(b)
        async with elapsed_below(SLACK):
            with pytest.raises((DeviceFault, ExceptionGroup)) as info:
                await g()
            # The first fault to surface cancels the replay's other watchers: a group only
            # when both surface in one scheduling step, and the other device may not have
            # failed yet (or may inherit the first fault through the replay's final wait,
            # the sink queue waiting for every other part). Each device reports its own.
            for d in (d0, d1):
                with pytest.raises(DeviceFault):
                    await d.synchronize()
        raised = info.value.exceptions if isinstance(info.value, ExceptionGroup) else [info.value]
        assert raised and all(any(e is d.faulted for d in (d0, d1)) for e in raised)
        f0, f1 = d0.faulted, d1.faulted
        assert f0 is not None and f1 is not None
        assert isinstance(f0.__cause__, OSError)  # d0 waits on nothing: its fault is its own
        assert isinstance(f1.__cause__, (OSError, KeyError))


# -- copies and loads that fail -------------------------------------------------------------


async def test_failing_copyin_leaves_the_buffer_unchanged() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        buf = d.alloc(shape=(N,), dtype="float32")
        old = _f32(2)
        await buf.copyin(old)
        injection = ht.fail_next_copy(d, OSError("disk on fire"))
        assert injection.armed
        async with elapsed_below(SLACK):
            with pytest.raises(DeviceFault) as info:
                await buf.copyin(_f32(3))
        fault = info.value
        assert (fault.device, fault.queue) == ("cpu:0", "copy")
        assert isinstance(fault.__cause__, OSError)
        assert str(fault.__cause__) == "disk on fire"
        assert injection.fired == 1 and not injection.armed
        np.testing.assert_array_equal(buf.numpy_view(), old)


async def test_injection_can_be_disarmed_before_it_fires() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        buf = d.alloc(shape=(N,), dtype="float32")
        with ht.fail_next_copy(d, count=3) as injection:
            pass
        assert not injection.armed and injection.fired == 0
        x = _f32(4)
        await buf.copyin(x)
        np.testing.assert_array_equal(await _read(buf), x)


async def test_failing_transfer_faults_the_destination() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=SAFE) as (d0, d1):
        x = d0.alloc(shape=(N,), dtype="float32")
        y = d1.alloc(shape=(N,), dtype="float32")
        await x.copyin(_f32(5))
        ht.fail_next_copy(d1, ConnectionResetError("link down"))
        async with elapsed_below(SLACK):
            with pytest.raises(DeviceFault) as info:
                await hcqa.transfer(y, x)
        assert (info.value.device, info.value.queue) == ("cpu:1", "copy")
        assert isinstance(info.value.__cause__, ConnectionResetError)
        assert d1.faulted is info.value


async def test_failing_transfer_leaves_the_source_timeline_moving() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=HANG) as d0:
        x, z = d0.alloc(8), d0.alloc(8)
        try:
            async with hcqa.open_device("cpu:1", hang_limit=HANG) as d1:
                y = d1.alloc(8)
                ht.fail_next_copy(d1)
                with pytest.raises(DeviceFault):
                    await hcqa.transfer(y, x)
        finally:
            # d0 did nothing wrong: work on a buffer the transfer never touched completes
            async with elapsed_below(HANG):
                await z.copyin(bytes(8))


async def test_destination_closed_with_a_transfer_pending_leaves_the_source_usable() -> None:
    s = Signal()
    try:
        async with hcqa.open_device("cpu:0", hang_limit=HANG) as d0:
            x, z = d0.alloc(8), d0.alloc(8)
            with pytest.raises(KeyError):
                async with hcqa.open_device("cpu:1", hang_limit=HANG) as d1:
                    y = d1.alloc(8)
                    d1.copy_queue().wait(s, 1).submit()  # holds the transfer behind it
                    hcqa.transfer(y, x)
                    await trio.testing.wait_all_tasks_blocked()
                    raise KeyError("leave")
            async with elapsed_below(HANG):
                await z.copyin(bytes(8))
    finally:
        s.close()


async def test_failing_load(tmp_path: Any) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(64)))
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        buf = d.alloc(64)
        await buf.load(path)
        ht.fail_next_load(d, PermissionError("denied"))
        with pytest.raises(DeviceFault) as info:
            await buf.load(path)
        assert isinstance(info.value.__cause__, PermissionError)
        assert info.value.queue == "copy"


# -- engines that die -----------------------------------------------------------------------


@KILLS_AN_ENGINE
@pytest.mark.parametrize("queue", ["compute", "copy"])
async def test_engine_death_faults_the_device(queue: str) -> None:
    with no_leaks():
        async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
            buf = d.alloc(8)
            await buf.copyin(bytes(8))
            engine = d._queues[queue].engine
            async with elapsed_below(SLACK):
                await ht.kill_engine(d, queue)  # type: ignore[arg-type]
            assert engine.join(timeout=10)  # the fence: it left its loop; it ends right after
            fault = d.faulted
            assert isinstance(fault, DeviceFault)
            assert f"engine thread 'cpu:0 {queue}' died" in str(fault)
            assert (fault.device, fault.queue) == ("cpu:0", queue)
            with pytest.raises(DeviceFault) as info:
                d.program("count", Counter())(buf)
            assert info.value is fault
            with pytest.raises(DeviceFault):
                await d.synchronize()


@KILLS_AN_ENGINE
async def test_engine_death_fails_work_already_queued_fast() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        buf = d.alloc(8)
        prog, gate = ht.hanging_kernel(d)
        with gate:
            first = prog(buf)
            await gate.started.wait(1)
            dead = ht.kill_engine(d, "compute")
            queued = d.program("count", Counter())(buf)  # behind the poison: never runs
            gate.release()
            await first
            async with elapsed_below(SLACK):
                await dead
                with pytest.raises(DeviceFault) as info:
                    await queued
        assert "died" in str(info.value)
        gate.close()


@KILLS_AN_ENGINE
async def test_unobserved_engine_death_is_raised_at_close() -> None:
    with pytest.raises(DeviceFault, match="engine thread 'cpu:0 copy' died"):
        async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
            await ht.kill_engine(d, "copy")


@KILLS_AN_ENGINE
async def test_engine_death_by_an_ordinary_exception() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        await ht.kill_engine(d, "compute", RuntimeError("engine bug"))
        with pytest.raises(DeviceFault, match="died"):
            await d.synchronize()


@KILLS_AN_ENGINE
async def test_engine_death_keeps_what_killed_it() -> None:
    killer = ht.EngineKilled("the real reason")
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        await ht.kill_engine(d, "compute", killer)
        fault = d.faulted
        assert fault is not None
        with pytest.raises(DeviceFault):
            await d.synchronize()
    died = fault.__cause__
    assert died is not None and (died.__cause__ is killer or died.__context__ is killer)
    assert "NoneType" not in str(fault)


@KILLS_AN_ENGINE
async def test_engine_death_breaks_user_signals_of_queued_work() -> None:
    s = Signal(name="set after the death")
    try:
        async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
            buf = d.alloc(8)
            prog, gate = ht.hanging_kernel(d)
            with gate:
                prog(buf)
                await gate.started.wait(1)
                dead = ht.kill_engine(d, "compute")
                d.compute_queue().signal(s, 1).submit()  # handed to the engine behind the poison
            await dead
            with trio.move_on_after(HANG):
                with pytest.raises(DeviceFault):
                    await s.wait(1)
            assert s.statistics().broken
            gate.close()
    finally:
        s.close()


# -- hangs ------------------------------------------------------------------------------------


async def test_hanging_kernel_times_out_within_two_hang_limits() -> None:
    # fds are not checked: see test_hung_device_releases_everything_once_its_engines_are_joined
    threads = threading.active_count()
    d: hcqa.Device | None = None
    gate: ht.Gate | None = None
    try:
        async with hcqa.open_device("cpu:0", hang_limit=HANG) as d:
            buf = d.alloc(8)
            await buf.copyin(bytes(8))
            prog, gate = ht.hanging_kernel(d)
            fence = prog(buf)
            await gate.started.wait(1)
            seen = d.timeline.value
            start = trio.current_time()
            with pytest.raises(SignalTimeout) as info:
                await fence
            took = trio.current_time() - start
            assert HANG <= took < 2 * HANG + SLACK
            exc = info.value
            assert (exc.signal, exc.expected, exc.seen) == ("cpu:0 timeline", fence.value, seen)
            assert "cpu:0" in str(exc)
            assert f"did not reach {fence.value}" in str(exc)
            assert f"value {seen}" in str(exc)
            assert d.statistics().hung
            with pytest.raises(SignalTimeout) as again:
                d.alloc(8)
            assert again.value is exc
        assert d.closed  # left without waiting for the kernel, timeout not raised again
        assert not gate.released
    finally:
        if gate is not None:
            gate.close()
        if d is not None:
            assert d.compute.engine.join(timeout=10)  # the thread ends once released
    assert threading.active_count() == threads


async def test_hang_timeout_names_the_stuck_queue() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=HANG) as d:
        prog, gate = ht.hanging_kernel(d)
        with gate:
            fence = prog(d.alloc(8))
            with pytest.raises(SignalTimeout) as info:
                await fence
        gate.close()
        assert "compute" in str(info.value)


async def test_hang_crosses_devices_as_a_timeout_naming_both_queues() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d0:
        x = d0.alloc(8)
        prog, gate = ht.hanging_kernel(d0)
        with gate:
            prog(x)  # d0 is slow (its own limit is generous): d1 waits on it
            await gate.started.wait(1)
            async with hcqa.open_device("cpu:1", hang_limit=HANG) as d1:
                y = d1.alloc(8)
                fence = hcqa.transfer(y, x)
                # wait without a hang limit of our own: d1's copy queue gives up on d0
                with trio.fail_after(2 * HANG + SLACK):
                    with pytest.raises(SignalTimeout) as info:
                        await fence.signal.wait(fence.value)
                msg = str(info.value)
                assert "cpu:1 copy queue" in msg and "cpu:0 compute queue" in msg
                assert d1.faulted is info.value
        gate.close()


async def test_wait_sync_timeout_does_not_mark_the_device_hung() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        prog, gate = ht.hanging_kernel(d)
        with gate:
            fence = prog(d.alloc(8))
            await gate.started.wait(1)
            with pytest.raises(SignalTimeout) as info:
                fence.wait_sync(timeout=0.05)  # the blocking form has its own deadline
            assert (info.value.expected, info.value.seen) == (fence.value, fence.value - 1)
            assert not d.statistics().hung
        await fence
        gate.close()


async def test_hang_found_at_close_is_reported() -> None:
    gate: ht.Gate | None = None
    try:
        with pytest.raises(SignalTimeout, match="compute queue") as at_close:
            async with hcqa.open_device("cpu:0", hang_limit=HANG) as d:
                prog, gate = ht.hanging_kernel(d)
                fence = prog(d.alloc(8))
        # the fence fails at once with the same sticky error (no second hang limit)
        async with elapsed_below(0.1):
            with pytest.raises(SignalTimeout) as later:
                await fence
        assert later.value is at_close.value
    finally:
        if gate is not None:
            gate.close()


async def test_hung_device_releases_everything_once_its_engines_are_joined() -> None:
    _warm_signal_pool()
    before = ht.Resources.now()
    async with hcqa.open_device("cpu:0", hang_limit=HANG) as d:
        prog, gate = ht.hanging_kernel(d)
        fence = prog(d.alloc(8))
        with pytest.raises(SignalTimeout):
            await fence
        gate.close()  # the kernel returns: closing joins the engine thread
    assert not d.compute.engine.alive
    assert ht.Resources.now().leaked_since(before) == {}


# -- the way back: open the device again --------------------------------------------------------


async def test_reopen_after_a_fault() -> None:
    with no_leaks():
        async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
            buf = d.alloc(shape=(N,), dtype="float32")
            with pytest.raises(DeviceFault):
                await ht.failing_kernel(d)(buf)
        with pytest.raises(DeviceClosed):
            buf.copyin(_f32(6))  # what belonged to the old device stays closed
        async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
            assert d.faulted is None
            a, out = (d.alloc(shape=(N,), dtype="float32") for _ in range(2))
            x = _f32(7)
            a.copyin(x)
            await d.program("add1", ADD1)(out, a, vals=(N,))
            np.testing.assert_array_equal(await _read(out), x + 1)


async def test_reopen_after_a_hang() -> None:
    gate: ht.Gate | None = None
    old: hcqa.Device | None = None
    try:
        async with hcqa.open_device("cpu:0", hang_limit=HANG) as old:
            prog, gate = ht.hanging_kernel(old)
            with pytest.raises(SignalTimeout):
                await prog(old.alloc(8))
        # the stuck thread is still there; a fresh device does not depend on it
        async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
            counter = Counter()
            await d.program("count", counter)(d.alloc(8))
            assert counter.calls == 1
            assert not d.statistics().hung
    finally:
        if gate is not None:
            gate.close()
        if old is not None:
            assert old.compute.engine.join(timeout=10)


# -- cancellation ------------------------------------------------------------------------------


async def test_cancelled_fence_waits_leave_no_waiter_and_the_device_usable() -> None:
    with no_leaks():
        async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
            buf = d.alloc(8)
            prog, gate = ht.hanging_kernel(d)
            fence = prog(buf)
            reached: list[str] = []
            scopes: dict[str, trio.CancelScope] = {}

            async def wait(tag: str) -> None:
                with trio.CancelScope() as scope:
                    scopes[tag] = scope
                    await fence
                    reached.append(tag)
                    return
                reached.append(f"{tag} cancelled")

            async with trio.open_nursery() as nursery:
                for tag in ("owner", "middle", "last"):  # the first becomes the eventfd owner
                    nursery.start_soon(wait, tag)
                    await trio.testing.wait_all_tasks_blocked()
                assert ht.parked_waiters(d) == 3
                scopes["owner"].cancel()
                scopes["last"].cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert ht.parked_waiters(d) == 1
                gate.release()
            assert sorted(reached) == ["last cancelled", "middle", "owner cancelled"]
            assert await settled_waiters(d) == 0
            await prog(buf)  # still usable
            gate.close()


async def test_cancelling_the_eventfd_owner_loses_no_wakeup() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        prog, gate = ht.hanging_kernel(d)
        fence = prog(d.alloc(8))
        got: list[str] = []
        owner_scope = trio.CancelScope()

        async def owner() -> None:
            with owner_scope:
                await fence
            got.append("owner cancelled")

        async def other() -> None:
            await fence
            got.append("other reached")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(owner)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(other)
            await trio.testing.wait_all_tasks_blocked()
            gate.release()  # the engine writes the eventfd while the owner is being cancelled
            owner_scope.cancel()
        assert sorted(got) == ["other reached", "owner cancelled"]
        assert await settled_waiters(d) == 0
        gate.close()


async def test_cancelled_transfer_wait_leaves_the_transfer_running() -> None:
    with no_leaks():
        async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=SAFE) as (d0, d1):
            x = d0.alloc(shape=(N,), dtype="float32")
            y = d1.alloc(shape=(N,), dtype="float32")
            data = _f32(8)
            await x.copyin(data)
            prog, gate = ht.hanging_kernel(d0)
            prog(x)  # the transfer must wait for this "write" of x
            fence = hcqa.transfer(y, x)
            with trio.move_on_after(0) as scope:  # an already-expired deadline
                await fence
            assert scope.cancelled_caught
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fence.wait)
                await trio.testing.wait_all_tasks_blocked()
                assert d1.timeline.statistics().waiters == 1
                nursery.cancel_scope.cancel()
            assert d1.timeline.statistics().waiters == 0
            assert d0.compute.signal.statistics().waiters == 1  # d1's copy actor, not us
            gate.release()
            await fence
            np.testing.assert_array_equal(await _read(y), data)
            assert await settled_waiters(d0, d1) == 0
            gate.close()


async def test_cancelled_replay_completes_on_the_devices() -> None:
    async def body() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=SAFE) as (d0, d1):
            x = d0.alloc(shape=(N,), dtype="float32")
            y, z = (d1.alloc(shape=(N,), dtype="float32") for _ in range(2))
            data = _f32(9)
            await x.copyin(data)
            prog, gate = ht.hanging_kernel(d0)
            add1 = d1.program("add1", ADD1)
            with hcqa.capture() as g:
                prog(x)
                hcqa.transfer(y, x)
                add1(z, y, vals=(N,))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(g)
                await gate.started.wait(1)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
            # only the actors' own cross-queue waits are parked, no task of ours
            assert d0.timeline.statistics().waiters == 0
            assert d1.timeline.statistics().waiters == 0
            assert d1.compute.signal.statistics().waiters == 0
            gate.release()
            await d0.synchronize()
            await d1.synchronize()
            np.testing.assert_array_equal(await _read(z), data + 1)
            await g()  # and it replays again
            assert await settled_waiters(d0, d1) == 0
            gate.close()

    with no_leaks():  # a Graph holds an eventfd (its capture placeholder) while it lives
        await body()


async def test_cancelled_timed_run_writes_no_recycled_signal() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        prog, gate = ht.hanging_kernel(d)
        buf = d.alloc(8)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prog.timed, buf)
            await gate.started.wait(1)
            nursery.cancel_scope.cancel()
        fresh = [Signal(name=f"fresh {k}") for k in range(8)]
        gate.release()
        await d.synchronize()
        stamps = [s.timestamp for s in fresh]
        for s in fresh:
            s.close()
        gate.close()
        assert stamps == [0.0] * 8


async def test_cancelled_submit_async_queues_nothing() -> None:
    hold = Signal()
    try:
        with no_leaks():
            async with hcqa.open_device("cpu:0", hang_limit=SAFE, queue_depth=1) as d:
                counter = Counter()
                q = d.compute_queue().wait(hold, 1).exec(d.program("c", counter), (d.alloc(8),))
                q.submit()  # the actor takes it and parks on `hold`
                await trio.testing.wait_all_tasks_blocked()
                q.submit()  # fills the channel
                before = d.statistics()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(q.submit_async)
                    await trio.testing.wait_all_tasks_blocked()
                    nursery.cancel_scope.cancel()
                assert d.statistics() == before
                assert d.compute._space.statistics().tasks_waiting == 0
                hold.value = 1
                await d.synchronize()
                assert counter.calls == 2
    finally:
        hold.close()


async def test_leaving_by_an_exception_cancels_and_leaks_nothing() -> None:
    hold = Signal()
    counter = Counter()
    try:
        with no_leaks():
            with pytest.raises(KeyError) as info:
                async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=SAFE) as (d0, d1):
                    x = d0.alloc(shape=(N,), dtype="float32")
                    y = d1.alloc(shape=(N,), dtype="float32")
                    prog = d0.program("count", counter)
                    done = prog(x)
                    await done
                    d0.compute_queue().wait(hold, 1).submit()
                    pending = [prog(x), hcqa.transfer(y, x), y.copyin(_f32(1))]
                    await trio.testing.wait_all_tasks_blocked()
                    raise KeyError("leave")
            assert info.value.args == ("leave",)  # unwrapped
            assert hold.statistics().waiters == 0
            assert counter.calls == 1
            await done
            for fence in pending:
                with pytest.raises(DeviceClosed):
                    await fence
            for d in (d0, d1):
                assert d.closed
                with pytest.raises(DeviceClosed):
                    d.alloc(8)
    finally:
        hold.close()


async def test_leaving_by_an_exception_while_a_kernel_runs() -> None:
    with no_leaks():
        with pytest.raises(KeyError):
            async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
                buf = d.alloc(8)
                prog, gate = ht.hanging_kernel(d)
                running = prog(buf)
                after = [d.program("count", Counter())(buf) for _ in range(3)]
                await gate.started.wait(1)
                gate.release()  # the running kernel finishes; what is queued is skipped
                raise KeyError("leave")
        assert not d.compute.engine.alive
        for fence in [running, *after]:
            try:
                await fence  # reached, or DeviceClosed: never a hang
            except DeviceClosed:
                pass
        gate.close()


async def test_outer_cancellation_closes_devices_cleanly() -> None:
    hold = Signal()
    try:
        with no_leaks():
            with trio.CancelScope() as scope:
                async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=SAFE) as (d0, d1):
                    d0.compute_queue().wait(hold, 1).submit()
                    fence = hcqa.transfer(d1.alloc(8), d0.alloc(8))
                    scope.cancel()
                    await fence  # cancelled here
            assert scope.cancelled_caught
            assert d0.closed and d1.closed
            assert hold.statistics().waiters == 0
    finally:
        hold.close()


async def test_leaving_by_an_exception_breaks_user_signals_of_abandoned_work() -> None:
    hold, done = Signal(name="hold"), Signal(name="done")
    try:
        with pytest.raises(KeyError):
            async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
                d.compute_queue().wait(hold, 1).signal(done, 1).submit()
                await trio.testing.wait_all_tasks_blocked()
                raise KeyError("leave")
        with trio.move_on_after(HANG):
            with pytest.raises(DeviceClosed):
                await done.wait(1)
        assert done.statistics().broken
    finally:
        hold.close()
        done.close()


@KILLS_AN_ENGINE
async def test_many_open_close_cycles_with_faults_leak_nothing() -> None:
    async def cycle(k: int) -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=SAFE) as (d0, d1):
            x, y = d0.alloc(64), d1.alloc(64)
            if k % 3 == 0:
                ht.fail_next_copy(d1)
            elif k % 3 == 1:
                ht.failing_kernel(d0)(x)
            try:
                await hcqa.transfer(y, x)
            except DeviceFault:
                pass
            if k % 3 == 2:
                await ht.kill_engine(d1, "compute")
                with pytest.raises(DeviceFault):
                    await d1.synchronize()

    await cycle(0)
    gc.collect()
    with no_leaks():
        for k in range(12):
            await cycle(k)
    assert not [t for t in threading.enumerate() if t.name.startswith("hcqa ")]


# -- the helpers' own argument checks -----------------------------------------------------------


async def test_helpers_check_their_arguments() -> None:
    with pytest.raises(TypeError, match="open hcqa device"):
        ht.failing_kernel("cpu:0")  # type: ignore[arg-type]
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        with pytest.raises(TypeError, match="exception"):
            ht.failing_kernel(d, "boom")  # type: ignore[arg-type]
        with pytest.raises(InvalidCommand, match=r"'after' must be >= 0 \(got -1\)"):
            ht.failing_kernel(d, after=-1)
        with pytest.raises(InvalidCommand, match=r"'count' must be >= 1 \(got 0\)"):
            ht.fail_next_copy(d, count=0)
        with pytest.raises(InvalidCommand, match="'queue' must be 'compute' or 'copy'"):
            ht.kill_engine(d, "gfx")  # type: ignore[arg-type]
        with pytest.raises(InvalidCommand, match="'max_hold'"):
            ht.hanging_kernel(d, max_hold=0)
        with pytest.raises(TypeError):
            ht.parked_waiters("x")  # type: ignore[arg-type]
    with pytest.raises(DeviceClosed):
        ht.kill_engine(d)


async def test_a_forgotten_gate_lets_go_after_max_hold() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        prog, gate = ht.hanging_kernel(d, max_hold=0.05)
        with pytest.raises(DeviceFault) as info:
            await prog(d.alloc(8))
        assert isinstance(info.value.__cause__, ht.InjectedFault)
        assert "never released" in str(info.value.__cause__)
        gate.close()
