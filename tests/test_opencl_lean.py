"""The lean enqueue of an OpenCL queue (``LeanEnqueue._lean``, ``lean.py``): a lone launch or
copy with its queue signal and timeline step, and the launch record a program's repeat calls
share.

What the lean path must keep of the general one: a driver refusal at enqueue faults the device
with the driver's error as its cause, and a transfer's step on the other device still
completes (that device closes at once); a shared launch record never launches on memory the
call did not pass (a freed buffer's block reused by a new buffer, a view's sub-buffer).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import trio
from _kinds import opencl_missing

import hcqa

INC = "__kernel void inc(__global int *y) { y[get_global_id(0)] += 1; }"


@pytest.fixture(autouse=True)
def _opencl() -> None:
    why = opencl_missing()
    if why is not None:
        pytest.skip(why)


async def test_a_transfer_refused_at_enqueue_faults_and_lets_the_source_close() -> None:
    import pyopencl as cl

    n = 1024
    t0 = time.monotonic()
    async with hcqa.open_device("opencl:0", hang_limit=5.0) as dst:
        y = dst.alloc(n)
        async with hcqa.open_device("opencl:0", hang_limit=5.0) as src:
            x = src.alloc(n)
            await x.copyin(np.ones(n, np.uint8))
            ex: Any = dst.copy.engine

            def refuse(*args: Any) -> Any:
                raise cl.Error("clEnqueueCopyBuffer failed: OUT_OF_RESOURCES")

            ex._copy = refuse
            fence = hcqa.transfer(y, x)
            with pytest.raises(hcqa.DeviceFault) as info:
                await fence
            assert isinstance(info.value.__cause__, cl.Error)
            tl = src._timeline
            with trio.fail_after(2):  # the source's step in the transfer was completed
                await tl.foreign_done.wait(tl.foreign_reserved)
        assert not src._hung
    assert time.monotonic() - t0 < 4.0  # nothing waited out a hang limit


async def test_repeat_calls_share_the_launch_record_and_never_use_stale_memory() -> None:
    async with hcqa.open_device("opencl:0") as g:
        k = g.program("inc", INC)
        a = g.alloc(shape=(4,), dtype="int32")
        await a.copyin(np.zeros(4, np.int32))
        for _ in range(3):
            await k(a, global_size=(4, 1, 1))
        assert k._launch is not None and k._launch.native is not None  # shared by repeats
        out = np.zeros(4, np.int32)
        await a.copyout(out)
        np.testing.assert_array_equal(out, [3, 3, 3, 3])
        a.free()
        b = g.alloc(shape=(4,), dtype="int32")  # likely a's block, from the pool
        await b.copyin(np.full(4, 10, np.int32))
        await k(b, global_size=(4, 1, 1))
        await b.copyout(out)
        np.testing.assert_array_equal(out, [11, 11, 11, 11])
        align = g._align // 4  # ints per base-address alignment (views start there)
        whole = g.alloc(shape=(2 * align,), dtype="int32")
        await whole.copyin(np.zeros(2 * align, np.int32))
        views = [whole.view(i * align * 4, 4 * 4, dtype="int32") for i in range(2)]
        for v in (views[0], views[0], views[0], views[1], views[1], views[1]):
            await k(v, global_size=(4, 1, 1))  # the third call of each takes the shared record
        # a queue's launch on the other view sets the kernel's arguments between two repeat
        # calls: the next repeat sets its own again
        await g.compute_queue().exec(k, (views[0],), global_size=(4, 1, 1)).submit()
        await k(views[1], global_size=(4, 1, 1))
        full = np.zeros(2 * align, np.int32)
        await whole.copyout(full)
        assert list(full[:4]) == [4] * 4 and list(full[align : align + 4]) == [4] * 4
        assert full.sum() == 32


async def test_a_command_complete_at_its_enqueue_is_done_without_a_segment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lone launch or copy that the driver completed inside its enqueue call (as a pinned
    host's PoCL does for small ones) is over when the callback's registration returns: no
    segment is made, its slot is back, its fence reached; a clock sample is still taken
    when one is due (through a segment). Made deterministic by waiting for each command
    inside the driver call."""
    from hcqa.devices.opencl import lean

    async with hcqa.open_device("opencl:0") as g:
        a = g.alloc(shape=(4,), dtype="int32")
        k = g.program("inc", INC)
        await a.copyin(np.zeros(4, np.int32))
        for _ in range(20):  # past the first clock samples (every completion takes one)
            await k(a, global_size=(4, 1, 1))
        ex: Any = g.compute.engine
        cx: Any = g.copy.engine
        launch, copy = ex._launch, cx._copy

        def launch_and_wait(*args: Any) -> Any:
            event = launch(*args)
            event.wait()
            return event

        def copy_and_wait(*args: Any) -> Any:
            event = copy(*args)
            event.wait()
            return event

        made: list[Any] = []

        class Counted(lean.Segment):
            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                made.append(self)

        monkeypatch.setattr(lean, "Segment", Counted)
        ex._launch, cx._copy = launch_and_wait, copy_and_wait
        host = np.zeros(4, np.int32)
        g._drain([ex, cx])  # (the warm-up's last segments: fired, left to the next tidy)
        done, sampled = ex.completed + cx.completed, g._sampled
        for i in range(300):
            fence = k(a, global_size=(4, 1, 1)) if i % 2 else a.copyout(host)
            assert fence.reached
            assert not ex.pending and not cx.pending and g._slots.in_use == 0
            await fence
        assert ex.completed + cx.completed - done == 300
        assert g._sampled - sampled == 300
        assert 1 <= len(made) <= 2  # the completions that took a sample (every 256th)
        await a.copyout(host)
        np.testing.assert_array_equal(host, [170] * 4)


