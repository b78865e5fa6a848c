"""Two hcqa devices on one OpenCL device, in blocks of their own: leaving one's block by an
exception does not make the other unusable.

The inner device had a transfer queued that reads the outer device's buffer; its block is
left by an exception before the transfer ran, so the transfer is abandoned. The outer device
then overwrites that buffer: the write waited for the transfer's read, which will never
happen -- nothing to wait for, not a fault (before: the outer device took the inner one's
``DeviceClosed`` as its own sticky error, "closed" while nobody had closed it).

Work of the outer device that needed what the abandoned work was to *write* (a transfer from
its buffer, a queue waiting on a signal it was to set) fails alone: its fence raises a
DeviceClosed naming it, as does what reads the data it did not write; the outer device is not
faulted (see docs/reliability.md).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import trio
from _kinds import opencl_missing

import hcqa
from hcqa.errors import DeviceClosed

SLOW = """
__kernel void slow(__global float *o, int n) {
    float a = o[0];
    for (int i = 0; i < n; i++) a = a * 0.999f + 1.0f;
    o[0] = a;
}
"""


async def test_leaving_one_block_by_an_exception_leaves_the_other_usable() -> None:
    inner = "opencl:0"
    if (why := opencl_missing()) is not None:
        pytest.skip(why)
    with trio.fail_after(60):
        async with hcqa.open_device("opencl:0") as outer:
            data = outer.alloc(shape=(4,), dtype="float32")
            await data.copyin(np.arange(4, dtype=np.float32))
            with pytest.raises(KeyError):
                async with hcqa.open_device(inner) as d:
                    dest = d.alloc(shape=(4,), dtype="float32")
                    slow = d.program("slow", SLOW)
                    for _ in range(3):  # the transfer waits behind these (same buffer)
                        slow(dest, vals=(20_000_000,))
                    moved = hcqa.transfer(dest, data)  # reads outer's buffer, not yet run
                    raise KeyError("leave")
            with pytest.raises(DeviceClosed):
                await moved
            assert outer.faulted is None
            await data.copyin(np.full(4, 7, np.float32))  # waits for the abandoned read
            got = np.zeros(4, np.float32)
            await data.copyout(got)
            assert got.tolist() == [7.0] * 4
            assert outer.faulted is None


async def test_work_that_needed_the_abandoned_writes_fails_alone() -> None:
    """The outer device's transfer reads a buffer the inner device's abandoned kernels were
    to write (the last ones past the driver's window: never run). That transfer fails alone
    -- its fence raises a DeviceClosed naming the work and the inner queue -- as does the
    outer kernel that waited for exactly it; the outer device is not faulted and its other
    work runs."""
    if (why := opencl_missing()) is not None:
        pytest.skip(why)
    with trio.fail_after(60):
        async with hcqa.open_device("opencl:0") as outer:
            data = outer.alloc(shape=(4,), dtype="float32")
            other = outer.alloc(shape=(4,), dtype="float32")
            await data.copyin(np.zeros(4, np.float32))
            double = outer.program(
                "double",
                "__kernel void double_(__global float *o) { o[get_global_id(0)] *= 2.0f; }",
                entry="double_",
            )
            with pytest.raises(KeyError):
                async with hcqa.open_device("opencl:0") as d:
                    src = d.alloc(shape=(4,), dtype="float32")
                    slow = d.program("slow", SLOW)
                    for _ in range(10):  # more than the driver's window: the last never run
                        slow(src, vals=(2_000_000,))
                    pulled = hcqa.transfer(data, src)  # outer's copy queue, after those writes
                    doubled = double(data, global_size=4)  # outer's compute, after the transfer
                    raise KeyError("leave")
            with pytest.raises(DeviceClosed, match="a copy not run") as caught:
                await pulled
            assert "copy queue" in str(caught.value) or "compute queue" in str(caught.value)
            with pytest.raises(DeviceClosed, match="kernel 'double' not run"):
                await doubled
            assert outer.faulted is None
            await other.copyin(np.full(4, 3, np.float32))  # independent work: runs
            await double(other, global_size=4)
            got = np.zeros(4, np.float32)
            await other.copyout(got)
            assert got.tolist() == [6.0] * 4
            await data.copyin(np.full(4, 5, np.float32))  # the buffer is usable again
            await double(data, global_size=4)
            await data.copyout(got)
            assert got.tolist() == [10.0] * 4
            assert outer.faulted is None


async def test_reads_of_what_the_failed_work_was_to_write_fail_too() -> None:
    """After a transfer that needed the abandoned writes fails, what reads its destination
    fails as well -- a copyout queued right behind it on the same queue (no wait between
    them), and a copyout asked for afterwards (refused at the call) -- until the buffer is
    written again. cpu devices: the same mechanism as OpenCL's host waits."""

    def slow(out: np.ndarray, n: int) -> None:
        time.sleep(0.02 * n)
        out += 1

    with trio.fail_after(30):
        async with hcqa.open_device("cpu:0") as outer:
            data = outer.alloc(shape=(4,), dtype="float32")
            await data.copyin(np.zeros(4, np.float32))
            double = outer.program("double", lambda o: np.multiply(o, 2, out=o))
            got = np.full(4, -1, np.float32)
            with pytest.raises(KeyError):
                async with hcqa.open_device("cpu:1") as d:
                    src = d.alloc(shape=(4,), dtype="float32")
                    spin = d.program("slow", slow)
                    for _ in range(5):
                        spin(src, vals=(1,))
                    pulled = hcqa.transfer(data, src)
                    read = data.copyout(got)  # same copy queue, right behind: no wait
                    raise KeyError("leave")
            await outer.synchronize()  # done; the failures are the batches', not the device's
            with pytest.raises(DeviceClosed, match="a copy not run"):
                await pulled
            with pytest.raises(DeviceClosed, match="needed the writes of failed work"):
                await read
            assert got.tolist() == [-1.0] * 4  # nothing was copied out
            with pytest.raises(DeviceClosed, match="holds no valid data"):
                data.copyout(got)  # refused at the call: nothing queued
            assert outer.faulted is None
            await data.copyin(np.full(4, 5, np.float32))  # written again: valid
            await double(data)
            await data.copyout(got)
            assert got.tolist() == [10.0] * 4


async def test_a_queue_waiting_on_a_signal_the_abandoned_device_would_set_fails_alone() -> None:
    """A built queue of the surviving device waits on a user signal that the abandoned
    device's queue was to set: that submit fails alone (naming the signal and the closed
    device), the survivor is not faulted and runs the next kernel."""

    def slow(out: np.ndarray, n: int) -> None:
        time.sleep(0.02 * n)

    handoff = hcqa.Signal(0, name="handoff")
    with trio.fail_after(30):
        async with hcqa.open_device("cpu:0") as outer:
            data = outer.alloc(shape=(4,), dtype="float32")
            await data.copyin(np.ones(4, np.float32))
            double = outer.program("double", lambda o: np.multiply(o, 2, out=o))
            with pytest.raises(KeyError):
                async with hcqa.open_device("cpu:1") as d:
                    spin = d.program("slow", slow)
                    for _ in range(5):
                        spin(d.alloc(4), vals=(1,))
                    d.compute_queue().signal(handoff, 1).submit()
                    waited = outer.compute_queue().wait(handoff, 1).exec(double, (data,)).submit()
                    raise KeyError("leave")
            with pytest.raises(DeviceClosed, match=r"kernel 'double' not run.*handoff.*cpu:1"):
                await waited
            assert outer.faulted is None
            await double(data)
            got = np.zeros(4, np.float32)
            await data.copyout(got)
            assert got.tolist() == [2.0] * 4  # the failed double never ran; this one did
    handoff.close()
