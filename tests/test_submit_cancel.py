"""A cancelled ``submit_async`` queued nothing; one that queued its batch returns the fence.

A retry after a cancellation must not run the work twice: the tests make hundreds of calls,
cancelled at every point a cancellation can reach them (before the call, while it waits for
room in a full queue, as the batch is sent) and count the kernel's runs: exactly as many as
the callers saw succeed. Under trio and under asyncio.
"""

from __future__ import annotations

import asyncio
import random

import trio
import trio.testing
from _kinds import Count, spec

import hcqa
from hcqa.signals import Signal

CALLS = 300


async def test_cancelled_calls_queue_nothing(kind: str) -> None:
    rng = random.Random(39)
    with trio.fail_after(60):
        async with hcqa.open_device(spec(kind), hang_limit=30, queue_depth=2) as d:
            count = Count()
            out = d.alloc(16)
            await count.zero(out)
            q = d.compute_queue().exec(count.program(d), (out,))
            gate = Signal()
            d.compute_queue().wait(gate, 1).submit()  # the queue fills: callers wait for room
            succeeded = 0
            scopes: list[trio.CancelScope] = []

            async def caller(i: int) -> None:
                nonlocal succeeded
                with trio.CancelScope() as scope:
                    scopes.append(scope)
                    if i % 3 == 0:
                        scope.cancel()  # cancelled before the call: as at a deadline passed
                    await q.submit_async()
                    succeeded += 1  # (no checkpoint between: a returned fence counts)

            async def canceller() -> None:
                for _ in range(CALLS):
                    for _ in range(rng.randrange(4)):
                        await trio.lowlevel.checkpoint()
                    if scopes:
                        scopes.pop(rng.randrange(len(scopes))).cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(canceller)
                for i in range(CALLS):
                    nursery.start_soon(caller, i)
                    if i == CALLS // 3:
                        await trio.testing.wait_all_tasks_blocked()
                        gate.value = 1  # the queue runs: calls succeed as well
                await trio.testing.wait_all_tasks_blocked()
                for scope in scopes:
                    scope.cancel()
            gate.close()
            await d.synchronize()
            runs = await count.calls(out)
            assert 0 < succeeded < CALLS
            assert runs == succeeded, f"{runs} kernel runs for {succeeded} successes"


def test_cancelled_calls_queue_nothing_under_asyncio() -> None:
    rng = random.Random(41)

    async def main() -> tuple[int, int]:
        async with hcqa.open_device(spec("cpu"), hang_limit=30, queue_depth=2) as d:
            count = Count()
            out = d.alloc(16)
            q = d.compute_queue().exec(count.program(d), (out,))
            succeeded = 0

            async def caller() -> None:
                nonlocal succeeded
                await q.submit_async()
                succeeded += 1

            tasks = []
            for i in range(CALLS):
                task = asyncio.create_task(caller())
                tasks.append(task)
                if i % 3 == 0:
                    task.cancel()  # before it starts
                for _ in range(rng.randrange(3)):
                    await asyncio.sleep(0)
                victim = tasks[rng.randrange(len(tasks))]
                victim.cancel()  # wherever it is: waiting for room, done, not started
            await asyncio.gather(*tasks, return_exceptions=True)
            await d.synchronize()
            return succeeded, await count.calls(out)

    succeeded, runs = asyncio.run(asyncio.wait_for(main(), 60))
    assert 0 < succeeded < CALLS
    assert runs == succeeded, f"{runs} kernel runs for {succeeded} successes"


async def test_a_call_cancelled_before_it_starts_queues_nothing(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=30) as d:
        count = Count()
        out = d.alloc(16)
        await count.zero(out)
        q = d.compute_queue().exec(count.program(d), (out,))
        before = d.statistics()
        with trio.CancelScope() as scope:
            scope.cancel()
            await q.submit_async()
        assert scope.cancelled_caught
        assert d.statistics() == before
        await d.synchronize()
        assert await count.calls(out) == 0
