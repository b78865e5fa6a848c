"""What users build on devices, on OpenCL devices: Pipeline stages with an NDRange, open_batcher,
graph replays on other buffers, asyncio hosting, the Tracer (device ranges on the host clock,
inside their launches), and PoCL's thread default against a user's own setting."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
from _kinds import opencl_missing

import hcqa
from hcqa import Pipeline, Stage, Tracer

pytestmark = pytest.mark.skipif(opencl_missing() is not None, reason=str(opencl_missing()))

N = 256
GROUPS = {"global_size": (N // 64, 1, 1), "local_size": (64, 1, 1)}  # 4 groups of 64 items

SCALE = """
__kernel void scale(__global float *out, __global const float *a, int n, int k) {
    int i = get_global_id(0);
    if (i < n) out[i] = a[i] * k;
}
"""
ADD1 = """
__kernel void add1(__global float *out, __global const float *a, int n) {
    int i = get_global_id(0);
    if (i < n) out[i] = a[i] + 1.0f;
}
"""
SPIN = """
__kernel void spin(__global float *x, int n) {
    float a = x[0];
    for (int i = 0; i < n; i++) a = a * 0.9999999f + 1e-7f;
    x[0] = a;
}
"""


def negate(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
    np.negative(a, out=out)


def _xs(k: int, shape: tuple[int, ...] = (N,)) -> list[npt.NDArray[np.float32]]:
    rng = np.random.default_rng(k)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(k)]


async def test_pipeline_over_two_opencl_devices_and_a_cpu_device() -> None:
    async with hcqa.open_devices("opencl:0", "opencl:0", "cpu:0", hang_limit=30) as (g0, g1, c0):
        stages = [
            Stage(device=g0, program=g0.program("scale", SCALE), vals=(N, 3), **GROUPS),
            Stage(device=g1, program=g1.program("add1", ADD1), vals=(N,), **GROUPS),
            Stage(device=c0, program=negate),
        ]
        pipe = Pipeline(stages, in_shape=(N,), depth=3)
        xs = _xs(12)
        with trio.fail_after(30):
            results = await pipe.map(xs)
            one = await pipe(xs[0])
        for x, y in zip(xs, results, strict=True):
            np.testing.assert_allclose(y, -(3 * x + 1), rtol=1e-6)
        np.testing.assert_allclose(one, -(3 * xs[0] + 1), rtol=1e-6)
        assert pipe.statistics().completed == 13


async def test_batcher_over_an_opencl_pipeline() -> None:
    rows, width = 8, 32
    async with hcqa.open_device("opencl:0", hang_limit=30) as g:
        scale = g.program("scale", SCALE)
        n = rows * width
        stage = Stage(
            device=g,
            program=scale,
            vals=(n, 5),
            global_size=(n // 64, 1, 1),
            local_size=(64, 1, 1),
        )
        pipe = Pipeline([stage], in_shape=(rows, width), depth=2)
        samples = _xs(20, (width,))
        got: dict[int, npt.NDArray[Any]] = {}
        async with hcqa.open_batcher(pipe, max_batch=rows, max_wait=0.002) as batch:

            async def one(i: int) -> None:
                got[i] = await batch(samples[i])

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for i in range(len(samples)):
                        nursery.start_soon(one, i)
            stats = batch.statistics()
        for i, x in enumerate(samples):
            np.testing.assert_allclose(got[i], 5 * x, rtol=1e-6)
        assert stats.batches < len(samples)  # samples really shared launches


async def test_graph_replays_on_other_buffers_across_opencl_devices() -> None:
    async with hcqa.open_devices("opencl:0", "opencl:0", hang_limit=30) as (g0, g1):
        scale = g0.program("scale", SCALE)
        add1 = g1.program("add1", ADD1)
        k = hcqa.Variable("k", 1, 10)

        def alloc(d: hcqa.Device) -> hcqa.Buffer:
            return d.alloc(shape=(N,), dtype="float32")

        x, y, t, z = alloc(g0), alloc(g0), alloc(g1), alloc(g1)
        x2, z2 = alloc(g0), alloc(g1)
        a, b = _xs(2)
        await x.copyin(a)
        await x2.copyin(b)
        with hcqa.capture() as g:
            scale(y, x, vals=(N, k), **GROUPS)
            hcqa.transfer(t, y)
            add1(z, t, vals=(N,), **GROUPS)
        host = np.empty(N, np.float32)
        with trio.fail_after(30):
            await g(k=2)
            await z.copyout(host)
            np.testing.assert_allclose(host, 2 * a + 1, rtol=1e-6)
            await g(buffers={x: x2, z: z2}, k=7)
            await z2.copyout(host)
            np.testing.assert_allclose(host, 7 * b + 1, rtol=1e-6)
            await z.copyout(host)  # the captured output was left alone
            np.testing.assert_allclose(host, 2 * a + 1, rtol=1e-6)
        async with hcqa.open_device("cpu:0") as c0:  # a buffer of another device is refused
            with pytest.raises(hcqa.InvalidCommand):
                g.submit(buffers={x: c0.alloc(shape=(N,), dtype="float32")}, k=1)


def test_asyncio_hosting_on_opencl() -> None:
    a = np.arange(N, dtype=np.float32)

    async def main() -> None:
        async with hcqa.open_devices("opencl:0", "cpu:0", hang_limit=30) as (g, c0):
            x = g.alloc(shape=(N,), dtype="float32")
            y = g.alloc(shape=(N,), dtype="float32")
            on_cpu = c0.alloc(shape=(N,), dtype="float32")
            scale = g.program("scale", SCALE)
            await x.copyin(a)
            await scale(y, x, vals=(N, 2), **GROUPS)
            await hcqa.transfer(on_cpu, y)
            np.testing.assert_array_equal(on_cpu.numpy_view(), 2 * a)
            secs = await scale.timed(y, x, vals=(N, 2), **GROUPS)
            assert 0 < secs < 30
            with hcqa.capture() as graph:
                scale(y, x, vals=(N, 4), **GROUPS)
            await graph()
            host = np.empty(N, np.float32)
            await y.copyout(host)
            np.testing.assert_array_equal(host, 4 * a)
            # a wait_for that times out cancels the await, not the device work
            gate = hcqa.Signal()
            q = g.compute_queue().wait(gate, 1).exec(scale, (y, x), vals=(N, 3), **GROUPS)
            fence = q.submit()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(fence.wait(), 0.05)
            gate.value = 1
            await fence
            await y.copyout(host)
            np.testing.assert_array_equal(host, 3 * a)
            pipe = Pipeline(
                [Stage(device=g, program=scale, vals=(N, 5), **GROUPS), (c0, negate)],
                in_shape=(N,),
            )
            np.testing.assert_array_equal(await pipe(a), -5 * a)
            await g.synchronize()
            gate.close()

    asyncio.run(asyncio.wait_for(main(), 60))


async def test_tracer_puts_opencl_ranges_on_the_host_clock_inside_their_launches(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.json"
    windows: dict[str, tuple[int, int]] = {}
    with Tracer(path):
        async with hcqa.open_device("opencl:0", hang_limit=30) as g:
            buf = g.alloc(shape=(N,), dtype="float32")
            await buf.copyin(np.ones(N, np.float32))
            await g.program("spin", SPIN)(buf, vals=(1000,))  # built and compiled once
            for i in range(4):
                prog = g.program(f"spin{i}", SPIN, entry="spin")
                t0 = time.monotonic_ns()
                await prog(buf, vals=(200_000,))  # a millisecond or more
                windows[f"spin{i}"] = (t0, time.monotonic_ns())
            offset = g.clock_offset_ns()
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    (pid,) = [p for p, name in procs.items() if name == "opencl:0"]
    origin = _origin_ns(doc)
    for name, (t0, t1) in windows.items():
        (ev,) = [e for e in events if e.get("ph") == "X" and e["name"] == name]
        assert ev["pid"] == pid and ev.get("cat") == "device"
        start = origin + ev["ts"] * 1000
        end = start + ev["dur"] * 1000
        slack = 200_000  # ns: the offset is measured, within microseconds; scheduling is not
        assert t0 - slack <= start <= end <= t1 + slack, (name, start - t0, t1 - end, offset)
        assert ev["dur"] > 0


def _origin_ns(doc: dict[str, Any]) -> int:
    for key in ("otherData", "metadata"):
        if key in doc and "origin_ns" in doc[key]:
            return int(doc[key]["origin_ns"])
    raise AssertionError(f"no origin_ns in the trace's metadata: {sorted(doc)}")


def _compute_units(env: dict[str, str]) -> tuple[str, int]:
    """(POCL_MAX_PTHREAD_COUNT after opening opencl:0, opencl:0's compute units), in a child."""
    code = textwrap.dedent(
        """
        import os, trio, hcqa
        async def main():
            async with hcqa.open_device("opencl:0") as g:
                print(os.environ["POCL_MAX_PTHREAD_COUNT"], g.cl_device.max_compute_units)
        trio.run(main)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    value, units = out.stdout.split()
    return value, int(units)


def test_opening_sets_pocls_thread_default_and_keeps_a_users_own() -> None:
    from hcqa.devices.opencl import platforms

    if "Portable Computing" not in platforms.cl_device(0).platform.name:
        pytest.skip("opencl:0 is not PoCL")
    env = {k: v for k, v in os.environ.items() if k != "POCL_MAX_PTHREAD_COUNT"}
    default = str(platforms.default_pocl_threads())
    assert _compute_units(env) == (default, int(default))  # PoCL: one compute unit per thread
    mine = "3" if default != "3" else "2"
    assert _compute_units({**env, "POCL_MAX_PTHREAD_COUNT": mine}) == (mine, int(mine))
