"""The process pipeline caller's wait (``Signal._wait_sole``): it owns the last stage's
eventfd with none of a signal wait's parking set-up, and falls back to an ordinary park when
another waiter owns it -- exact under cancellation, breaks and closes; and only the last
stage wakes the coordinator. (Quick: ~0.8 s, one pipeline opened.)"""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest
import trio
import trio.testing

from hcqa.errors import DeviceClosed, DeviceFault
from hcqa.signals import Signal


def _signal() -> Signal:
    sig = Signal(name="done1")
    sig._rereads = False  # as in a pipeline: every producer writes the eventfd
    return sig


async def test_a_sole_caller_owns_the_eventfd_while_it_waits() -> None:
    sig = _signal()
    seen = []

    async def caller() -> None:
        await sig._wait_sole(3)
        seen.append(sig.value)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            await trio.testing.wait_all_tasks_blocked()
            stats = sig.statistics()
            assert (stats.owner, stats.waiters) == ("task", 1)
            # a producer in another thread: it finds us listed and writes the eventfd
            producer = threading.Thread(target=sig._set_from_engine, args=(3,))
            producer.start()
            producer.join()
    assert seen == [3]
    stats = sig.statistics()
    assert (stats.owner, stats.waiters) == ("none", 0)
    sig.close()


async def test_with_an_owner_there_it_parks_like_any_wait() -> None:
    sig = _signal()
    order: list[str] = []

    async def plain() -> None:
        await sig.wait(5)
        order.append("plain")

    async def sole_wait() -> None:
        await sig._wait_sole(3)
        order.append("sole")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(plain)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(sole_wait)
            await trio.testing.wait_all_tasks_blocked()
            assert sig.statistics().waiters == 2  # parked behind the plain owner
            sig._set_from_engine(3)
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["sole"]
            sig._set_from_engine(5)
    assert order == ["sole", "plain"]
    assert sig.statistics().owner == "none"
    sig.close()


async def test_a_cancelled_owner_hands_the_eventfd_to_a_parked_waiter() -> None:
    sig = _signal()
    woke = trio.Event()

    async def plain() -> None:
        await sig.wait(2)
        woke.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            owner_scope = trio.CancelScope()
            nursery.start_soon(_in_scope, owner_scope, sig, 9)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(plain)
            await trio.testing.wait_all_tasks_blocked()
            assert sig.statistics().waiters == 2
            owner_scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            # the heir sleeps on the eventfd now: a write from another thread must wake it
            producer = threading.Thread(target=sig._set_from_engine, args=(2,))
            producer.start()
            await woke.wait()
            producer.join()
    stats = sig.statistics()
    assert (stats.owner, stats.waiters) == ("none", 0)
    sig.close()


async def _in_scope(scope: trio.CancelScope, sig: Signal, target: int) -> None:
    with scope:
        await sig._wait_sole(target)


@pytest.mark.parametrize("how", ["break", "close"])
async def test_a_break_or_close_ends_the_sole_wait_with_its_error(how: str) -> None:
    sig = _signal()
    fault = DeviceFault("worker 1 died", device="worker1")
    caught: list[BaseException] = []

    async def caller() -> None:
        try:
            await sig._wait_sole(4)
        except (DeviceFault, DeviceClosed) as exc:
            caught.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            await trio.testing.wait_all_tasks_blocked()
            if how == "break":
                sig._break(fault)
            else:
                sig.close()
    assert len(caught) == 1
    if how == "break":
        assert caught[0] is fault
        sig.close()
    else:
        assert isinstance(caught[0], DeviceClosed)
    assert sig.statistics().closed
    assert not sig._finalizer.alive  # the last waiter out released the slot and the fd


async def test_a_reached_target_still_checkpoints_like_wait() -> None:
    sig = _signal()
    sig._set_from_engine(2)
    await sig._wait_sole(1)
    with trio.CancelScope() as scope:
        scope.cancel()
        await sig._wait_sole(2)  # raises Cancelled, as sig.wait(2) would
    assert scope.cancelled_caught
    stats = sig.statistics()
    assert (stats.owner, stats.waiters) == ("none", 0)
    sig.close()


async def test_random_cancellations_among_sole_and_plain_waits_lose_no_wake_up() -> None:
    """Sole and plain waiters come and go (some cancelled) while a producer thread
    steps the value; every wait not cancelled returns with its target reached."""
    rng = random.Random(18)
    sig = _signal()
    results: list[tuple[int, int]] = []
    cancelled = 0

    async def waiter(target: int, sole: bool, scope: trio.CancelScope) -> None:
        with scope:
            if sole:
                await sig._wait_sole(target)
            else:
                await sig.wait(target)
            results.append((target, sig.value))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            scopes: list[trio.CancelScope] = []
            for step in range(1, 61):
                for _ in range(rng.randint(0, 3)):
                    scope = trio.CancelScope()
                    scopes.append(scope)
                    target = step + rng.randint(0, 5)
                    nursery.start_soon(waiter, target, rng.random() < 0.5, scope)
                await trio.testing.wait_all_tasks_blocked()
                for scope in scopes:
                    if not scope.cancel_called and rng.random() < 0.1:
                        scope.cancel()
                        cancelled += 1
                producer = threading.Thread(target=sig._set_from_engine, args=(step,))
                producer.start()
                producer.join()
            sig._set_from_engine(100)
    started = len(scopes)
    assert cancelled > 0 and len(results) > started // 2
    assert all(value >= target for target, value in results)
    stats = sig.statistics()
    assert (stats.owner, stats.waiters) == ("none", 0)
    sig.close()


def test_an_asyncio_caller_waits_the_asyncio_way() -> None:
    import asyncio

    sig = _signal()

    async def main() -> None:
        threading.Thread(target=sig._set_from_engine, args=(2,)).start()
        await asyncio.wait_for(sig._wait_sole(2), 10)

    asyncio.run(main())
    assert sig.value == 2
    assert sig.statistics().waiters == 0
    sig.close()


async def test_only_the_last_stage_wakes_the_coordinator() -> None:
    """An intermediate stage wakes the next stage alone: the coordinator's copy of its
    ``done`` gets the value (the watchdog reads it) but no eventfd write; a wait there
    still returns, through the signal's memory re-read. The last stage's wakes it."""
    from hcqa.processes import open_process_pipeline

    x = np.arange(4, dtype=np.float32)
    async with open_process_pipeline(["hcqa.workers:add_one"] * 2, in_shape=(4,)) as pipe:
        done0, done1 = pipe.signals["done0"], pipe.signals["done1"]
        with trio.fail_after(20):
            for _ in range(3):
                np.testing.assert_array_equal(await pipe(x), x + 2)
            assert (done0.value, done1.value) == (3, 3)
            with pytest.raises(BlockingIOError):
                os.eventfd_read(done0.fd)  # never written by worker 0
            async with trio.open_nursery() as nursery:
                nursery.start_soon(done0.wait, 4)
                nursery.start_soon(done1.wait, 4)
                await trio.testing.wait_all_tasks_blocked()
                np.testing.assert_array_equal(await pipe(x), x + 2)
