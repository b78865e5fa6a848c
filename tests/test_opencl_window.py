"""An OpenCL queue hands the driver a bounded window of work (``executor.WINDOW`` segments);
the rest waits in the executor's backlog, so a cancelled close waits for the window only.

A driver can't take back what it was given: before the window, a deadline around a device
block with 30 slow kernels queued waited for all 30. The tests count what ran instead of
timing it: a kernel's fence is reached only if the kernel ran.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
from _kinds import COUNT_CL, opencl_missing

import hcqa
from hcqa.devices.opencl.executor import WINDOW
from hcqa.errors import DeviceClosed

# about 0.1-0.3 s per launch on PoCL (a dependent chain: it can't be vectorised away)
SLOW = """
__kernel void slow(__global float *o, int n) {
    float a = o[0];
    for (int i = 0; i < n; i++) a = a * 0.999f + 1.0f;
    o[0] = a;
}
"""
N = 50_000_000
QUEUED = 30


@pytest.fixture(autouse=True)
def _opencl() -> None:
    why = opencl_missing()
    if why is not None:
        pytest.skip(why)


async def test_a_cancelled_close_waits_for_the_window_only() -> None:
    fences: list[hcqa.Fence] = []
    with trio.fail_after(60):  # (a hang guard: without the window this takes ~30 launches)
        with trio.CancelScope() as scope:
            async with hcqa.open_device("opencl:0") as g:
                prog = g.program("slow", SLOW)
                buf = g.alloc(4)
                await buf.copyin(np.zeros(1, np.float32))
                for _ in range(QUEUED):
                    fences.append(prog(buf, vals=(N,)))
                scope.cancel()  # the deadline passes with every launch queued
                await trio.lowlevel.checkpoint()
    ran = sum(f.reached for f in fences)
    assert ran <= WINDOW, f"{ran} of {QUEUED} launches ran after the cancellation"
    for f in fences[WINDOW:]:
        with pytest.raises(DeviceClosed):
            await f


async def test_a_skipped_backlog_completes_other_devices_steps() -> None:
    """A transfer from a cpu device waiting in the backlog when the block is cancelled: the
    cpu device's step in it is completed, so it closes at once (it would wait its hang limit
    for a step nobody completes, and be declared hung)."""
    with trio.fail_after(60):
        async with hcqa.open_device("cpu:0", hang_limit=20) as host:
            src = host.alloc(1 << 20)
            with trio.CancelScope() as scope:
                async with hcqa.open_device("opencl:0") as g:
                    big = g.alloc(16 << 20)
                    dest = g.alloc(1 << 20)
                    data = np.ones(16 << 18, np.float32)
                    for _ in range(20):
                        big.copyin(data)  # the copy queue's window fills, then its backlog
                    moved = hcqa.transfer(dest, src)
                    assert g.copy.engine.backlog  # type: ignore[attr-defined]
                    scope.cancel()
                    await trio.lowlevel.checkpoint()
            with pytest.raises(DeviceClosed):
                await moved
            # the transfer never read src: overwriting it waits for nothing (no fault)
            await src.copyin(np.zeros(1 << 18, np.float32))
        assert not host.statistics().hung


async def test_the_backlog_runs_everything_in_order() -> None:
    """Far more runs than the window, on both queues, with transfers between two devices:
    every one runs, once, in queue order."""
    with trio.fail_after(60):
        async with hcqa.open_devices("opencl:0", "opencl:0") as (g0, g1):
            count = g0.program("count", COUNT_CL)
            a = g0.alloc(4)
            await a.copyin(np.zeros(1, np.int32))
            b = g1.alloc(4)
            seen = []
            host = [np.zeros(1, np.int32) for _ in range(50)]
            fences = []
            for k in range(50):
                fences.append(count(a))
                if k % 5 == 4:
                    fences.append(hcqa.transfer(b, a))
                    fences.append(b.copyout(host[k]))
                    seen.append(k)
            for f in fences:
                await f
            got = np.zeros(1, np.int32)
            await a.copyout(got)
            assert got[0] == 50
            assert [int(host[k][0]) for k in seen] == [k + 1 for k in seen]
            assert not g0.compute.engine.backlog  # type: ignore[attr-defined]