async def test_a_stopping_queue_whose_backlog_completes_at_its_enqueue_closes() -> None:
    """The close of a queue whose last runs waited in the backlog (the driver's window was
    full) and then all completed inside their enqueue (the lean path lists no segment for
    them): its executor still says it exited, and the close returns at once. It waited out
    the hang limit and called the device hung (1-2 % of closes of a 50-launch queue here).
    Made deterministic by holding the window's callbacks until the close began, and waiting
    for each backlog launch inside the driver call."""
    from hcqa.devices.opencl import executor as executor_mod

    window = executor_mod.WINDOW
    held: list[tuple[Any, int]] = []
    with trio.fail_after(4):  # the hang limit (5 s) must not be what ends the close
        async with trio.open_nursery() as nursery:
            async with hcqa.open_device("opencl:0", hang_limit=5.0) as g:
                a = g.alloc(shape=(4,), dtype="int32")
                k = g.program("inc", INC)
                await a.copyin(np.zeros(4, np.int32))
                for _ in range(20):  # past the first clock samples (every completion takes one)
                    await k(a, global_size=(4, 1, 1))
                ex: Any = g.compute.engine
                native, launch = ex._native, ex._launch

                class Holding:  # the window's callbacks are registered once the close began
                    tl_complete = native.tl_complete

                    def register(self, event: Any, address: int) -> int:
                        if len(held) < window:
                            held.append((event, address))
                            return 0
                        return int(native.register(event, address))

                def launch_and_wait(*args: Any) -> Any:
                    event = launch(*args)
                    if len(held) >= window:  # a backlog run: complete inside its enqueue
                        event.wait()
                    return event

                ex._native, ex._launch = Holding(), launch_and_wait
                fences = [k(a, global_size=(4, 1, 1)) for _ in range(window + 2)]
                await trio.testing.wait_all_tasks_blocked()
                assert len(ex.pending) == window and len(ex.backlog) == 2
                assert not any(f.reached for f in fences)

                async def release_once_closing() -> None:
                    await trio.testing.wait_all_tasks_blocked()  # the close waits for the queue
                    assert ex.stopping and len(ex.backlog) == 2
                    for event, address in held:
                        assert native.register(event, address) == 0

                nursery.start_soon(release_once_closing)
    assert not g._hung and ex.exited.value == 1
    assert not ex.pending and not ex.backlog
    assert all(f.reached for f in fences)
