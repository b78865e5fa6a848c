"""Data a failed batch did not write, on the fused C path of a cpu device.

A batch that fails alone (it needed what abandoned work of another device was to write)
runs none of its work and marks what it was to write as holding no valid data; what reads
that data fails the same way until it is written again (``actors/actor.py``, ``LOST``;
tests/test_two_blocks.py covers the per-command path). Here the same rule on the paths that
send C kernels fused into one native call (``RunC``): a graph replay and a built queue
submitted again, each queued right behind the failing transfer, and asked for afterwards.
``out`` is read through its address as well, to see that a run marked "not run" did not run.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio

import hcqa
from hcqa.errors import DeviceClosed

INC = """
void inc(float *dst, const float *src) { for (int i = 0; i < 4; i++) dst[i] = src[i] + 1.0f; }
"""


def _peek(b: hcqa.Buffer) -> list[float]:
    """What ``b`` holds, read through its address (no command: refusals don't apply)."""
    return np.ctypeslib.as_array((ctypes.c_float * 4).from_address(b.va_addr)).tolist()


def _slow(out: np.ndarray, n: int) -> None:
    time.sleep(0.02 * n)
    out += 1


async def _lose(outer: hcqa.Device, data: hcqa.Buffer, behind: Callable[[], Any]) -> Any:
    """Make ``data`` lost: a transfer into it needs writes of a device left by an exception
    before they ran. ``behind()`` is sent right after that transfer; its result returned."""
    queued = None
    with pytest.raises(KeyError):
        async with hcqa.open_device("cpu:1") as d:
            src = d.alloc(shape=(4,), dtype="float32")
            spin = d.program("slow", _slow)
            for _ in range(5):
                spin(src, vals=(1,))
            pulled = hcqa.transfer(data, src)
            queued = behind()
            raise KeyError("leave")
    await outer.synchronize()
    with pytest.raises(DeviceClosed, match="a copy not run"):
        await pulled
    return queued


@pytest.mark.parametrize("path", ["graph", "graph-rebound", "queue"])
async def test_a_fused_run_behind_the_failed_transfer_does_not_run(path: str) -> None:
    """The fused run that waited for the failed transfer is not run (its output untouched),
    its fence names its kernels, and what it was to write is lost (on a replay that rebinds
    its output: the rebound buffer, not the captured one): a fused run queued behind it on
    the same queue that reads it fails too, and a copyout of it is refused."""
    with trio.fail_after(30):
        async with hcqa.open_device("cpu:0") as outer:
            data, mid, out, other, mid2, out2 = (outer.alloc(shape=(4,), dtype="float32")
                                                 for _ in range(6))  # fmt: skip
            await data.copyin(np.zeros(4, np.float32))
            inc = await outer.program_async("inc", INC)
            with hcqa.capture() as g:
                inc(mid, data)
                inc(out, mid)
            target = other if path == "graph-rebound" else out
            q = outer.compute_queue().exec(inc, (mid, data)).exec(inc, (out, mid))
            q2 = outer.compute_queue().exec(inc, (mid2, target)).exec(inc, (out2, mid2))
            for queue in (q, q2):
                await queue.submit()
                await queue.submit()  # a queue submitted again sends its fused form
            for b in (out, other):
                await b.copyin(np.full(4, -7, np.float32))
            await out2.copyin(np.full(4, -9, np.float32))

            def behind() -> tuple[hcqa.Fence, hcqa.Fence]:
                if path == "queue":
                    first = q.submit()
                else:
                    first = g.submit(buffers={out: other} if path == "graph-rebound" else None)
                return first, q2.submit()  # reads `target`, same queue: no wait between

            first, second = await _lose(outer, data, behind)
            with pytest.raises(DeviceClosed, match=r"kernels 'inc', 'inc' not run"):
                await first
            with pytest.raises(DeviceClosed, match=r"not run: it needed the writes of failed"):
                await second
            assert _peek(target) == [-7.0] * 4  # not run (before: [2.0] * 4, from stale data)
            assert _peek(out2) == [-9.0] * 4
            for b in (target, out2):
                with pytest.raises(DeviceClosed, match="holds no valid data"):
                    b.copyout(np.zeros(4, np.float32))
            if path == "graph-rebound":
                await out.copyout(np.zeros(4, np.float32))  # the captured buffer: untouched
            assert outer.faulted is None


@pytest.mark.parametrize("path", ["graph", "graph-rebound", "queue"])
async def test_a_fused_replay_of_lost_data_is_refused_until_written(path: str) -> None:
    """Asked for after the failure, a graph replay (on its own buffers or rebound ones) and
    a queue submit that read the lost buffer are refused at the call, nothing queued; once
    the buffer is written again they run. A replay that writes the lost buffer before it
    reads it runs."""
    with trio.fail_after(30):
        async with hcqa.open_device("cpu:0") as outer:
            data, mid, out, spare = (outer.alloc(shape=(4,), dtype="float32") for _ in range(4))
            await data.copyin(np.zeros(4, np.float32))
            await spare.copyin(np.zeros(4, np.float32))
            inc = await outer.program_async("inc", INC)
            with hcqa.capture() as g:
                inc(mid, data)
                inc(out, mid)
            with hcqa.capture() as refill:  # writes `data` first, then reads it
                inc(data, spare)
                inc(out, data)
            q = outer.compute_queue().exec(inc, (mid, data)).exec(inc, (out, mid))
            await q.submit()
            await q.submit()
            lost = spare if path == "graph-rebound" else data
            await _lose(outer, lost, lambda: None)
            await out.copyin(np.full(4, -7, np.float32))

            def send() -> hcqa.Fence:
                if path == "queue":
                    return q.submit()
                return g.submit(buffers={data: spare} if path == "graph-rebound" else None)

            with pytest.raises(DeviceClosed, match="holds no valid data"):
                send()
            await outer.synchronize()
            assert _peek(out) == [-7.0] * 4  # nothing was queued
            if path != "graph-rebound":
                await refill.submit()  # writes it before reading it: runs, valid again
                await send()
                assert _peek(out) == [3.0] * 4  # spare 0 -> data 1 -> mid 2 -> out 3
            else:
                await spare.copyin(np.full(4, 10, np.float32))
                await send()
                assert _peek(out) == [12.0] * 4
            assert outer.faulted is None
