"""A lone asyncio Pipeline call: one batch per device, a *leg* (hcqa/_pipelegs.py).

Plain functions that call ``asyncio.run`` (pytest-trio leaves them alone), as in
test_asyncio.py.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import hcqa
from hcqa.actors.lane import LaneEngine
from hcqa.devices.base import Device
from hcqa.errors import DeviceFault

TIMEOUT = 30.0
F32 = npt.NDArray[np.float32]


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), TIMEOUT))


def inc(out: F32, a: F32) -> None:
    np.add(a, 1, out=out)


def double(out: F32, a: F32) -> None:
    np.multiply(a, 2, out=out)


def boom(out: F32, a: F32) -> None:
    raise ValueError("kernel failed")


def batches(*devices: Device) -> list[int]:
    """Batches submitted so far to each device's compute and copy queue."""
    return [q.statistics().submitted for d in devices for q in (d.compute, d.copy)]


def python_runs_only(device: Device) -> int:
    """Runs the compute queue's native lane ran (0 where there is no lane)."""
    engine = device.compute.engine
    return engine.native_runs if isinstance(engine, LaneEngine) else 0


def test_a_lone_call_is_one_batch_per_device_on_its_compute_queue() -> None:
    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            pipe = hcqa.Pipeline([(d0, inc), (d1, double)], in_shape=(16,), depth=2)
            rng = np.random.default_rng(0)
            before = batches(d0, d1)
            lanes = python_runs_only(d0), python_runs_only(d1)
            for _ in range(5):
                x = rng.standard_normal(16).astype(np.float32)
                np.testing.assert_array_equal(await pipe(x), (x + 1) * 2)
            # copy in + inc + transfer on cpu:0's compute queue, double + copy out on
            # cpu:1's: one batch each per call, no copy queue at all
            assert np.subtract(batches(d0, d1), before).tolist() == [5, 0, 5, 0]
            # a copy ahead of a Python kernel runs on the engine's Python thread with it
            assert (python_runs_only(d0), python_runs_only(d1)) == lanes
            assert pipe.statistics().completed == 5

    run(main)


def test_stages_on_one_device_share_a_leg() -> None:
    async def main() -> None:
        async with hcqa.open_devices("cpu:0") as (d0,):
            pipe = hcqa.Pipeline([(d0, inc), (d0, double), (d0, inc)], in_shape=(8,))
            before = batches(d0)
            x = np.arange(8, dtype=np.float32)
            for _ in range(3):
                np.testing.assert_array_equal(await pipe(x), (x + 1) * 2 + 1)
            assert np.subtract(batches(d0), before).tolist() == [3, 0]

    run(main)


def test_calls_in_flight_together_replay_the_graph_and_agree() -> None:
    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            pipe = hcqa.Pipeline([(d0, inc), (d1, double)], in_shape=(8,), depth=3)
            xs = [np.full(8, i, np.float32) for i in range(12)]
            got = await asyncio.gather(*(pipe(x) for x in xs))
            for x, y in zip(xs, got, strict=True):
                np.testing.assert_array_equal(y, (x + 1) * 2)
            np.testing.assert_array_equal(await pipe(xs[3]), (xs[3] + 1) * 2)  # a lone one

    run(main)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_c_kernels_ride_the_native_lane_in_a_leg() -> None:
    src = "void add3(float *out, const float *a) {\n"
    src += "    for (int i = 0; i < 16; i++) out[i] = a[i] + 3;\n}\n"

    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            add3 = d0.program("add3", src, entry="add3")
            pipe = hcqa.Pipeline([(d0, add3), (d1, double)], in_shape=(16,))
            x = np.arange(16, dtype=np.float32)
            before = batches(d0, d1)
            for _ in range(3):
                np.testing.assert_array_equal(await pipe(x), (x + 3) * 2)
            assert np.subtract(batches(d0, d1), before).tolist() == [3, 0, 3, 0]

    run(main)


def test_staged_devices_go_step_by_step() -> None:
    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1", host_visible=False) as (d0, d1):
            pipe = hcqa.Pipeline([(d0, inc), (d1, double)], in_shape=(8,))
            assert all(s.legs is None for s in pipe._pool.slots)
            before = batches(d0, d1)
            x = np.arange(8, dtype=np.float32)
            np.testing.assert_array_equal(await pipe(x), (x + 1) * 2)
            # copy in; inc; transfer; double; copy out (on the copy queue: staged)
            assert np.subtract(batches(d0, d1), before).tolist() == [1, 1, 1, 2]

    run(main)


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_faulting_leg_raises_the_devices_fault(where: str) -> None:
    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            stages = [(d0, boom), (d1, double)] if where == "first" else [(d0, inc), (d1, boom)]
            pipe = hcqa.Pipeline(stages, in_shape=(8,), check=False)
            with pytest.raises(DeviceFault) as info:
                await pipe(np.zeros(8, np.float32))
            assert isinstance(info.value.__cause__, ValueError)
            assert pipe.statistics().in_flight == 0

    run(main)  # (the fault was observed: the block does not raise it again)
