"""Launch geometry an OpenCL device can't take is refused before anything is queued.

A driver fails a launch it can't take as a command (a sticky ``DeviceFault``), and PoCL's
pthread driver kills the process (SIGILL) for an NDRange of 2**32 work-items or more. hcqa
checks every concrete geometry against what the device reports -- at a call, at a queue's
``exec`` or submit, at a graph replay once its Variables are resolved -- and refuses it with
``InvalidCommand``; the device stays usable.

The cases that would kill the process if they reached the driver run in a child process
(a missing check then fails the test instead of ending the run); those that would only fault
the device run here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import trio
from _kinds import opencl_missing

import hcqa
from hcqa.errors import InvalidCommand

TIMEOUT = 60

IOTA = """
__kernel void iota(__global int *out) {
    size_t i = get_global_id(0);
    if (i < 4) out[i] = (int)i + 1;
}
"""
SET = "__kernel void set(__global int *out) { out[0] = 5; }"


@pytest.fixture(autouse=True)
def _opencl() -> None:
    why = opencl_missing()
    if why is not None:
        pytest.skip(why)


async def _still_usable(d: hcqa.Device) -> None:
    """The device runs a kernel and answers right after the refusals."""
    assert d.faulted is None
    prog = d.program("iota", IOTA)
    out = d.alloc(shape=(4,), dtype="int32")
    await prog(out, global_size=(1, 1, 1), local_size=(4, 1, 1))
    host = np.zeros(4, np.int32)
    await out.copyout(host)
    assert host.tolist() == [1, 2, 3, 4]
    assert d.faulted is None


# Each (global_size, local_size) is past one limit of PoCL's CPU device (work-group size 4096,
# 4096 work-items per dimension, 64-bit size_t) without being 2**32 work-items in all.
FAULTING = [
    pytest.param((1, 1, 1), (4097, 1, 1), "dimension 0 must be <= ", id="local-dim"),
    pytest.param((1, 1, 1), (1, 1, 8192), "dimension 2 must be <= ", id="local-dim-z"),
    pytest.param((1, 1, 1), (64, 64, 2), "work-items in all", id="group-size"),
    pytest.param((2**64, 1, 1), (1, 1, 1), "size_t", id="past-size_t"),
    pytest.param((2**63, 1, 1), (4, 1, 1), "size_t", id="product-past-size_t"),
]


@pytest.mark.parametrize(("gs", "ls", "match"), FAULTING)
async def test_a_call_past_a_device_limit_is_refused(gs: Any, ls: Any, match: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("opencl:0") as d:
            prog = d.program("iota", IOTA)
            out = d.alloc(shape=(4,), dtype="int32")
            with pytest.raises(InvalidCommand, match=match):
                prog(out, global_size=gs, local_size=ls)
            with pytest.raises(InvalidCommand, match=match):
                d.compute_queue().exec(prog, (out,), global_size=gs, local_size=ls)
            await _still_usable(d)


@pytest.mark.parametrize(("gs", "ls", "match"), FAULTING)
async def test_a_replay_past_a_device_limit_is_refused(gs: Any, ls: Any, match: str) -> None:
    """Geometry from Variables is checked once they are resolved: at a queue's submit and at
    a graph's replay, before anything is sent."""
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("opencl:0") as d:
            prog = d.program("iota", IOTA)
            out = d.alloc(shape=(4,), dtype="int32")
            g0 = hcqa.Variable("g0", 1, 2**64)
            ls_ = tuple(hcqa.Variable(f"l{i}", 1, 8192) for i in range(3))
            sizes = ((g0, gs[1], gs[2]), ls_)
            bad = {"g0": gs[0], "l0": ls[0], "l1": ls[1], "l2": ls[2]}
            q = d.compute_queue().exec(prog, (out,), global_size=sizes[0], local_size=sizes[1])
            with pytest.raises(InvalidCommand, match=match):
                q.submit(bad)
            with hcqa.capture() as graph:
                prog(out, global_size=sizes[0], local_size=sizes[1])
            with pytest.raises(InvalidCommand, match=match):
                await graph(**bad)
            await graph(g0=1, l0=4, l1=1, l2=1)  # fits: runs
            await _still_usable(d)


def test_an_ndrange_of_2_to_the_32_work_items_is_refused() -> None:
    """PoCL would kill the process: run in a child, which must end normally."""
    script = textwrap.dedent(
        f"""
        import trio, hcqa
        from hcqa.errors import InvalidCommand

        IOTA = {IOTA!r}

        async def main():
            async with hcqa.open_device("opencl:0") as d:
                prog = d.program("iota", IOTA)
                out = d.alloc(shape=(4,), dtype="int32")
                n = hcqa.Variable("n", 1, 2**32)
                for gs, ls in (((2**32, 1, 1), (1, 1, 1)), ((2**16, 2**16, 1), (1, 1, 1)),
                               ((2**16, 1, 1), (1, 2**16, 1)), ((2**30, 1, 1), (4, 1, 1)),
                               ((2**11, 2**11, 2**10), (1, 1, 1))):
                    for attempt in (
                        lambda: prog(out, global_size=gs, local_size=ls),
                        lambda: d.compute_queue().exec(prog, (out,), global_size=gs,
                                                       local_size=ls).submit(),
                    ):
                        try:
                            attempt()
                        except InvalidCommand as exc:
                            assert "work-items" in str(exc), exc
                        else:
                            raise SystemExit(f"not refused: {{gs}} * {{ls}}")
                with hcqa.capture() as g:
                    prog(out, global_size=(n, 1, 1), local_size=(1, 1, 1))
                with hcqa.capture() as g2:
                    prog(out, global_size=(n, 2**16, 1), local_size=(1, 1, 1))
                for graph, value in ((g, 2**32), (g2, 2**16)):
                    try:
                        await graph(n=value)
                    except InvalidCommand as exc:
                        assert "in all" in str(exc), exc
                    else:
                        raise SystemExit(f"replay not refused: n={{value}}")
                await g(n=4)
                assert d.faulted is None
                print("refused")

        trio.run(main)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stdout}{proc.stderr[-2000:]}"
    assert "refused" in proc.stdout


async def test_a_misaligned_view_bound_at_a_replay_is_refused() -> None:
    """A view that does not start at the device's base address alignment can't be a kernel
    argument: bound at a replay (``buffers=``), it is refused before anything is sent, not
    a sticky fault of the device."""
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("opencl:0") as d:
            prog = d.program("set", SET)
            base = d.alloc(1024)
            captured = d.alloc(4)
            with hcqa.capture() as g:
                prog(captured)
            misaligned = base.view(4, 4)
            with pytest.raises(InvalidCommand, match="multiple of"):
                await g(buffers={captured: misaligned})
            with pytest.raises(InvalidCommand, match="multiple of"):
                g.submit(buffers={captured: misaligned})
            aligned = base.view(512, 4)
            await g(buffers={captured: aligned})
            word = np.zeros(1, np.int32)
            await aligned.copyout(word)
            assert word[0] == 5
            await _still_usable(d)
