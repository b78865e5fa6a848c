"""Timelines near 2**63 and 2**64: timeline values are unsigned 64-bit.

A device opened with ``timeline_start`` just below 2**63 or 2**64 keeps working past it: the
native lane and the C timeline take steps modulo 2**64 (a step's epoch and signal value are
the same computed on the wrapped number), steps completed out of order across the boundary
still advance the timeline in order, and a transfer's foreign step on another device's
timeline completes there too. The Python timeline (no native library) counts on with
Python ints.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import trio
import trio.testing
from _kinds import Count, spec

import hcqa
from hcqa.devices.timeline import WRAP
from hcqa.errors import InvalidCommand
from hcqa.signals import Signal

STARTS = [2**63 - 7, 2**64 - 7]  # steps pending on both sides of the boundary at once


def _value(seq: int) -> int:
    return (seq - 1) % WRAP + 1


@pytest.mark.parametrize("start", STARTS, ids=["2**63", "2**64"])
async def test_a_timeline_passes_2_to_the_63_and_64(kind: str, start: int) -> None:
    count = Count()
    with trio.fail_after(30):
        async with hcqa.open_devices(spec(kind), "cpu:1", hang_limit=10, timeline_start=start) as (
            d,
            other,
        ):
            assert d.timeline.value == _value(start)
            prog = count.program(d)
            out, scratch = d.alloc(8), d.alloc(64)
            await count.zero(out)
            gate = Signal()
            # compute waits on the gate, while copies finish: steps complete out of order
            # across the boundary, and the timeline must hold at the first one not done
            held = d.compute_queue().wait(gate, 1).submit()
            base = d.statistics().timeline_reserved
            fences, copies = [], []
            for k in range(6):  # pending steps on both sides of the boundary at once
                fences.append(prog(out))
                copies.append(scratch.copyin(bytes([k]) * 64))
            mirror = other.alloc(64)
            moved = hcqa.transfer(mirror, scratch)  # a step on both timelines
            await d.copy.signal.wait(d.copy.value)  # the copies ran (their queue's signal)
            assert not any(f.reached for f in copies)  # the timeline holds at compute's step
            assert not held.reached and not any(f.reached for f in fences)
            gate.value = 1
            for f in [*fences, moved]:
                await f
            await d.synchronize()
            await other.synchronize()
            reserved = d.statistics().timeline_reserved
            assert reserved == base + 13 and reserved > start + 13  # past the boundary
            assert d.timeline.value == _value(reserved)
            assert await count.calls(out) == 6
            got = np.zeros(64, np.uint8)
            await mirror.copyout(got)
            assert (got == 5).all()
            for _ in range(4):  # and on, in order
                await prog(out)
            assert await count.calls(out) == 10
        gate.close()


def test_the_python_timeline_passes_2_to_the_64() -> None:
    """Without the native library (HCQA_NATIVE_LANE=0), in a child process."""
    code = (
        "import trio, hcqa\n"
        "async def main():\n"
        f"    async with hcqa.open_device('cpu:0', timeline_start={2**64 - 2}) as d:\n"
        "        b = d.alloc(8)\n"
        "        for k in range(5):\n"
        "            await b.copyin(bytes([k]) * 8)\n"
        "        await d.synchronize()\n"
        "        print(d.statistics().timeline_reserved, d.timeline.value)\n"
        "trio.run(main)\n"
    )
    env = {**os.environ, "HCQA_NATIVE_LANE": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    reserved, value = map(int, proc.stdout.split())
    assert reserved == 2**64 + 3 and value == _value(reserved)


async def test_a_start_past_64_bits_is_refused() -> None:
    with pytest.raises(InvalidCommand, match=r"'timeline_start' must be <= 2\*\*64 - 1"):
        async with hcqa.open_device("cpu:0", timeline_start=2**64):
            pass
    async with hcqa.open_device("cpu:0", timeline_start=2**64 - 1) as d:
        await d.alloc(8).copyin(bytes(8))
        assert d.timeline.value == _value(2**64) == WRAP  # step 2**64: 0 in C
