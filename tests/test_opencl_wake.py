"""The OpenCL completion callback writes a queue signal's eventfd only for a waiter.

The callback stores the queue's signal value on the driver's thread; it writes the signal's
eventfd only when a waiter of this process is listed with a target the value reaches (the
slot's wake word, ``hcqa_signal_complete``). A completion nobody waits for costs no syscall;
a waiter that lists itself while the value lands is never left asleep.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from _kinds import opencl_missing

import hcqa

INC = "__kernel void inc(__global int *y) { y[get_global_id(0)] += 1; }"


@pytest.fixture(autouse=True)
def _opencl() -> None:
    why = opencl_missing()
    if why is not None:
        pytest.skip(why)


def _writes(sig: Any) -> int:
    """The eventfd's counter (how many writes since the last read), drained."""
    try:
        return os.eventfd_read(sig.fd)
    except BlockingIOError:
        return 0


async def test_completions_nobody_waits_for_write_no_eventfd() -> None:
    async with hcqa.open_device("opencl:0") as g:
        buf = g.alloc(16)
        k = g.program("inc", INC, entry="inc")
        compute, copy = g._queues["compute"].signal, g._queues["copy"].signal
        await buf.copyin(np.zeros(4, np.int32))
        _writes(compute), _writes(copy)  # (whatever opening the device did)
        start = compute.value, copy.value
        for _ in range(10):  # the lean path: one launch, one copy, each awaited on its fence
            await k(buf)
            await buf.copyin(np.zeros(4, np.int32))
        q = g.compute_queue()  # the general path (a segment's native stores)
        q.exec(k, (buf,), global_size=4).exec(k, (buf,), global_size=4)
        for _ in range(5):
            await q.submit()
        assert (compute.value, copy.value) == (start[0] + 15, start[1] + 10)  # the stores ran
        assert (_writes(compute), _writes(copy)) == (0, 0)


async def test_a_waiter_on_the_queue_signal_is_always_woken() -> None:
    async with hcqa.open_device("opencl:0") as g:
        buf = g.alloc(4)
        k = g.program("inc", INC, entry="inc")
        sig = g._queues["compute"].signal
        sig._rereads = False  # the eventfd alone wakes the owner: a lost write hangs the wait
        for i in range(60):
            target = sig.value + 1
            with trio.fail_after(5):
                if i % 2:  # parked first, then the launch
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(sig.wait, target)
                        await trio.testing.wait_all_tasks_blocked()
                        fence = k(buf)
                else:  # the launch first: the wait lists itself while the value may land
                    fence = k(buf)
                    await sig.wait(target)
                await fence
        assert _writes(sig) <= 1  # only the waits' wake-ups were written (one may be left)


_AFTER_FORK = """
import os, sys
import numpy as np, trio, hcqa
sys.path.insert(0, {tests!r})
from test_opencl_wake import INC, _writes

async def main() -> None:
    async with hcqa.open_device("opencl:0") as g:
        buf = g.alloc(4)
        k = g.program("inc", INC, entry="inc")
        sig = g._queues["compute"].signal
        await k(buf)
        before = _writes(sig)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        for _ in range(3):
            await k(buf)
        print(before, _writes(sig))

trio.run(main)
"""


def test_after_a_fork_every_completion_writes_the_eventfd() -> None:
    """A forked child may wait on the same slots with wake words this process can't see."""
    import subprocess
    import sys

    script = _AFTER_FORK.format(tests=os.path.dirname(__file__))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["0", "3"]
