"""Timeline signals: values, waiting from tasks / threads / processes, ownership, breaking.

Synchronisation in these tests: ``wait_all_tasks_blocked`` for trio tasks; thread joins,
barriers and events for threads. Where a test needs a *thread* to be parked inside
``wait_sync`` there is no event to wait on, so :func:`wait_until` polls the signal's
statistics until the condition holds (it never assumes that a fixed sleep was enough).
"""

from __future__ import annotations

import ctypes
import gc
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator

import attrs
import outcome
import pytest
import trio
import trio.testing
from trio.testing import assert_checkpoints, wait_all_tasks_blocked

import hcqa.signals
from hcqa.errors import DeviceClosed, DeviceFault, HcqaError, InvalidCommand, SignalTimeout
from hcqa.signals import Fence, Signal, SignalStatistics

# -- helpers -----------------------------------------------------------------------------

TIMEOUT = 10.0  # guards waits that a broken implementation would leave hanging


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` (state a *thread* changes) until it holds; fail after ``timeout``."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.0005)


def spawn(target: Callable[..., object], *args: object) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def join(thread: threading.Thread, timeout: float = 5.0) -> None:
    thread.join(timeout)
    assert not thread.is_alive(), f"{thread.name} did not finish"


async def ajoin(thread: threading.Thread, timeout: float = 5.0) -> None:
    """Join from trio without blocking the loop (a task may have to drain for the thread)."""
    await trio.to_thread.run_sync(join, thread, timeout)


def idle(sig: Signal) -> None:
    """Nothing left behind: no registered waiter and no owner."""
    stats = sig.statistics()
    assert stats.waiters == 0, stats
    assert stats.owner == "none", stats


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch the GIL far more often than usual, to widen thread interleavings."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


# -- values, slots, argument checking ------------------------------------------------------


def test_initial_value_name_and_repr() -> None:
    sig = Signal(5, name="tl")
    assert sig.value == 5
    assert sig.name == "tl"
    assert repr(sig) == "<Signal tl value=5>"
    assert Signal().value == 0
    top = Signal(2**64 - 1)
    assert top.value == 2**64 - 1
    a, b = Signal(), Signal()
    assert a.name != b.name
    assert a.name.startswith("signal#")


def test_value_write_and_read() -> None:
    sig = Signal()
    for v in (1, 7, 2**32, 2**63 + 5, 2**64 - 1, 3):
        sig.value = v
        assert sig.value == v
        assert ctypes.c_uint64.from_address(sig.address).value == v


@pytest.mark.parametrize("bad", [1.0, "1", b"1", None, True, False])
def test_non_int_values_raise_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match=rf"'value' must be an int \(got {type(bad).__name__}\)"):
        Signal(bad)  # type: ignore[arg-type]
    sig = Signal(3)
    with pytest.raises(TypeError, match="must be an int"):
        sig.value = bad  # type: ignore[assignment]
    assert sig.value == 3


@pytest.mark.parametrize("bad", [-1, -(2**70), 2**64, 2**64 + 1])
def test_out_of_range_values_raise_invalid_command(bad: int) -> None:
    with pytest.raises(InvalidCommand, match=r"must be in \[0, 2\*\*64 - 1\]") as info:
        Signal(bad)
    assert f"(got {bad})" in str(info.value)
    assert isinstance(info.value, HcqaError)
    assert isinstance(info.value, ValueError)
    sig = Signal(3)
    with pytest.raises(InvalidCommand, match=rf"\(got {bad}\)"):
        sig.value = bad
    assert sig.value == 3


async def test_wait_arguments_are_checked() -> None:
    sig = Signal()
    with pytest.raises(TypeError, match="must be an int"):
        await sig.wait(1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidCommand, match=r"\(got -1\)"):
        await sig.wait(-1)
    with pytest.raises(InvalidCommand, match=r"\(got 18446744073709551616\)"):
        sig.wait_sync(2**64)
    with pytest.raises(TypeError):
        sig.wait_sync(True)
    with pytest.raises(InvalidCommand, match=r"'timeout' must be >= 0 or None \(got -1\)"):
        sig.wait_sync(1, timeout=-1)
    with pytest.raises(InvalidCommand, match="timeout"):
        sig.wait_sync(1, timeout=float("nan"))
    idle(sig)


def test_timestamp_slot() -> None:
    sig = Signal()
    assert sig.timestamp == 0.0
    sig.write_timestamp(1_500_000)
    assert sig.timestamp == 1500.0  # microseconds
    assert ctypes.c_uint64.from_address(sig.timestamp_address).value == 1_500_000
    ctypes.c_uint64.from_address(sig.timestamp_address).value = 2_000_500
    assert sig.timestamp == 2000.5
    before = time.monotonic_ns()
    sig.write_timestamp()
    after = time.monotonic_ns()
    assert before / 1000 <= sig.timestamp <= after / 1000
    # the two slots are distinct words of the same 32-byte slot
    assert sig.timestamp_address == sig.address + 8
    assert sig.value == 0


def test_slots_are_recycled_and_zeroed() -> None:
    a = Signal(9)
    a.write_timestamp(123_000)
    address = a.address
    a.close()
    b = Signal()
    assert b.address == address
    assert b.value == 0
    assert b.timestamp == 0.0
    assert a.value == 9  # the closed signal keeps its last value, not the slot's


def test_statistics_is_frozen() -> None:
    sig = Signal(4, name="s")
    stats = sig.statistics()
    assert isinstance(stats, SignalStatistics)
    assert stats == SignalStatistics(
        name="s", value=4, waiters=0, owner="none", broken=False, closed=False
    )
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.value = 5  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.waiters = 1  # type: ignore[misc]


# -- await sig.wait ------------------------------------------------------------------------


async def test_wait_returns_at_once_when_reached_and_is_a_checkpoint() -> None:
    sig = Signal(3)
    with assert_checkpoints():
        await sig.wait(3)
    with assert_checkpoints():
        await sig.wait(0)
    with assert_checkpoints():
        await sig.wait(2)
    idle(sig)


async def test_wait_is_cancellable_even_when_reached() -> None:
    sig = Signal(3)
    with trio.CancelScope() as scope:
        scope.cancel()
        await sig.wait(1)
    assert scope.cancelled_caught


async def test_waiting_is_a_checkpoint() -> None:
    sig = Signal()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def setter() -> None:
                await wait_all_tasks_blocked()
                sig.value = 1

            nursery.start_soon(setter)
            with assert_checkpoints():
                await sig.wait(1)


async def test_value_set_by_another_task_wakes_the_waiter() -> None:
    sig = Signal()
    woke: list[int] = []

    async def waiter() -> None:
        await sig.wait(2)
        woke.append(sig.value)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            assert sig.statistics().waiters == 1
            assert sig.statistics().owner == "task"
            sig.value = 1
            await wait_all_tasks_blocked()
            assert woke == []  # not reached yet: still parked
            assert sig.statistics().waiters == 1
            sig.value = 2
    assert woke == [2]
    idle(sig)


async def test_setting_past_the_target_wakes() -> None:
    sig = Signal()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sig.wait, 3)
            nursery.start_soon(sig.wait, 7)
            await wait_all_tasks_blocked()
            sig.value = 1000
    idle(sig)


async def test_value_set_by_a_thread_wakes_the_waiter() -> None:
    sig = Signal()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sig.wait, 1)
            await wait_all_tasks_blocked()

            def producer() -> None:
                time.sleep(0.01)  # the "device" takes a while
                sig.value = 1

            thread = spawn(producer)
            with trio.fail_after(5):
                await sig.wait(1)
    await ajoin(thread)
    idle(sig)


async def test_native_producer_writes_the_slot_then_the_eventfd() -> None:
    sig = Signal()
    done = trio.Event()

    async def waiter() -> None:
        await sig.wait(7)
        done.set()

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            slot = ctypes.c_uint64.from_address(sig.address)
            slot.value = 7  # memory only: nobody is told, and nobody polls
            assert sig.value == 7
            await wait_all_tasks_blocked()
            assert not done.is_set()
            await ajoin(spawn(os.eventfd_write, sig.fd, 1))  # "look again"
            with trio.fail_after(5):
                await done.wait()

    # the whole producer protocol from a foreign thread, as a C kernel would do it
    def native_producer() -> None:
        time.sleep(0.005)
        ctypes.c_uint64.from_address(sig.address).value = 9
        os.eventfd_write(sig.fd, 1)

    thread = spawn(native_producer)
    with trio.fail_after(5):
        await sig.wait(9)
    await ajoin(thread)
    assert sig.value == 9
    idle(sig)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
async def test_value_set_by_a_forked_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # forking marks the module "forked" for good; restore it so later tests see this process
    # as it was (the child is gone by then)
    monkeypatch.setattr(hcqa.signals, "_forked", hcqa.signals._forked)
    sig = Signal(name="forked")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sig.wait, 5)
            await wait_all_tasks_blocked()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                try:
                    sig.value = 5
                finally:
                    os._exit(0)
            try:
                with trio.fail_after(10):
                    await sig.wait(5)
            finally:
                _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sig.value == 5
    idle(sig)


async def test_five_hundred_waiters_wake_exactly_when_reached() -> None:
    sig = Signal()
    rng = random.Random(500)
    targets = [rng.randint(1, 100) for _ in range(500)]
    done: set[int] = set()

    async def waiter(i: int) -> None:
        await sig.wait(targets[i])
        assert sig.value >= targets[i]
        done.add(i)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for i in range(len(targets)):
                nursery.start_soon(waiter, i)
            await wait_all_tasks_blocked()
            assert sig.statistics().waiters == 500
            value = 0
            while value < 100:
                value = min(100, value + rng.randint(1, 9))
                sig.value = value
                await wait_all_tasks_blocked()
                expected = {i for i, t in enumerate(targets) if t <= value}
                assert done == expected, f"at {value}"
                stats = sig.statistics()
                assert stats.waiters == 500 - len(expected)
                assert stats.owner == ("none" if len(expected) == 500 else "task")
    idle(sig)


# -- cancellation and ownership ------------------------------------------------------------


async def test_cancelled_waiter_leaves_nothing_behind() -> None:
    sig = Signal()
    with trio.move_on_after(0.01) as scope:
        await sig.wait(1)
    assert scope.cancelled_caught
    idle(sig)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            cs = trio.CancelScope()

            async def waiter() -> None:
                with cs:
                    await sig.wait(1)

            nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            assert sig.statistics().owner == "task"
            cs.cancel()
    assert cs.cancelled_caught
    idle(sig)
    # the signal is still usable
    sig.value = 1
    await sig.wait(1)


async def test_cancelling_the_owner_passes_ownership_on() -> None:
    sig = Signal()
    owner_scope = trio.CancelScope()
    woke: list[int] = []

    async def owner() -> None:
        with owner_scope:
            await sig.wait(1)

    async def waiter(i: int) -> None:
        await sig.wait(1)
        woke.append(i)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(owner)
            await wait_all_tasks_blocked()
            for i in range(5):
                nursery.start_soon(waiter, i)
            await wait_all_tasks_blocked()
            assert sig.statistics().waiters == 6
            owner_scope.cancel()
            await wait_all_tasks_blocked()
            stats = sig.statistics()
            assert stats.waiters == 5
            assert stats.owner == "task"  # an heir took over
            assert woke == []
            sig.value = 1  # only the eventfd tells the heir
    assert owner_scope.cancelled_caught
    assert sorted(woke) == [0, 1, 2, 3, 4]
    idle(sig)


async def test_owner_cancelled_while_a_wakeup_is_pending_does_not_lose_it() -> None:
    sig = Signal()
    owner_scope = trio.CancelScope()

    async def owner() -> None:
        with owner_scope:
            await sig.wait(1)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(owner)
            await wait_all_tasks_blocked()
            nursery.start_soon(sig.wait, 1)
            await wait_all_tasks_blocked()
            # set and cancel with no checkpoint in between: the owner may leave without
            # draining; the eventfd keeps the count for the heir
            sig.value = 1
            owner_scope.cancel()
            with trio.fail_after(5):
                await sig.wait(1)
    idle(sig)


async def test_cancelling_a_non_owner() -> None:
    sig = Signal()
    scope = trio.CancelScope()
    woke: list[str] = []

    async def owner() -> None:
        await sig.wait(1)
        woke.append("owner")

    async def other() -> None:
        with scope:
            await sig.wait(1)
            woke.append("other")

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(owner)
            await wait_all_tasks_blocked()
            nursery.start_soon(other)
            await wait_all_tasks_blocked()
            scope.cancel()
            await wait_all_tasks_blocked()
            assert sig.statistics().waiters == 1
            assert sig.statistics().owner == "task"
            sig.value = 1
    assert woke == ["owner"]
    idle(sig)


async def test_random_cancel_patterns_leave_nothing_behind() -> None:
    rng = random.Random(0x5167)
    for trial in range(80):
        sig = Signal()
        n = rng.randint(1, 12)
        targets = [rng.randint(1, 6) for _ in range(n)]
        scopes = [trio.CancelScope() for _ in range(n)]
        result: list[str | None] = [None] * n

        async def waiter(
            i: int,
            sig: Signal = sig,
            scope: list[trio.CancelScope] = scopes,
            targets: list[int] = targets,
            result: list[str | None] = result,
        ) -> None:
            with scope[i]:
                await sig.wait(targets[i])
                result[i] = "done"
                return
            result[i] = "cancelled"

        cancelled: set[int] = set()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(waiter, i)
                if rng.random() < 0.5:
                    await wait_all_tasks_blocked()
            await wait_all_tasks_blocked()
            ops: list[int | None] = [*rng.sample(range(n), rng.randint(0, n))]
            ops += [None] * rng.randint(0, 4)  # None: step the value
            rng.shuffle(ops)
            value = 0
            for op in ops:
                if op is None:
                    value += 1
                    sig.value = value
                else:
                    scopes[op].cancel()
                    cancelled.add(op)
                if rng.random() < 0.6:
                    await wait_all_tasks_blocked()
            await wait_all_tasks_blocked()
            for i in range(n):
                if i not in cancelled:
                    assert (result[i] == "done") == (targets[i] <= value), (trial, i)
            parked = sum(r is None for r in result)
            assert sig.statistics().waiters == parked, trial
            assert sig.statistics().owner == ("task" if parked else "none"), trial
            sig.value = 10
        for i in range(n):
            if i in cancelled:
                assert result[i] in ("done", "cancelled"), (trial, i)
            else:
                assert result[i] == "done", (trial, i)
        idle(sig)
        sig.close()


# -- no lost wake-up ----------------------------------------------------------------------


def _delay(mode: int, spins: int) -> None:
    if mode == 0:
        for _ in range(spins):
            pass
    elif mode == 1:
        time.sleep(0)
    elif mode == 2:
        time.sleep(spins * 1e-7)
    # mode 3: write at once


@pytest.mark.usefixtures("fast_switching")
async def test_no_lost_wakeup_when_a_thread_sets_near_the_park() -> None:
    requests: queue.SimpleQueue[tuple[Signal, threading.Barrier, int, int] | None]
    requests = queue.SimpleQueue()

    def producer() -> None:
        while (item := requests.get()) is not None:
            sig, barrier, mode, spins = item
            barrier.wait()
            _delay(mode, spins)
            sig.value = 1

    thread = spawn(producer)
    try:
        for i in range(200):
            sig = Signal()
            barrier = threading.Barrier(2)
            requests.put((sig, barrier, i % 4, (i * 37) % 400))
            barrier.wait(timeout=5)  # blocks the loop for a moment: the set lands near the park
            with trio.fail_after(5):
                await sig.wait(1)
            idle(sig)
            sig.close()
    finally:
        requests.put(None)
    await ajoin(thread)


@pytest.mark.usefixtures("fast_switching")
async def test_no_lost_wakeup_with_a_parked_task_behind_the_owner() -> None:
    # the owner leaves (reached) at the moment a thread sets the value the heir waits for
    requests: queue.SimpleQueue[tuple[Signal, threading.Barrier, int, int] | None]
    requests = queue.SimpleQueue()

    def producer() -> None:
        while (item := requests.get()) is not None:
            sig, barrier, mode, spins = item
            barrier.wait()
            sig.value = 1
            _delay(mode, spins)
            sig.value = 2

    thread = spawn(producer)
    try:
        for i in range(100):
            sig = Signal()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sig.wait, 1)
                await wait_all_tasks_blocked()
                nursery.start_soon(sig.wait, 2)
                await wait_all_tasks_blocked()
                barrier = threading.Barrier(2)
                requests.put((sig, barrier, i % 4, (i * 53) % 300))
                barrier.wait(timeout=5)
                with trio.fail_after(5):
                    await sig.wait(2)
            idle(sig)
            sig.close()
    finally:
        requests.put(None)
    await ajoin(thread)


@pytest.mark.usefixtures("fast_switching")
async def test_tasks_stepping_through_targets_behind_a_thread_owner() -> None:
    # a thread owns the signal and drains it while tasks register, wake and register again
    # and a second thread hammers the value: every task sees every target, and nothing is
    # rescheduled that is not parked (trio would raise TrioInternalError)
    for _ in range(12):
        sig = Signal()
        owner = spawn(sig.wait_sync, 10**6, 10)
        await wait_until(lambda sig=sig: sig.statistics().owner == "thread")

        def producer(sig: Signal = sig) -> None:
            for v in range(1, 1001):
                sig.value = v

        async def stepper(first: int, sig: Signal = sig) -> None:
            for target in range(first, 1001, 7):
                await sig.wait(target)
                await trio.lowlevel.checkpoint()  # a wake-up meant for the wait lands here

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for first in range(1, 8):
                    nursery.start_soon(stepper, first)
                await wait_all_tasks_blocked()
                await ajoin(spawn(producer))
        assert sig.value == 1000
        sig.value = 10**6
        await ajoin(owner)
        idle(sig)
        sig.close()


@pytest.mark.usefixtures("fast_switching")
def test_no_lost_wakeup_for_wait_sync() -> None:
    for i in range(200):
        sig = Signal()
        barrier = threading.Barrier(2)

        def producer(sig: Signal = sig, barrier: threading.Barrier = barrier, i: int = i) -> None:
            barrier.wait()
            _delay(i % 4, (i * 37) % 400)
            sig.value = 1

        thread = spawn(producer)
        barrier.wait(timeout=5)
        sig.wait_sync(1, timeout=5)
        join(thread)
        idle(sig)
        sig.close()


# -- wait_sync ---------------------------------------------------------------------------


def test_wait_sync_returns_when_reached() -> None:
    sig = Signal(2)
    sig.wait_sync(2)
    sig.wait_sync(1, timeout=0)

    def producer() -> None:
        time.sleep(0.01)
        sig.value = 3

    thread = spawn(producer)
    sig.wait_sync(3, timeout=5)
    join(thread)
    idle(sig)


def test_wait_sync_timeout_names_signal_target_and_seen_value() -> None:
    sig = Signal(3, name="slowpoke")
    start = time.monotonic()
    with pytest.raises(SignalTimeout) as info:
        sig.wait_sync(5, timeout=0.05)
    assert time.monotonic() - start >= 0.05
    err = info.value
    message = str(err)
    assert "'slowpoke'" in message
    assert "did not reach 5" in message
    assert "(value 3)" in message
    assert (err.signal, err.expected, err.seen) == ("slowpoke", 5, 3)
    assert isinstance(err, HcqaError)
    idle(sig)
    with pytest.raises(SignalTimeout):
        sig.wait_sync(4, timeout=0)
    idle(sig)


async def test_wait_sync_from_threads_mixed_with_tasks() -> None:
    sig = Signal()
    lock = threading.Lock()
    thread_seen: dict[int, int] = {}
    task_seen: dict[int, int] = {}

    def thread_waiter(target: int) -> None:
        sig.wait_sync(target, timeout=10)
        with lock:
            thread_seen[target] = sig.value

    async def task_waiter(target: int) -> None:
        await sig.wait(target)
        task_seen[target] = sig.value

    threads = {t: spawn(thread_waiter, t) for t in range(1, 9)}
    await wait_until(lambda: sig.statistics().waiters == 8)
    assert sig.statistics().owner == "thread"
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for t in range(1, 9):
                nursery.start_soon(task_waiter, t)
            await wait_all_tasks_blocked()
            assert sig.statistics().waiters == 16
            for value in range(1, 9):
                sig.value = value
                for t in range(1, value + 1):
                    await ajoin(threads[t])
                await wait_until(lambda v=value: len(task_seen) == v)
                with lock:
                    assert set(thread_seen) == set(range(1, value + 1))
                assert set(task_seen) == set(range(1, value + 1))
                assert sig.statistics().waiters == 16 - 2 * value
    assert all(seen >= t for t, seen in thread_seen.items())
    assert all(seen >= t for t, seen in task_seen.items())
    idle(sig)


async def test_thread_waits_while_a_task_owns() -> None:
    sig = Signal()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sig.wait, 2)
            await wait_all_tasks_blocked()
            assert sig.statistics().owner == "task"
            errors: list[BaseException] = []

            def waiter() -> None:
                try:
                    sig.wait_sync(1, timeout=10)
                except BaseException as exc:  # pragma: no cover - reported below
                    errors.append(exc)

            thread = spawn(waiter)
            await wait_until(lambda: sig.statistics().waiters == 2)
            assert sig.statistics().owner == "task"
            sig.value = 1  # the task owns: it drains and releases the parked thread
            await ajoin(thread)
            assert errors == []
            assert sig.statistics().waiters == 1
            sig.value = 2
    idle(sig)


async def test_task_waits_while_a_thread_owns() -> None:
    sig = Signal()
    thread = spawn(sig.wait_sync, 2, 10)
    await wait_until(lambda: sig.statistics().owner == "thread")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sig.wait, 1)
            await wait_all_tasks_blocked()
            assert sig.statistics().waiters == 2
            sig.value = 1  # the thread owns: it drains and reschedules the task
    assert thread.is_alive()
    assert sig.statistics().waiters == 1
    sig.value = 2
    await ajoin(thread)
    idle(sig)


async def test_cancelled_task_owner_hands_over_to_a_thread() -> None:
    sig = Signal()
    scope = trio.CancelScope()

    async def owner() -> None:
        with scope:
            await sig.wait(1)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(owner)
            await wait_all_tasks_blocked()
            thread = spawn(sig.wait_sync, 1, 10)
            await wait_until(lambda: sig.statistics().waiters == 2)
            scope.cancel()
            await wait_until(lambda: sig.statistics().owner == "thread")
            assert sig.statistics().waiters == 1
    sig.value = 1
    await ajoin(thread)
    idle(sig)


async def test_timed_out_thread_owner_hands_over_to_a_task() -> None:
    sig = Signal(name="handover")
    errors: list[BaseException] = []

    def owner() -> None:
        try:
            sig.wait_sync(1, timeout=0.2)
        except SignalTimeout as exc:
            errors.append(exc)

    thread = spawn(owner)
    await wait_until(lambda: sig.statistics().owner == "thread")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sig.wait, 1)
            await wait_all_tasks_blocked()
            await trio.to_thread.run_sync(join, thread)
            assert len(errors) == 1
            await wait_all_tasks_blocked()
            assert sig.statistics().owner == "task"
            assert sig.statistics().waiters == 1
            sig.value = 1
    idle(sig)


async def test_wait_sync_timeout_as_non_owner() -> None:
    sig = Signal(name="nonowner")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sig.wait, 1)
            await wait_all_tasks_blocked()
            errors: list[SignalTimeout] = []

            def waiter() -> None:
                try:
                    sig.wait_sync(1, timeout=0.05)
                except SignalTimeout as exc:
                    errors.append(exc)

            await trio.to_thread.run_sync(waiter)
            assert len(errors) == 1
            assert errors[0].expected == 1
            assert errors[0].seen == 0
            assert sig.statistics().waiters == 1
            assert sig.statistics().owner == "task"
            sig.value = 1
    idle(sig)


# -- breaking and closing -----------------------------------------------------------------


async def test_break_raises_that_instance_for_unreached_waiters() -> None:
    sig = Signal(name="broken")
    fault = DeviceFault("kernel exploded", device="cpu:0")
    results: dict[int, outcome.Outcome[None]] = {}

    async def waiter(target: int) -> None:
        results[target] = await outcome.acapture(sig.wait, target)

    thread_result: list[outcome.Outcome[None]] = []
    thread = spawn(lambda: thread_result.append(outcome.capture(sig.wait_sync, 9, 10)))
    await wait_until(lambda: sig.statistics().waiters == 1)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for target in (1, 2, 3, 4):
                nursery.start_soon(waiter, target)
            await wait_all_tasks_blocked()
            sig.value = 2
            sig._break(fault)  # no checkpoint in between: 1 and 2 are reached, 3 and 4 are not
    await ajoin(thread)
    assert isinstance(results[1], outcome.Value)
    assert isinstance(results[2], outcome.Value)
    for target in (3, 4):
        res = results[target]
        assert isinstance(res, outcome.Error)
        assert res.error is fault
    assert isinstance(thread_result[0], outcome.Error)
    assert thread_result[0].error is fault
    assert fault.observed
    idle(sig)

    # later waits: reached ones return, unreached ones raise the same fault
    await sig.wait(2)
    with pytest.raises(DeviceFault) as info:
        await sig.wait(3)
    assert info.value is fault
    with pytest.raises(DeviceFault) as info:
        sig.wait_sync(3, timeout=5)
    assert info.value is fault
    # the first break wins
    sig._break(RuntimeError("second"))
    with pytest.raises(DeviceFault):
        await sig.wait(3)
    stats = sig.statistics()
    assert stats.broken
    assert not stats.closed
    # a broken signal still advances
    sig.value = 3
    await sig.wait(3)


async def test_break_with_a_non_hcqa_exception() -> None:
    sig = Signal()
    err = RuntimeError("boom")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def waiter() -> None:
                with pytest.raises(RuntimeError) as info:
                    await sig.wait(1)
                assert info.value is err

            nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            sig._break(err)
    idle(sig)


async def test_close_wakes_unreached_waiters_with_device_closed(
    fd_count: Callable[[], int],
) -> None:
    Signal().close()  # make sure a slot page exists before counting fds
    gc.collect()  # and that garbage from earlier tests does not close fds meanwhile
    before = fd_count()
    sig = Signal(name="closing")
    sig.value = 3
    task_results: list[outcome.Outcome[None]] = []
    thread_results: list[outcome.Outcome[None]] = []

    async def waiter(target: int) -> None:
        task_results.append(await outcome.acapture(sig.wait, target))

    thread = spawn(lambda: thread_results.append(outcome.capture(sig.wait_sync, 5, 10)))
    await wait_until(lambda: sig.statistics().waiters == 1)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, 5)
            nursery.start_soon(waiter, 6)
            await wait_all_tasks_blocked()
            assert sig.statistics().waiters == 3
            sig.close()
    await ajoin(thread)
    for res in [*task_results, *thread_results]:
        assert isinstance(res, outcome.Error)
        assert isinstance(res.error, DeviceClosed)
        assert "'closing'" in str(res.error)
    assert len(task_results) == 2
    assert len(thread_results) == 1
    assert sig.value == 3  # keeps its last value
    stats = sig.statistics()
    assert (stats.closed, stats.broken, stats.waiters, stats.owner) == (True, True, 0, "none")
    with pytest.raises(DeviceClosed, match="'closing' is closed"):
        sig.value = 4
    assert sig.value == 3
    await sig.wait(3)  # reached: returns
    sig.close()  # idempotent
    assert fd_count() == before  # the eventfd went away with the last waiter


async def test_close_without_waiters() -> None:
    sig = Signal(7)
    sig.close()
    assert sig.value == 7
    assert sig.statistics().closed
    await sig.wait(7)
    sig.wait_sync(1)
    with pytest.raises(DeviceClosed):
        sig.wait_sync(8, timeout=1)
    with pytest.raises(DeviceClosed):
        sig.value = 8


async def test_waiting_on_a_closed_signal_leaves_a_reused_fd_alone() -> None:
    # regression (10decdc..7e20444): a wait on an already-closed signal ran _finalize again,
    # calling trio.lowlevel.notify_closing on an fd number that a newer signal now owned
    old = Signal(name="old")
    fd = old.fd
    old.close()  # closes the eventfd: its number is free again
    new = Signal(name="new")
    if new.fd != fd:  # pragma: no cover - the kernel hands out the lowest free number
        pytest.skip("the fd number was not reused")
    results: list[outcome.Outcome[None]] = []

    async def waiter() -> None:
        results.append(await outcome.acapture(new.wait, 1))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            with pytest.raises(DeviceClosed):
                await old.wait(1)
            new.value = 1
    # with the bug the waiter on `new` got ClosedResourceError("another task closed this fd")
    assert isinstance(results[0], outcome.Value), results[0]


# -- CPU: nothing spins --------------------------------------------------------------------


def _burn_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_process_cpu_clock_sees_other_threads() -> None:
    # the instrument of the two tests below: CPU burnt by another thread shows up in
    # process_time (burn thread CPU, not wall time: the host may be busy)
    cpu = time.process_time()
    join(spawn(_burn_cpu, 0.1), timeout=30)
    assert time.process_time() - cpu >= 0.095


async def test_awaiting_a_signal_costs_no_cpu() -> None:
    # three waiters for a second: a task owning the eventfd, this task and a thread parked
    sig = Signal()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sig.wait, 1)
            await wait_all_tasks_blocked()
            thread = spawn(sig.wait_sync, 1, 10)
            await wait_until(lambda: sig.statistics().waiters == 2)
            cpu, wall = time.process_time(), time.monotonic()
            with trio.move_on_after(1.0):
                await sig.wait(1)
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            assert sig.statistics().waiters == 2
            sig.value = 1
        await ajoin(thread)
    assert wall >= 0.99
    assert cpu < 0.05 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s"
    idle(sig)


def test_wait_sync_costs_no_cpu() -> None:
    sig = Signal()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            sig.wait_sync(1, timeout=1.0)
        except SignalTimeout as exc:
            errors.append(exc)

    cpu, wall = time.process_time(), time.monotonic()
    join(spawn(waiter))
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    assert len(errors) == 1
    assert wall >= 0.99
    assert cpu < 0.05 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s"
    idle(sig)


# -- file descriptors ------------------------------------------------------------------------


def test_closing_5000_signals_leaks_no_fds(fd_count: Callable[[], int]) -> None:
    Signal().close()
    gc.collect()
    before = fd_count()
    for i in range(5000):
        sig = Signal(i)
        sig.value = i + 1
        sig.close()
    assert abs(fd_count() - before) <= 2


def test_dropping_5000_signals_leaks_no_fds(fd_count: Callable[[], int]) -> None:
    # slot pages (one memfd each) are kept for the life of the process: create enough of
    # them first, then check that the same 300 slots are found again
    held = [Signal() for _ in range(300)]
    del held
    gc.collect()
    before = fd_count()
    for i in range(5000):
        Signal(i)
    held = [Signal() for _ in range(300)]
    assert before + 300 <= fd_count() <= before + 302  # one eventfd each, no new page
    del held
    gc.collect()
    assert abs(fd_count() - before) <= 2


# -- Fence ---------------------------------------------------------------------------------


async def test_fence() -> None:
    sig = Signal(name="tl")
    fence = Fence(sig, 3)
    assert not fence.reached
    assert repr(fence) == "<Fence tl>=3 (at 0)>"
    with pytest.raises(SignalTimeout, match="did not reach 3"):
        fence.wait_sync(timeout=0.01)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def waiter() -> None:
                await fence

            nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            sig.value = 2
            await wait_all_tasks_blocked()
            assert sig.statistics().waiters == 1
            sig.value = 3
    assert fence.reached
    assert repr(fence) == "<Fence tl>=3 (reached)>"
    fence.wait_sync(timeout=0)
    with assert_checkpoints():
        await fence
    idle(sig)


async def test_fence_wait_sync_from_a_thread() -> None:
    sig = Signal()
    fence = Fence(sig, 1)
    thread = spawn(fence.wait_sync, 10)
    await wait_until(lambda: sig.statistics().waiters == 1)
    sig.value = 1
    await ajoin(thread)
    idle(sig)


async def test_fence_hang_limit_raises_signal_timeout_and_reports_the_hang(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hangs: list[SignalTimeout] = []

    class FakeDevice:
        def _hang(self, exc: SignalTimeout) -> None:
            hangs.append(exc)

    sig = Signal(2, name="stuck")
    fence = Fence(sig, 5, hang_limit=3.0, context="cpu:0 compute", device=FakeDevice())
    start = trio.current_time()
    with pytest.raises(SignalTimeout) as info:
        await fence
    assert 3.0 <= trio.current_time() - start <= 6.0  # between one and two limits
    err = info.value
    assert (err.signal, err.expected, err.seen) == ("stuck", 5, 2)
    assert str(err).startswith("cpu:0 compute: signal 'stuck' did not reach 5")
    assert err.observed
    assert hangs == [err]
    idle(sig)


async def test_fence_hang_limit_is_reset_by_progress(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sig = Signal(name="slow but alive")
    fence = Fence(sig, 10, hang_limit=3.0)

    async def producer() -> None:
        for v in range(1, 11):
            await trio.sleep(2.0)  # progress every 2 s (virtual time), 20 s in all
            sig.value = v

    with trio.fail_after(60):  # virtual seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer)
            await fence
    assert fence.reached


# -- regressions ---------------------------------------------------------------------------


async def test_woken_waiter_that_reparks_still_gets_woken() -> None:
    # regression (10decdc..7e20444): a waiter woken as "done" that found the value below its
    # target again re-parked without claiming ownership; with the owner gone meanwhile,
    # nobody drained the eventfd and the wait hung (a lost wake-up)
    sig = Signal()
    done = trio.Event()

    async def first() -> None:
        await sig.wait(5)
        sig.value = 3  # lowered (a timeline reset) before the second waiter runs again

    async def second() -> None:
        await sig.wait(5)
        done.set()

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)  # the owner
            await wait_all_tasks_blocked()
            nursery.start_soon(second)
            await wait_all_tasks_blocked()
            sig.value = 5  # the owner drains, wakes `second`, leaves, and lowers the value
            await wait_all_tasks_blocked()
            sig.value = 5
            await wait_all_tasks_blocked()
            stats = sig.statistics()
            nursery.cancel_scope.cancel()
    assert done.is_set(), stats


class _PausingSignal(Signal):
    """Runs ``pause`` inside the next trio-thread ``_outcome`` check (right after a waiter
    registered), to reproduce one interleaving with a thread deterministically."""

    def __init__(self, trio_thread: int) -> None:
        super().__init__()
        self.trio_thread = trio_thread
        self.pause: Callable[[], None] | None = None
        self.drained = threading.Event()

    def _outcome(self, target: int) -> bool:
        if threading.get_ident() == self.trio_thread and self.pause is not None:
            pause, self.pause = self.pause, None
            pause()
        return super()._outcome(target)

    def _drain(self) -> None:
        super()._drain()
        if threading.get_ident() != self.trio_thread:
            self.drained.set()


async def test_thread_owner_never_reschedules_a_task_that_is_not_parked() -> None:
    # regression (10decdc..7e20444): a trio waiter was listed as parked while still running
    # (between registering and wait_task_rescheduled); a thread owner's _drain rescheduled
    # it through run_sync_soon anyway, waking an unrelated later await of that task (or
    # crashing trio with TrioInternalError when the task was runnable)
    sig = _PausingSignal(threading.get_ident())
    owner = spawn(sig.wait_sync, 100, 10)
    await wait_until(lambda: sig.statistics().owner == "thread")

    def pause() -> None:
        # the task has registered and not parked yet; the value is reached now and the
        # thread owner drains before the task looks at the value
        sig.value = 5
        assert sig.drained.wait(5)

    sig.pause = pause
    unrelated = trio.Event()
    spurious: list[bool] = []

    async def waiter() -> None:
        await sig.wait(5)
        await unrelated.wait()  # must only return once `unrelated` is set
        spurious.append(not unrelated.is_set())

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            if not spurious:
                unrelated.set()
    finally:
        sig.value = 100
        await ajoin(owner)
    assert spurious == [False]


def test_a_sole_thread_waiter_is_woken_by_producers_here_and_ended_by_a_break() -> None:
    """``_wait_alone`` (a process worker's stage thread) skips the parking lot: values
    set by a thread of this process still wake it, and a break ends it with the error."""
    sig = Signal(1)
    sig._wait_alone(1)  # reached: returns at once
    got: queue.Queue[int | BaseException] = queue.Queue()

    def waiter() -> None:
        try:
            for v in range(2, 52):
                sig._wait_alone(v)
                got.put(v)
            sig._wait_alone(100)
        except DeviceClosed as exc:
            got.put(exc)

    thread = spawn(waiter)
    try:
        for v in range(2, 52):
            sig.value = v  # the waiter may be asleep or not yet waiting: both must work
            assert got.get(timeout=5) == v  # a lost wake-up times out here
    finally:
        sig._break(DeviceClosed("stopping"))  # ends the last wait (or a stuck one)
        join(thread)
    end = got.get(timeout=5)
    assert isinstance(end, DeviceClosed) and "stopping" in str(end)
    sig.close()


# -- memory-only producers (issue 17) --------------------------------------------------------

MEMORY_ONLY_WAKE = 0.1  # the contract: a value written only to memory is seen within 100 ms


def _write_memory_only(sig: Signal, value: int) -> None:
    """What a device or a C kernel that forgets the eventfd does: the value word only."""
    ctypes.c_uint64.from_address(sig.address).value = value


async def test_memory_only_write_wakes_owner_and_parked_waiters_within_100ms() -> None:
    # an owner task, a parked task and a parked thread; the waits have lasted long enough
    # (0.5 s) for the backoff to reach its ceiling, then the value is written to memory only
    sig = Signal()
    woke: dict[str, float] = {}

    async def task_waiter(key: str) -> None:
        await sig.wait(3)
        woke[key] = time.monotonic()

    def thread_waiter() -> None:
        sig.wait_sync(3, timeout=TIMEOUT)
        woke["thread"] = time.monotonic()

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(task_waiter, "owner")
            await wait_all_tasks_blocked()
            nursery.start_soon(task_waiter, "parked")
            await wait_all_tasks_blocked()
            thread = spawn(thread_waiter)
            await wait_until(lambda: sig.statistics().waiters == 3)
            assert sig.statistics().owner == "task"
            await trio.sleep(0.5)  # the idle stretch under test, not synchronisation
            assert woke == {}
            written = time.monotonic()
            _write_memory_only(sig, 3)
        await ajoin(thread)
    assert sorted(woke) == ["owner", "parked", "thread"]
    late = {k: round(t - written, 4) for k, t in woke.items()}
    assert all(d < MEMORY_ONLY_WAKE for d in late.values()), late
    idle(sig)


def test_memory_only_write_wakes_a_wait_sync_owner_within_100ms() -> None:
    sig = Signal()
    woke: list[float] = []

    def waiter() -> None:
        sig.wait_sync(1, timeout=TIMEOUT)
        woke.append(time.monotonic())

    thread = spawn(waiter)
    deadline = time.monotonic() + TIMEOUT
    while sig.statistics().owner != "thread":
        assert time.monotonic() < deadline
        time.sleep(0.001)
    time.sleep(0.5)  # the idle stretch under test: the backoff reaches its ceiling
    assert woke == []
    written = time.monotonic()
    _write_memory_only(sig, 1)
    join(thread)
    assert woke[0] - written < MEMORY_ONLY_WAKE, woke[0] - written
    idle(sig)


def test_memory_only_write_wakes_a_lone_thread_waiter_within_100ms() -> None:
    sig = Signal()
    woke: list[float] = []

    def waiter() -> None:
        sig._wait_alone(1)
        woke.append(time.monotonic())

    thread = spawn(waiter)
    time.sleep(0.5)
    assert woke == []
    written = time.monotonic()
    _write_memory_only(sig, 1)
    join(thread)
    assert woke[0] - written < MEMORY_ONLY_WAKE, woke[0] - written


async def test_memory_only_write_reaches_a_queue_wait() -> None:
    # the actor's Wait is a signal wait too: a memory-only producer releases the queue
    from hcqa import open_device

    async with open_device("cpu:0") as d0:
        sig = Signal()
        q = d0.compute_queue().wait(sig, 1)
        with trio.fail_after(TIMEOUT):
            fence = q.submit()
            await wait_all_tasks_blocked()
            _write_memory_only(sig, 1)
            await fence
    sig.close()


async def test_rereader_timer_backs_off_and_parks_when_nothing_is_watched() -> None:
    # the re-reader ticks ~1/BACKOFF_MAX times a second while a task owns an eventfd, and
    # not at all once nobody does
    from hcqa._signals import rereader as _rereader

    sig = Signal()
    with trio.move_on_after(0.5):
        await sig.wait(1)
    rereader = _rereader.watch()
    first, ceiling = _rereader.BACKOFF_FIRST, _rereader.BACKOFF_MAX
    assert 0.001 <= first <= ceiling <= 0.075  # leaves >= 25 ms of the 100 ms for scheduling
    steps, d = 0, first
    while d < ceiling:  # doubling from `first` to the ceiling, then the ceiling
        steps += 1
        d *= 2
    ticks = rereader.ticks
    assert 1 <= ticks <= steps + 0.5 / ceiling + 2, ticks
    assert rereader.watched == {}
    await trio.sleep(3 * ceiling)  # an idle stretch: the re-reader must not tick
    assert rereader.ticks <= ticks + 1  # (one tick may have been due as the wait ended)
    idle(sig)


async def test_owner_of_a_signal_whose_producers_write_the_eventfd_joins_no_rereader() -> None:
    # _rereads False: the owner waits on the eventfd alone (no timer); a write through
    # the setter (value, then eventfd) still wakes it. A default signal's owner is watched.
    from hcqa._signals import rereader as _rereader

    rereader = _rereader.watch()
    quiet, plain = Signal(name="quiet"), Signal(name="plain")
    quiet._rereads = False
    seen: dict[str, bool] = {}

    async def waiter(sig: Signal) -> None:
        await sig.wait(1)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, quiet)
            nursery.start_soon(waiter, plain)
            await wait_all_tasks_blocked()
            seen["quiet"] = quiet in rereader.watched
            seen["plain"] = plain in rereader.watched
            quiet.value = 1
            plain.value = 1
    assert seen == {"quiet": False, "plain": True}
    assert rereader.watched == {}
    idle(quiet)
    idle(plain)


async def test_a_wait_whose_last_was_quick_yields_first_and_parks_only_if_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wait on a signal whose previous wait was over before it slept (a native producer
    faster than the caller's way to sleep) takes its checkpoint first: a value written
    meanwhile ends it without parking; else it parks, and the next wait parks at once."""
    s = Signal(name="soon")
    claims: list[int] = []
    claim = s._claim

    def counting(waiter: object) -> bool:
        claims.append(1)
        return claim(waiter)  # type: ignore[arg-type]

    s._claim = counting  # type: ignore[method-assign]
    checkpoint = trio.lowlevel.checkpoint
    during: list[int] = []  # a value to write while the waiter is at its checkpoint

    async def writing_checkpoint() -> None:
        while during:
            s.value = during.pop()
        await checkpoint()

    monkeypatch.setattr(trio.lowlevel, "checkpoint", writing_checkpoint)
    try:
        assert s._soon is False  # a new signal parks at once
        s._soon = True
        during.append(1)
        with assert_checkpoints():
            await Fence(s, 1, hang_limit=TIMEOUT)
        assert claims == [] and s._soon  # over at the checkpoint: never listed
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.wait, 2)
            await wait_all_tasks_blocked()
            assert claims == [1]  # not over at the checkpoint: it parked
            s.value = 2
        assert not s._soon  # it slept: the next wait parks at once
        with trio.CancelScope() as scope:
            s._soon = True
            scope.cancel()
            with pytest.raises(trio.Cancelled):
                await s.wait(3)  # the checkpoint first is a cancel point
        assert claims == [1]
    finally:
        s.close()
