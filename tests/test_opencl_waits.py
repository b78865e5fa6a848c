"""Waits the OpenCL driver keeps: a Wait on an OpenCL queue signal of the same context whose
producer is already enqueued goes into the next command's event wait list instead of being
awaited on the host. Ordering is proven by data: each producer sits behind a raw user event
(a gate the test opens), so a consumer that did not wait in the driver would read stale data
and complete early."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import hcqa

cl = pytest.importorskip("pyopencl")

from hcqa.devices.opencl import runtime  # noqa: E402

SOURCE = """
__kernel void fill(__global int *y, int v) { y[get_global_id(0)] = v; }
__kernel void inc(__global int *y) { y[get_global_id(0)] += 1; }
"""
N = 64
GEOMETRY: dict[str, Any] = {"global_size": (1, 1, 1), "local_size": (N, 1, 1)}


def _has_device() -> bool:
    try:
        runtime.cl()
        from hcqa.devices.opencl import platforms

        return bool(platforms.list_devices())
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _has_device(), reason="no OpenCL device")


async def _read(buf: hcqa.Buffer) -> list[int]:
    out = np.empty(N, np.int32)
    await buf.copyout(out)
    return [int(v) for v in out]


def _gate(device: Any, kind: str = "compute") -> tuple[Any, Any]:
    """A user event and a raw marker behind it on ``device``'s ``kind`` queue: everything
    enqueued there afterwards waits for the test to open the gate."""
    event = cl.UserEvent(device.context)
    marker = cl.enqueue_marker(device._queues[kind].engine.queue, wait_for=[event])
    return event, marker


async def _settle() -> None:
    """Let the loop run whatever is runnable (the test then sees a held state as held)."""
    await trio.testing.wait_all_tasks_blocked()
    await trio.sleep(0.05)


async def test_a_wait_between_a_devices_queues_is_kept_by_the_driver() -> None:
    async with hcqa.open_device("opencl:0") as g:
        x = g.alloc(shape=(N,), dtype="int32")
        y = g.alloc(shape=(N,), dtype="int32")
        await x.copyin(np.zeros(N, np.int32))
        await y.copyin(np.zeros(N, np.int32))
        fill = g.program("fill", SOURCE)
        await fill(x, vals=(1,), **GEOMETRY)  # built and run once
        event, marker = _gate(g)
        fill(x, vals=(7,), **GEOMETRY)  # the producer, behind the gate
        direct = g.copy.statistics().direct
        fence = hcqa.transfer(y, x)  # the copy queue waits for the compute queue
        stats = g.copy.statistics()
        assert stats.direct == direct + 1  # handed to the driver: no host wait
        assert stats.pending_batches == 0 and not stats.waiting
        await _settle()
        assert not fence.reached  # the driver holds the copy behind the producer
        event.set_status(cl.command_execution_status.COMPLETE)
        with trio.fail_after(10):
            await fence
        assert await _read(y) == [7] * N  # the copy read what the producer wrote
        assert marker.command_execution_status == cl.command_execution_status.COMPLETE


async def test_a_wait_between_two_devices_on_one_driver_device() -> None:
    """opencl:0 twice: the consumer device's queues wait in the driver for the producer's."""
    async with hcqa.open_devices("opencl:0", "opencl:0") as (g0, g1):
        x = g0.alloc(shape=(N,), dtype="int32")
        y = g1.alloc(shape=(N,), dtype="int32")
        await x.copyin(np.zeros(N, np.int32))
        await y.copyin(np.zeros(N, np.int32))
        fill = g0.program("fill", SOURCE)
        inc = g1.program("inc", SOURCE)
        await fill(x, vals=(1,), **GEOMETRY)
        event, _ = _gate(g0)
        fill(x, vals=(40,), **GEOMETRY)
        copied = hcqa.transfer(y, x)  # g1's copy queue, after g0's compute queue
        done = inc(y, **GEOMETRY)  # g1's compute queue, after g1's copy queue
        for actor in (g1.copy, g1.compute):
            assert actor.statistics().pending_batches == 0  # none awaited on the host
        await _settle()
        assert not copied.reached and not done.reached
        event.set_status(cl.command_execution_status.COMPLETE)
        with trio.fail_after(10):
            await done
        assert await _read(y) == [41] * N


async def test_a_wait_with_no_command_after_it_holds_its_signal() -> None:
    """A Queue of a wait and a signal only: the signal is set by a marker that waits."""
    async with hcqa.open_device("opencl:0") as g:
        x = g.alloc(shape=(N,), dtype="int32")
        await x.copyin(np.zeros(N, np.int32))
        fill = g.program("fill", SOURCE)
        await fill(x, vals=(1,), **GEOMETRY)
        event, _ = _gate(g, "copy")
        fence = g.copy_queue().copy(x, x, 4).submit()  # a copy-queue batch behind the gate
        value = g.copy.value
        done = hcqa.Signal()
        stamp = hcqa.Signal()
        g.compute_queue().wait(g.copy.signal, value).timestamp(stamp).signal(done, 5).submit()
        await _settle()
        assert g.compute.statistics().pending_batches == 0 and not g.compute.statistics().waiting
        assert done.value == 0 and stamp._stamp.value == 0
        event.set_status(cl.command_execution_status.COMPLETE)
        with trio.fail_after(10):
            await done.wait(5)
            await fence
        assert stamp._stamp.value > 0


async def test_signals_produced_elsewhere_are_gated_on_the_host() -> None:
    async with hcqa.open_devices("opencl:0", "cpu:0", "opencl:0") as (g, c, g2):
        held = g.compute.engine
        assert held.hold(hcqa.Signal(), 1) is None  # set by the host
        assert held.hold(c.compute.signal, 1) is None  # a cpu device's queue
        assert held.hold(g.copy.signal, g.copy.value + 1) is None  # not enqueued yet
        assert c.compute._hold is None  # the cpu backend keeps no waits in a driver
        fill = g2.program("fill", SOURCE)
        z = g2.alloc(shape=(N,), dtype="int32")
        gate = hcqa.Signal()
        fence = g2.compute_queue().wait(gate, 1).exec(fill, (z,), vals=(3,), **GEOMETRY).submit()
        await _settle()
        assert g2.compute.statistics().waiting  # a host signal: the actor awaits it
        gate.value = 1
        with trio.fail_after(10):
            await fence
        assert await _read(z) == [3] * N


async def test_a_producer_failing_in_the_driver_faults_the_waiter_with_its_fault() -> None:
    async with hcqa.open_devices("opencl:0", "opencl:0", hang_limit=1.0) as (g0, g1):
        x = g0.alloc(shape=(N,), dtype="int32")
        y = g1.alloc(shape=(N,), dtype="int32")
        fill = g0.program("fill", SOURCE)
        await fill(x, vals=(1,), **GEOMETRY)
        event, marker = _gate(g0)
        produced = fill(x, vals=(2,), **GEOMETRY)
        fence = hcqa.transfer(y, x)
        assert g1.copy.statistics().pending_batches == 0  # kept by the driver
        event.set_status(-1)  # the producer fails in the driver (PoCL 3: no callback)
        with trio.fail_after(10), pytest.raises(hcqa.DeviceFault) as caught:
            await fence
        assert g0.faulted is not None and g1.faulted is g0.faulted  # the very instance
        assert caught.value is g0.faulted
        with pytest.raises(hcqa.DeviceFault) as again:
            await produced
        assert again.value is caught.value
        assert marker.command_execution_status < 0


async def test_a_faulted_producer_before_the_wait_is_gated_and_crosses() -> None:
    """A producer device that already faulted keeps no wait in the driver: the host path
    breaks the waiter with the same instance."""
    async with hcqa.open_devices("opencl:0", "opencl:0") as (g0, g1):
        x = g0.alloc(shape=(N,), dtype="int32")
        y = g1.alloc(shape=(N,), dtype="int32")
        fill = g0.program("fill", SOURCE)
        await fill(x, vals=(1,), **GEOMETRY)
        gate = hcqa.Signal()
        g0.compute_queue().wait(gate, 1).exec(fill, (x,), vals=(5,), **GEOMETRY).submit()
        fault = hcqa.DeviceFault("injected", device=g0.name, queue="compute")
        fence = hcqa.transfer(y, x)  # its producer is not enqueued: the host gates it
        await _settle()
        assert g1.copy.statistics().waiting
        g0._fault(fault)
        with trio.fail_after(10), pytest.raises(hcqa.DeviceFault) as caught:
            await fence
        assert caught.value is fault and g1.faulted is fault
        gate.value = 1  # g0's actor stops waiting (and skips: its device faulted)


async def test_cancelling_the_await_leaves_the_driver_kept_wait_intact() -> None:
    async with hcqa.open_device("opencl:0") as g:
        x = g.alloc(shape=(N,), dtype="int32")
        y = g.alloc(shape=(N,), dtype="int32")
        fill = g.program("fill", SOURCE)
        await fill(x, vals=(1,), **GEOMETRY)
        event, _ = _gate(g)
        fill(x, vals=(9,), **GEOMETRY)
        fence = hcqa.transfer(y, x)
        with trio.move_on_after(0.05) as scope:
            await fence
        assert scope.cancelled_caught and not fence.reached
        event.set_status(cl.command_execution_status.COMPLETE)
        with trio.fail_after(10):
            await fence
        assert await _read(y) == [9] * N


async def test_leaving_by_an_exception_while_the_driver_holds_a_wait(
    fd_count: Callable[[], int],
) -> None:
    """The block is left while the consumer waits in the driver: the close waits for the
    driver (the gate opens meanwhile), re-raises, and leaks neither fds nor producers."""
    before = fd_count()
    producers = len(runtime.producers)
    opened = trio.Event()
    gates: list[Any] = []

    async def opener() -> None:
        await opened.wait()
        await trio.sleep(0.05)
        gates[0].set_status(cl.command_execution_status.COMPLETE)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(opener)
        with pytest.raises(KeyError, match="left"), trio.fail_after(20):
            async with hcqa.open_devices("opencl:0", "opencl:0") as (g0, g1):
                x = g0.alloc(shape=(N,), dtype="int32")
                y = g1.alloc(shape=(N,), dtype="int32")
                fill = g0.program("fill", SOURCE)
                await fill(x, vals=(1,), **GEOMETRY)
                event, _ = _gate(g0)
                gates.append(event)
                fill(x, vals=(2,), **GEOMETRY)
                hcqa.transfer(y, x)
                opened.set()
                raise KeyError("left")
    assert len(runtime.producers) == producers
    assert fd_count() == before


async def test_graph_replays_keep_their_cross_queue_waits_in_the_driver() -> None:
    async with hcqa.open_device("opencl:0") as g:
        x = g.alloc(shape=(N,), dtype="int32")
        y = g.alloc(shape=(N,), dtype="int32")
        await x.copyin(np.zeros(N, np.int32))
        inc = g.program("inc", SOURCE)
        with hcqa.capture() as graph:
            inc(x, **GEOMETRY)
            hcqa.transfer(y, x)  # copy queue, after compute
            inc(y, **GEOMETRY)  # compute, after copy
            hcqa.transfer(x, y)
        for _ in range(5):
            graph.submit()
        with trio.fail_after(10):
            await graph()
        assert await _read(x) == [12] * N  # 6 replays, 2 increments each, in order


async def test_the_trace_draws_the_flow_of_a_driver_kept_wait(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    async with hcqa.open_devices("opencl:0", "opencl:0") as (g0, g1):
        x = g0.alloc(shape=(N,), dtype="int32")
        y = g1.alloc(shape=(N,), dtype="int32")
        fill = g0.program("fill", SOURCE)
        await fill(x, vals=(1,), **GEOMETRY)
        with hcqa.Tracer(path):
            event, _ = _gate(g0)
            fill(x, vals=(3,), **GEOMETRY)
            fence = hcqa.transfer(y, x)
            assert g1.copy.statistics().pending_batches == 0
            event.set_status(cl.command_execution_status.COMPLETE)
            with trio.fail_after(10):
                await fence
                await g0.synchronize()
    doc = json.loads(path.read_text())["traceEvents"]
    pids = {e["args"]["name"]: e["pid"] for e in doc if e["name"] == "process_name"}
    starts = [e for e in doc if e["ph"] == "s" and e["pid"] == pids["opencl:0"]]
    ends = [e for e in doc if e["ph"] == "f" and e["pid"] == pids["opencl:0#2"]]
    assert {e["id"] for e in starts} & {e["id"] for e in ends}  # fill -> copy, across devices


SPIN = """
__kernel void spin(__global int *y, int n) {
    int a = y[get_global_id(0)];
    for (int i = 0; i < n; i++) a = a * 3 + 1;
    y[get_global_id(0)] = a;
}
"""


class _CancelAtStep(trio.abc.Instrument):
    """Cancels ``scope`` once ``task`` has taken ``step`` steps (a step: the run between
    two checkpoints), so the cancellation lands at that await."""

    def __init__(self, task: Any, scope: trio.CancelScope, step: int) -> None:
        self.task, self.scope, self.step, self.steps = task, scope, step, 0

    def before_task_step(self, task: Any) -> None:
        if task is self.task:
            self.steps += 1
            if self.steps == self.step:
                self.scope.cancel()


async def test_a_cancellation_at_every_await_of_a_block_with_driver_kept_waits(
    fd_count: Callable[[], int],
) -> None:
    """A block on a second hcqa device of the same OpenCL device -- a program, a fill, a
    transfer that waits for it in the driver, a cross-device transfer into the survivor --
    cancelled at each of its awaits in turn: the cancellation ends it, the surviving device
    stays unfaulted and usable, a transfer that needed the abandoned fill either completed
    or failed alone (DeviceClosed), and no fd or producer is left behind."""
    async with hcqa.open_device("opencl:0") as keep:
        kept = keep.alloc(shape=(N,), dtype="int32")
        fill = keep.program("fill", SOURCE)
        await fill(kept, vals=(0,), **GEOMETRY)
        before, producers = fd_count(), len(runtime.producers)
        task = trio.lowlevel.current_task()
        step, untouched = 1, False
        while not untouched:  # until the cancellation comes after the block's last await
            finished = False
            pulled: list[Any] = []
            with trio.CancelScope() as scope, trio.fail_after(20):
                instrument = _CancelAtStep(task, scope, step)
                trio.lowlevel.add_instrument(instrument)
                try:
                    async with hcqa.open_device("opencl:0") as g:
                        x = g.alloc(shape=(N,), dtype="int32")
                        y = g.alloc(shape=(N,), dtype="int32")
                        prog = await g.program_async("fill", SOURCE)
                        spin = await g.program_async("spin", SPIN)
                        for _ in range(6):  # past the driver's window: the fill waits
                            spin(x, vals=(200_000,), **GEOMETRY)
                        prog(x, vals=(step,), **GEOMETRY)
                        hcqa.transfer(y, x)  # g's copy queue waits for the fill
                        pulled.append(hcqa.transfer(kept, y))  # keep's, after that
                        await pulled[0]
                        finished = True
                finally:
                    trio.lowlevel.remove_instrument(instrument)
            untouched = not scope.cancel_called
            if finished:
                assert await _read(kept) == [step] * N
            elif pulled:
                try:
                    await pulled[0]
                except hcqa.DeviceClosed:
                    pass  # needed what the cancelled block abandoned: failed alone
            assert keep.faulted is None, f"cancelled at await {step}: {keep.faulted!r}"
            await fill(kept, vals=(-1,), **GEOMETRY)  # the survivor goes on
            assert await _read(kept) == [-1] * N
            assert len(runtime.producers) == producers
            assert fd_count() == before, f"cancelled at await {step}: fds leaked"
            step += 1
        assert step > 8  # the block (and its close) had awaits to cancel at
