"""Runs of OpenCL launches enqueued by one native call (``hcqa/devices/opencl/runs.py``).

A queue sent again (and a graph) sends each run of two or more launches with plain-int
arguments as one ``ClRun``: the kernels' arguments set in C where they differ from the
previous launch of the same kernel, the first launch waiting for the driver-kept waits before
it, and -- on one CPU -- for a gate released once the whole run is enqueued. What must hold:
the results of the per-launch path, Variables next to fused launches, a driver refusal inside
a run faulting the device with the driver's error, and cancellation and close with runs in
flight.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
import trio
import trio.testing
from _kinds import opencl_missing

import hcqa
from hcqa.devices.opencl.runs import ClRun

SRC = """
__kernel void axpb(__global int *y, __global const int *x, int a, int b) {
    size_t i = get_global_id(0);
    y[i] = a * x[i] + b + y[i];
}
__kernel void shift(__global int *y, int s) { y[get_global_id(0)] += s; }
"""
N = 64


@pytest.fixture(autouse=True)
def _opencl() -> None:
    why = opencl_missing()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(params=["free", "gated"])
def gated(request: Any) -> bool:
    """Both enqueue modes of a run: the worker free to start at once, and held by the gate
    the executor uses on one CPU (``ClExecutor._gate_context``)."""
    return bool(request.param == "gated")


def _gate(dev: Any, on: bool) -> None:
    for actor in dev._queues.values():
        actor.engine._gate_context = int(dev.context.int_ptr) if on else 0


async def _read(buf: hcqa.Buffer) -> np.ndarray:
    out = np.empty(N, np.int32)
    await buf.copyout(out)
    return out


def _sent_runs(q: Any) -> list[ClRun]:
    return [c for c in q._resolve(None) if type(c) is ClRun]


async def test_a_resubmitted_queue_runs_its_launches_natively_with_numpy_results(
    gated: bool,
) -> None:
    """Two kernels, three buffers, vals and sizes changing from launch to launch: every
    argument the C loop must set (or may skip) is exercised, submit after submit."""
    async with hcqa.open_device("opencl:0") as d:
        _gate(d, gated)
        axpb, shift = d.program("axpb", SRC), d.program("shift", SRC)
        y, z, x = (d.alloc(shape=(N,), dtype="int32") for _ in range(3))
        xs = np.arange(N, dtype=np.int32)
        await x.copyin(xs)
        await y.copyin(np.zeros(N, np.int32))
        await z.copyin(np.ones(N, np.int32))
        q = d.compute_queue()
        q.exec(axpb, (y, x), vals=(2, 1), global_size=(N, 1, 1))
        q.exec(axpb, (y, x), vals=(2, 1), global_size=(N, 1, 1))  # the same: nothing set
        q.exec(shift, (z,), vals=(5,), global_size=(N // 2, 1, 1), local_size=(2, 1, 1))
        q.exec(axpb, (z, x), vals=(-3, 7), global_size=(N // 2, 1, 1))  # half of z
        q.exec(shift, (y,), vals=(-1,), global_size=(N, 1, 1))
        q.exec(axpb, (y, z), vals=(1, 0), global_size=(N, 1, 1))
        ey, ez = np.zeros(N, np.int64), np.ones(N, np.int64)
        for submit in range(4):
            with trio.fail_after(10):
                await q.submit()
            ey += 2 * xs + 1
            ey += 2 * xs + 1
            ez += 5
            ez[: N // 2] += -3 * xs[: N // 2] + 7
            ey -= 1
            ey += ez
            assert (await _read(y)).tolist() == ey.tolist(), submit
            assert (await _read(z)).tolist() == ez.tolist(), submit
        (run,) = _sent_runs(q)  # the queue goes out as one native run
        assert len(run) == 6
        # the program's own launches after the run start from what the run left set
        await shift(y, vals=(3,), global_size=(N, 1, 1))
        assert (await _read(y)).tolist() == (ey + 3).tolist()


async def test_variables_are_filled_into_the_run_at_each_submit(gated: bool) -> None:
    """Launches with Variables fuse too: each submit binds its values into a copy of the
    run's table (each submit in flight keeps its own), range-checked against the C type
    before anything is queued."""
    v = hcqa.Variable("v", -(1 << 40), 1 << 40)
    async with hcqa.open_device("opencl:0") as d:
        _gate(d, gated)
        shift = d.program("shift", SRC)
        y = d.alloc(shape=(N,), dtype="int32")
        await y.copyin(np.zeros(N, np.int32))
        q = d.compute_queue()
        q.exec(shift, (y,), vals=(1,), global_size=(N, 1, 1))
        q.exec(shift, (y,), vals=(v,), global_size=(N, 1, 1))
        q.exec(shift, (y,), vals=(2,), global_size=(N, 1, 1))
        q.exec(shift, (y,), vals=(v * 2 + 1,), global_size=(N, 1, 1))
        fences = [q.submit({v: j - 50}) for j in range(8)]  # all in flight at once
        with trio.fail_after(10):
            for f in fences:
                await f
        expect = sum(1 + (j - 50) + 2 + (2 * (j - 50) + 1) for j in range(8))
        assert (await _read(y)).tolist() == [expect] * N
        (run,) = [c for c in q._resolve({v: 0}) if type(c) is ClRun]
        assert len(run) == 4 and run.symbols == (v, v * 2 + 1)
        sent = d.compute.value
        with pytest.raises(hcqa.InvalidCommand, match=r"'shift' val 's' must be in \[-2147"):
            q.submit({v: 1 << 33})
        assert d.compute.value == sent  # nothing was queued
        await q.submit({v: -3})
        assert (await _read(y)).tolist() == [expect + 1 - 3 + 2 - 5] * N


async def test_a_run_waits_in_the_driver_for_another_queue(gated: bool) -> None:
    """The first launch of a run takes the wait list of a driver-kept Wait (and the gate):
    the run reads what a copy behind a raw user event writes, only once it is opened."""
    import pyopencl as cl

    async with hcqa.open_device("opencl:0") as d:
        _gate(d, gated)
        shift = d.program("shift", SRC)
        y, src = (d.alloc(shape=(N,), dtype="int32") for _ in range(2))
        await y.copyin(np.zeros(N, np.int32))
        q = d.compute_queue()
        for s in (1, 2, 3):
            q.exec(shift, (y,), vals=(s,), global_size=(N, 1, 1))
        await q.submit()  # sent once as built: the next ones are runs
        for j in range(3):
            await src.copyin(np.full(N, 100 * j, np.int32))
            event = cl.UserEvent(cast(Any, d).context)
            held = cast(Any, d.copy.engine).queue  # the copy queue, behind the user event
            cl.enqueue_marker(held, wait_for=[event])
            copied = d.copy_queue().copy(y, src, N * 4).submit()
            direct = d.compute.statistics().direct
            fence = q.submit()  # after the copy (a hazard on y): a Wait the driver keeps
            assert d.compute.statistics().direct == direct + 1  # not awaited on the host
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.02)
            assert not fence.reached and not copied.reached
            event.set_status(cl.command_execution_status.COMPLETE)
            with trio.fail_after(10):
                await fence
            assert (await _read(y)).tolist() == [100 * j + 6] * N
        assert len(_sent_runs(q)) == 1


async def test_a_refusal_inside_a_run_faults_the_device_with_the_drivers_error(
    gated: bool,
) -> None:
    import pyopencl as cl

    async with hcqa.open_device("opencl:0", hang_limit=5.0) as d:
        _gate(d, gated)
        shift = d.program("shift", SRC)
        y, z = (d.alloc(shape=(N,), dtype="int32") for _ in range(2))
        await y.copyin(np.zeros(N, np.int32))
        q = d.compute_queue()
        q.exec(shift, (y,), vals=(1,), global_size=(N, 1, 1))
        q.exec(shift, (z,), vals=(1,), global_size=(N, 1, 1))  # sets argument 0 in C
        q.exec(shift, (y,), vals=(1,), global_size=(N, 1, 1))
        await q.submit()
        (run,) = _sent_runs(q)
        table = run.table  # launch 1's first argument to set: an index the kernel lacks
        at = 9 + 3 * table[8]  # launch 0: 9 words and its (index, size, value) entries
        assert table[at + 8] == 1 and table[at + 9] == 0  # launch 1 sets argument 0 (z)
        table[at + 9] = 99
        with pytest.raises(hcqa.DeviceFault) as info, trio.fail_after(4):
            await q.submit()
        assert isinstance(info.value.__cause__, cl.Error), info.value.__cause__
        assert "'shift'" in str(info.value.__cause__)
        assert "native run of 'shift'" in str(info.value)
        with pytest.raises(hcqa.DeviceFault):  # sticky: nothing more is queued
            shift(y, vals=(1,), global_size=(N, 1, 1))


async def test_cancelled_waiters_and_a_close_with_runs_in_flight(gated: bool) -> None:
    """A waiter cancelled while runs are in the driver leaves them running (the results are
    all there); a device left with runs in flight waits for them, then closes."""
    slow = """
    __kernel void spin(__global uint *y, int n) {
        uint acc = y[get_global_id(0)];
        for (int i = 0; i < n; i++) acc = acc * 3u + 1u;
        y[get_global_id(0)] = acc;
    }
    """
    # ~8 ms a launch here: the 5 submits in flight hold ~0.3 s of work, far longer than the
    # submits take and the 1 ms deadline below, however loaded the host
    n, launches, submits = 100_000, 8, 6
    async with hcqa.open_device("opencl:0") as d:
        _gate(d, gated)
        spin = d.program("spin", slow)
        y = d.alloc(shape=(N,), dtype="uint32")
        await y.copyin(np.zeros(N, np.uint32))
        q = d.compute_queue()
        for _ in range(launches):
            q.exec(spin, (y,), vals=(n,), global_size=(N, 1, 1))
        await q.submit()
        fences = [q.submit() for _ in range(submits - 1)]  # runs in flight
        assert not fences[-1].reached
        with trio.move_on_after(0.001) as scope:
            await fences[-1]
        assert scope.cancelled_caught
        out = np.empty(N, np.uint32)
        with trio.fail_after(10):
            await y.copyout(out)
        k = n * launches * submits  # acc -> 3 acc + 1, k times from 0: (3**k - 1) / 2
        acc = ((pow(3, k, 2**33) - 1) // 2) % 2**32
        assert out.tolist() == [acc] * N
        late = [q.submit() for _ in range(2)]  # left in flight: the close waits for them
    assert all(f.reached for f in fences + late)


async def test_results_of_a_run_left_in_flight_at_close_are_complete(gated: bool) -> None:
    async with hcqa.open_device("opencl:0") as d:
        _gate(d, gated)
        shift = d.program("shift", SRC)
        y = d.alloc(shape=(N,), dtype="int32")
        await y.copyin(np.zeros(N, np.int32))
        q = d.compute_queue()
        for s in (1, 2, 3, 4):
            q.exec(shift, (y,), vals=(s,), global_size=(N, 1, 1))
        fences = [q.submit() for _ in range(20)]
        out = np.empty(N, np.int32)
        read = y.copyout(out)  # after every run (a hazard on y)
        with trio.fail_after(10):
            await read
        assert out.tolist() == [200] * N
    assert all(f.reached for f in fences)


async def test_a_graph_replays_its_run_on_rebound_buffers() -> None:
    async with hcqa.open_device("opencl:0") as d:
        axpb, shift = d.program("axpb", SRC), d.program("shift", SRC)
        y, x, y2 = (d.alloc(shape=(N,), dtype="int32") for _ in range(3))
        xs = np.arange(N, dtype=np.int32)
        await x.copyin(xs)
        for b in (y, y2):
            await b.copyin(np.zeros(N, np.int32))
        with hcqa.capture() as g:
            axpb(y, x, vals=(3, 1), global_size=(N, 1, 1))
            shift(y, vals=(2,), global_size=(N, 1, 1))
        assert "ClRun" in g.dump()  # fused
        await g.submit()
        await g.submit(buffers={y: y2})
        await g.submit(buffers={y: y2})
        assert (await _read(y)).tolist() == (3 * xs + 3).tolist()
        assert (await _read(y2)).tolist() == (2 * (3 * xs + 3)).tolist()
