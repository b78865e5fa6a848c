"""A Python list passed where an array of another dtype is expected: the error names the dtype
expected and the conversion that fixes it; doing what it says works (Pipeline, ProcessPipeline,
Batcher alike)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import trio

import hcqa


def inc(out: np.ndarray, x: np.ndarray) -> None:
    np.add(x, 1, out=out)


async def follow_the_hint(
    call: Callable[[Any], Awaitable[np.ndarray]], x: list[Any], what: str, dtype: str
) -> np.ndarray:
    """Call with the list as a user would, read the fix from the error, apply it, call again."""
    with pytest.raises(hcqa.InvalidCommand) as info:
        await call(x)
    message = str(info.value)
    assert message.startswith(f"{what} must be {dtype}["), message
    assert "from a Python list" in message, message
    hint = re.search(r"np\.asarray\(x, dtype=[^)]*\)", message)
    assert hint is not None, message
    fixed = eval(hint[0], {"np": np, "x": x})  # the expression the message tells users to write
    return await call(fixed)


async def test_a_list_into_a_pipeline() -> None:
    async with hcqa.open_devices("cpu:0") as (d0,):
        pipe = hcqa.Pipeline([(d0, inc)], in_shape=(3,), depth=1)
        y = await follow_the_hint(pipe, [1.0, 2.0, 3.0], "pipeline input", "float32")
        np.testing.assert_array_equal(y, np.array([2, 3, 4], np.float32))
        assert y.dtype == np.float32

        with pytest.raises(hcqa.InvalidCommand) as info:  # ints too: int64, same hint
            await pipe([1, 2, 3])
        assert str(info.value) == (
            "pipeline input must be float32[3] (got int64[3] from a Python list); "
            "convert it with np.asarray(x, dtype=np.float32)"
        )
        with pytest.raises(hcqa.InvalidCommand) as info:  # the right dtype, the wrong shape
            await pipe(np.zeros(4, np.float32))
        assert str(info.value) == "pipeline input must be float32[3] (got float32[4])"


async def test_a_list_into_a_process_pipeline() -> None:
    with trio.fail_after(60):
        async with hcqa.open_process_pipeline(
            ["hcqa.workers:add_one"], in_shape=(3,), dtype="int32", depth=1
        ) as pipe:
            y = await follow_the_hint(pipe, [1, 2, 3], "pipeline input", "int32")
    np.testing.assert_array_equal(y, np.array([2, 3, 4], np.int32))


async def test_a_list_into_a_batcher() -> None:
    async with hcqa.open_devices("cpu:0") as (d0,):
        pipe = hcqa.Pipeline([(d0, inc)], in_shape=(4, 2), depth=1)
        async with hcqa.open_batcher(pipe, max_wait=0.001) as batch:
            y = await follow_the_hint(batch, [0.5, 1.5], "a sample", "float32")
    np.testing.assert_array_equal(y, np.array([1.5, 2.5], np.float32))


async def test_copyin_says_how_to_convert() -> None:
    async with hcqa.open_devices("cpu:0") as (d0,):
        a = d0.alloc(shape=(3,), dtype="float32")
        with pytest.raises(hcqa.InvalidCommand) as info:
            await a.copyin(np.asarray([1.0, 2.0, 3.0]))
        assert str(info.value).endswith("pass np.asarray(x, dtype=np.float32)")
        with pytest.raises(hcqa.InvalidCommand) as info:
            await a.copyout(np.empty(3))
        assert str(info.value).endswith("pass np.empty((3,), dtype=np.float32)")
