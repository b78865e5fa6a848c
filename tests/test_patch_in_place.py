"""Queues and graphs resubmitted with new Variable values send their commands as built, with
one ``Bind`` the executor resolves the values from (OpenCL: the launch record's arguments;
Python kernels: the engine): several submits in flight each see their own values, typed
vals are range-checked before anything is queued, and a capture still records resolved
commands."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import hcqa
from hcqa import commands as cmd

CL = """
__kernel void put(__global int *y, int i, int v) { y[i] = v; }
"""


def _py_put(y: Any, i: int, v: int) -> None:
    y[i] = v


def _kernel(dev: Any, kind: str) -> Any:
    if kind == "opencl":
        return dev.program("put", CL)
    return dev.program("put", _py_put)


async def _read(buf: hcqa.Buffer, n: int) -> list[int]:
    out = np.empty(n, np.int32)
    await buf.copyout(out)
    return [int(v) for v in out]


@pytest.mark.parametrize("kind", ["opencl", "cpu"])
async def test_a_queue_resubmitted_with_new_values_sends_its_commands_as_built(
    kind: str,
) -> None:
    if kind == "opencl":
        pytest.importorskip("pyopencl")
    n = 8
    i, v = hcqa.Variable("i", 0, n - 1), hcqa.Variable("v", 0, 1 << 20)
    async with hcqa.open_device(f"{kind}:0") as d:
        y = d.alloc(shape=(n,), dtype="int32")
        await y.copyin(np.zeros(n, np.int32))
        k = _kernel(d, kind)
        q = d.compute_queue().exec(k, (y,), vals=(i, v)).exec(k, (y,), vals=(i, v + 1))
        template = list(q._commands)
        fences = [q.submit({i: j, v: 10 * j}) for j in range(n)]  # all in flight at once
        sent = q._resolve({i: 3, v: 5})
        if kind == "opencl":  # one native run: the values filled into a copy of its table
            assert [type(c).__name__ for c in sent] == ["ClRun"]
        else:
            assert type(sent[0]) is cmd.Bind and sent[1:] == template  # no command rebuilt
        with trio.fail_after(10):
            for f in fences:
                await f
        assert await _read(y, n) == [10 * j + 1 for j in range(n)]


async def test_an_opencl_graph_replayed_with_new_values_patches_its_launch_records() -> None:
    pytest.importorskip("pyopencl")
    n = 8
    i = hcqa.Variable("i", 0, n - 1)
    async with hcqa.open_device("opencl:0") as d:
        y = d.alloc(shape=(n,), dtype="int32")
        await y.copyin(np.zeros(n, np.int32))
        k = _kernel(d, "opencl")
        with hcqa.capture() as g:
            k(y, vals=(i, i * 3 + 1))
        fences = [g.submit(i=j) for j in range(n)]
        with trio.fail_after(10):
            for f in fences:
                await f
        assert await _read(y, n) == [3 * j + 1 for j in range(n)]


async def test_a_typed_val_out_of_its_c_range_is_refused_before_anything_is_queued() -> None:
    pytest.importorskip("pyopencl")
    v = hcqa.Variable("v", 0, 1 << 40)  # wider than the kernel's int
    async with hcqa.open_device("opencl:0") as d:
        y = d.alloc(shape=(4,), dtype="int32")
        k = _kernel(d, "opencl")
        q = d.compute_queue().exec(k, (y,), vals=(0, v))
        await q.submit({v: 7})
        sent = d.compute.value
        with pytest.raises(hcqa.InvalidCommand, match=r"val 'v' must be in \[-2147483648, "):
            q.submit({v: 1 << 33})
        assert d.compute.value == sent  # nothing was queued
        with hcqa.capture() as g:
            k(y, vals=(0, v))
        with pytest.raises(hcqa.InvalidCommand, match="must be in"):
            g.submit(v=1 << 32)
        await g(v=9)
        assert (await _read(y, 4))[0] == 9


async def test_a_queue_submitted_inside_a_capture_records_resolved_commands() -> None:
    pytest.importorskip("pyopencl")
    v = hcqa.Variable("v", 0, 100)
    async with hcqa.open_device("opencl:0") as d:
        y = d.alloc(shape=(4,), dtype="int32")
        k = _kernel(d, "opencl")
        q = d.compute_queue().exec(k, (y,), vals=(1, v))
        with hcqa.capture() as g:
            q.submit({v: 42})
        await q.submit({v: 5})  # outside: patched in place
        await g()  # the capture kept 42
        assert (await _read(y, 4))[1] == 42
