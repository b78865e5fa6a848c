"""Issue 13 item 5, in-process: a task parked waiting for queue room (``submit_async``, a
graph replay, an in-process pipeline call) gets ``DeviceClosed`` when its device block is
left -- by an exception or normally -- instead of waiting forever."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import hcqa
from hcqa import DeviceClosed, QueueFull, Signal


class Boom(Exception):
    pass


def _fill(d: hcqa.Device, gate: Signal) -> Callable[[], hcqa.Fence]:
    """Hold the compute queue on ``gate`` and fill its channel; returns a submit that
    would need room."""
    out = d.alloc(16)
    prog = d.program("nothing", lambda out: None)
    d.compute_queue().wait(gate, 1).submit()
    return lambda: prog(out)


async def _parked_then_closed(
    make_waiter: Callable[[hcqa.Device], Callable[[], Awaitable[Any]]], *, by_exception: bool
) -> list[BaseException]:
    gate = Signal(name="gate")
    seen: list[BaseException] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as outer:

            async def parked(task_status: trio.TaskStatus[None]) -> None:
                task_status.started()
                try:
                    await waiter()
                except BaseException as exc:
                    seen.append(exc)
                    if not isinstance(exc, DeviceClosed):
                        raise

            async def release_once_all_blocked() -> None:
                # the device's close drains: it can only end once the gate opens, and it
                # must have woken the parked task by then
                await trio.testing.wait_all_tasks_blocked()
                gate.value = 1

            try:
                # depth 2: a pipeline call needs room for two batches at once (a shallower
                # queue is refused when the Pipeline is built)
                async with hcqa.open_device("cpu:0", hang_limit=30, queue_depth=2) as d:
                    submit = _fill(d, gate)
                    await trio.testing.wait_all_tasks_blocked()  # the actor waits on gate
                    submit()  # the two batches the channel holds
                    submit()
                    with pytest.raises(QueueFull):
                        submit()
                    waiter = make_waiter(d)
                    await outer.start(parked)
                    await trio.testing.wait_all_tasks_blocked()
                    assert seen == []  # parked for room
                    if by_exception:
                        raise Boom
                    outer.start_soon(release_once_all_blocked)
            except Boom:
                pass
    gate.close()
    return seen


def _submit_async(d: hcqa.Device) -> Callable[[], Awaitable[Any]]:
    out = d.alloc(16)
    q = d.compute_queue().exec(d.program("n", lambda out: None), (out,))
    return q.submit_async


def _replay(d: hcqa.Device) -> Callable[[], Awaitable[Any]]:
    out = d.alloc(16)
    prog = d.program("n", lambda out: None)
    with hcqa.capture() as g:
        prog(out)
    return g


def _pipeline(d: hcqa.Device) -> Callable[[], Awaitable[Any]]:
    def ident(out: Any, a: Any) -> None:
        out[:] = a

    pipe = hcqa.Pipeline([(d, d.program("ident", ident))], in_shape=(4,), dtype="float32")
    return lambda: pipe(np.zeros(4, np.float32))


@pytest.mark.parametrize("by_exception", [True, False], ids=["exception", "normal-exit"])
@pytest.mark.parametrize(
    "make_waiter", [_submit_async, _replay, _pipeline], ids=["submit_async", "replay", "pipeline"]
)
async def test_a_task_parked_for_queue_room_gets_device_closed(
    make_waiter: Callable[[hcqa.Device], Callable[[], Awaitable[Any]]], by_exception: bool
) -> None:
    seen = await _parked_then_closed(make_waiter, by_exception=by_exception)
    assert len(seen) == 1 and isinstance(seen[0], DeviceClosed), seen
    assert "closed" in str(seen[0])


async def test_waiting_for_room_on_a_closed_queue_raises_at_once() -> None:
    async with hcqa.open_device("cpu:0") as d:
        actor = d.compute
    with trio.fail_after(5), trio.testing.assert_checkpoints(), pytest.raises(DeviceClosed):
        await actor.wait_for_space()
