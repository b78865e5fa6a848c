"""Pipeline: calls reach the devices in the order they were made, so a stage with state sees
them in that order -- from trio tasks, from asyncio tasks, and ``map``'s items.

The stage under test keeps a running state, ``s = x - s``: two calls swapped on the device give
other answers. Where trio wakes several tasks in one round of its loop (two waiters for free
slots, two asyncio calls handed to the host), it runs them in either order (half the time
reversed), so each test repeats its trial a dozen times. "Every task is parked" is
``trio.testing.wait_all_tasks_blocked``; nothing sleeps.
"""

from __future__ import annotations

import asyncio

import numpy as np
import numpy.typing as npt
import trio
import trio.testing

import hcqa
from hcqa import aio
from hcqa.signals import Signal

F32 = npt.NDArray[np.float32]
TRIALS = 12


class Running:
    """A stage with state: ``s = x - s``, and the answers expected for calls in order."""

    def __init__(self) -> None:
        self.s = np.zeros(4, np.float32)
        self.expect = 0.0

    def __call__(self, out: F32, a: F32) -> None:
        self.s = a - self.s
        out[...] = self.s

    def next(self, x: float) -> float:
        """What the call with ``x`` answers when it is the next to reach the stage."""
        self.expect = x - self.expect
        return self.expect


def _copy(out: F32, a: F32) -> None:
    out[...] = a


def _pipe(d0: hcqa.Device, d1: hcqa.Device, stage: Running) -> hcqa.Pipeline:
    """The state on the last stage: a call that overtakes another's later legs shows there."""
    return hcqa.Pipeline([(d0, _copy), (d1, stage)], in_shape=(4,), depth=2, check=False)


def _units(pipe: hcqa.Pipeline) -> trio.Semaphore:
    """The pipeline's count of free slots (the test holds units as calls in flight would)."""
    return pipe._pool._limit


async def test_callers_woken_together_for_free_slots_run_in_call_order() -> None:
    """Calls 5 and 1 wait for a slot; both slots come free in one round (the two units the
    test held), so trio wakes both at once. 1 must still reach the stage after 5."""
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        stage = Running()
        pipe = _pipe(d0, d1, stage)
        for _ in range(TRIALS):
            got: dict[float, float] = {}

            async def call(x: float, got: dict[float, float] = got) -> None:
                got[x] = float((await pipe(np.full(4, x, np.float32)))[0])

            units = _units(pipe)
            for _ in range(2):  # as two calls in flight would
                await units.acquire()
            async with trio.open_nursery() as nursery:
                for x in (5.0, 1.0):
                    nursery.start_soon(call, x)
                    await trio.testing.wait_all_tasks_blocked()
                units.release()  # both slots free in this round
                units.release()
            assert got == {5.0: stage.next(5.0), 1.0: stage.next(1.0)}


async def test_callers_woken_together_for_queue_room_run_in_call_order() -> None:
    """cpu:0's queues take two batches each and its compute queue waits on a gate: calls 5
    and 2 fill it, so calls 3 and 1 (slots free: depth 4) wait for room. Opening the gate
    makes room for them in one round; 3 must still reach the stage before 1."""
    xs = (5.0, 2.0, 3.0, 1.0)
    async with hcqa.open_devices("cpu:0", "cpu:1", queue_depth=2) as (d0, d1):
        stage = Running()
        pipe = hcqa.Pipeline([(d0, stage), (d1, _copy)], in_shape=(4,), depth=4, check=False)
        for _ in range(TRIALS):
            got: dict[float, float] = {}

            async def call(x: float, got: dict[float, float] = got) -> None:
                got[x] = float((await pipe(np.full(4, x, np.float32)))[0])

            gate = Signal()
            d0.compute_queue().wait(gate, 1).submit()
            async with trio.open_nursery() as nursery:
                for x in xs:
                    nursery.start_soon(call, x)
                    await trio.testing.wait_all_tasks_blocked()
                gate.value = 1
            gate.close()
            assert got == {x: stage.next(x) for x in xs}


async def test_map_items_reach_the_stage_in_order() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        stage = Running()
        pipe = _pipe(d0, d1, stage)
        xs = [float(i % 7) for i in range(40)]
        got = await pipe.map([np.full(4, x, np.float32) for x in xs])
        assert [float(y[0]) for y in got] == [stage.next(x) for x in xs]


def test_asyncio_callers_handed_to_the_host_together_run_in_call_order() -> None:
    """Two asyncio calls find no free slot, so each goes to the trio host as a task; trio
    starts the two tasks in one round, in either order. 1 must still reach the stage after 5."""

    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            stage = Running()
            pipe = _pipe(d0, d1, stage)
            units = _units(pipe)

            async def free_both() -> None:  # (a trio task of the host)
                await trio.testing.wait_all_tasks_blocked()  # both calls wait
                units.release()
                units.release()

            for _ in range(TRIALS):
                units.acquire_nowait()
                units.acquire_nowait()
                calls = [asyncio.ensure_future(pipe(np.full(4, x, np.float32))) for x in (5, 1)]
                await aio.call(free_both)
                got = [float(y[0]) for y in await asyncio.gather(*calls)]
                assert got == [stage.next(5.0), stage.next(1.0)]

    asyncio.run(main())


def test_an_asyncio_call_behind_one_run_step_by_step_runs_after_it() -> None:
    """The first asyncio call finds the pipeline idle and runs step by step (each device's
    leg once the one before is done); a second, made while the first waits for its first
    leg, must not reach the last stage before it."""

    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            stage = Running()
            pipe = _pipe(d0, d1, stage)
            for _ in range(TRIALS):
                calls = [asyncio.ensure_future(pipe(np.full(4, x, np.float32))) for x in (5, 1)]
                got = [float(y[0]) for y in await asyncio.gather(*calls)]
                assert got == [stage.next(5.0), stage.next(1.0)]
                assert pipe.statistics().in_flight == 0

    asyncio.run(main())
