"""Hang limits timed by the run's re-reader (``hcqa/_signals/rereader.py``), not by a cancel scope
per wait (issue 18): the limit holds for owners and parked waiters alike, a short limit is
honoured while the timer sleeps a long tick, progress renews it, and a wait that ends any
way (reached, cancelled, broken) leaves nothing timed behind.

All on trio's MockClock (autojump): virtual time, no sleeps, ~0.1 s in all.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from hcqa import DeviceClosed, Fence, Signal, SignalTimeout
from hcqa._signals.rereader import watch


def _untimed() -> None:
    assert not watch().timed


async def test_every_waiter_of_a_stuck_fence_times_out_owner_and_parked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sig = Signal(1, name="stuck")
    fence = Fence(sig, 2, hang_limit=2.0)
    errors: list[SignalTimeout] = []
    start = trio.current_time()

    async def waiter() -> None:
        with pytest.raises(SignalTimeout) as info:
            await fence
        errors.append(info.value)
        assert 2.0 <= trio.current_time() - start <= 2.5 + 0.1  # <= 1.25 limits (+ a tick)

    async with trio.open_nursery() as nursery:
        for _ in range(3):  # one owns the eventfd, two are parked behind it
            nursery.start_soon(waiter)
    assert len(errors) == 3
    assert all((e.signal, e.expected, e.seen) == ("stuck", 2, 1) for e in errors)
    assert sig.statistics().waiters == 0
    _untimed()
    sig.close()


async def test_a_short_limit_is_honoured_while_the_timer_sleeps_a_long_tick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, stuck = Signal(name="slow"), Signal(name="stuck")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(Fence(slow, 1, hang_limit=60.0).wait)
        await trio.sleep(5.0)  # the timer has backed off to its longest tick by now
        start = trio.current_time()
        with pytest.raises(SignalTimeout):
            await Fence(stuck, 1, hang_limit=0.01).wait()
        assert 0.01 <= trio.current_time() - start <= 0.0125 + 0.001
        slow.value = 1
    _untimed()
    slow.close()
    stuck.close()


async def test_progress_renews_the_limit_and_reaching_ends_the_timing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sig = Signal(name="slow but alive")

    async def producer() -> None:
        for v in range(1, 6):
            await trio.sleep(1.5)  # progress every 1.5 s, within the 2 s limit
            sig.value = v

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        await Fence(sig, 5, hang_limit=2.0)
    _untimed()
    sig.close()


async def test_cancelled_and_broken_timed_waits_leave_nothing_timed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sig = Signal(name="never")
    with trio.move_on_after(1.0) as scope:
        await Fence(sig, 1, hang_limit=30.0)
    assert scope.cancelled_caught
    _untimed()

    async def close_soon() -> None:
        await trio.sleep(1.0)
        sig.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close_soon)
        with pytest.raises(DeviceClosed):
            await Fence(sig, 1, hang_limit=30.0)
    _untimed()
