"""Every way bytes move: copyin / copyout / load / views / transfer, direct and staged."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing

import hcqa
from hcqa import DeviceClosed, InvalidCommand, OutOfMemory

MIB = 1 << 20
CHUNK = 2 * MIB  # the staging ring's chunk size
DTYPES = ["uint8", "int16", "int32", "int64", "float32", "float64", "complex64"]
SIZES = [100, CHUNK, CHUNK + 1, 5 * MIB + 3]

visibility = pytest.mark.parametrize("host_visible", [True, False], ids=["direct", "staged"])


def _data(nbytes: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _typed(dtype: str, n: int, seed: int = 0) -> npt.NDArray[Any]:
    """``n`` elements of ``dtype`` with every byte random."""
    return _data(n * np.dtype(dtype).itemsize, seed).view(dtype)


def _chunks(nbytes: int) -> int:
    return -(-nbytes // CHUNK)


def _staging_uses(d: hcqa.Device) -> int:
    assert isinstance(d, hcqa.CpuDevice)
    return d.staging.statistics().uses


# -- copyin / copyout --------------------------------------------------------------------


@visibility
@pytest.mark.parametrize("dtype", DTYPES)
async def test_round_trip_dtypes(host_visible: bool, dtype: str) -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=host_visible) as d:
        x = _typed(dtype, 24, seed=1).reshape(4, 6)
        buf = d.alloc(shape=(4, 6), dtype=dtype)
        assert (buf.nbytes, buf.dtype, buf.shape) == (x.nbytes, np.dtype(dtype), (4, 6))
        await buf.copyin(x)
        out = np.zeros_like(x)
        await buf.copyout(out)
        assert out.tobytes() == x.tobytes()


@visibility
@pytest.mark.parametrize("nbytes", SIZES)
async def test_round_trip_sizes_and_staging(host_visible: bool, nbytes: int) -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=host_visible) as d:
        x = _data(nbytes, seed=nbytes)
        buf = d.alloc(nbytes)
        uses = _staging_uses(d)
        await buf.copyin(x)
        out = np.zeros(nbytes, np.uint8)
        await buf.copyout(out)
        np.testing.assert_array_equal(out, x)
        staged = _staging_uses(d) - uses
        assert staged == (0 if host_visible else 2 * _chunks(nbytes))


@visibility
async def test_bytes_bytearray_memoryview(host_visible: bool) -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=host_visible) as d:
        raw = d.alloc(256)
        await raw.copyin(bytes(range(256)))
        got = bytearray(256)
        await raw.copyout(got)
        assert got == bytes(range(256))
        await raw.copyin(bytearray(reversed(range(256))))
        mv = memoryview(bytearray(256))
        await raw.copyout(mv)
        assert mv.tobytes() == bytes(reversed(range(256)))
        await raw.copyin(memoryview(bytes(256)))
        await raw.copyout(got)
        assert got == bytes(256)
        # raw bytes into a typed buffer: no dtype to check
        typed = d.alloc(shape=(4,), dtype="float32")
        await typed.copyin(np.arange(4, dtype=np.float32).tobytes())
        out = np.zeros(4, np.float32)
        await typed.copyout(out)
        np.testing.assert_array_equal(out, np.arange(4, dtype=np.float32))


@visibility
async def test_raw_buffer_takes_any_dtype(host_visible: bool) -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=host_visible) as d:
        raw = d.alloc(64)
        x = np.linspace(0, 1, 8)  # float64: 64 bytes
        await raw.copyin(x)
        out = np.zeros(16, np.float32)  # any dtype out, same bytes
        await raw.copyout(out)
        assert out.tobytes() == x.tobytes()


@visibility
async def test_non_contiguous_source_is_copied(host_visible: bool) -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=host_visible) as d:
        big = np.arange(64, dtype=np.int32)
        strided = big[::2]
        assert not strided.flags.c_contiguous
        buf = d.alloc(shape=(32,), dtype="int32")
        await buf.copyin(strided)
        out = np.zeros(32, np.int32)
        await buf.copyout(out)
        np.testing.assert_array_equal(out, strided)


@visibility
async def test_copy_errors(host_visible: bool) -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=host_visible) as d:
        f32 = d.alloc(shape=(8,), dtype="float32")
        raw = d.alloc(32)
        before = d.statistics()
        with pytest.raises(InvalidCommand, match="dtype"):
            f32.copyin(np.zeros(8, np.int32))
        with pytest.raises(InvalidCommand, match="dtype"):
            f32.copyout(np.zeros(8, np.int32))
        with pytest.raises(InvalidCommand, match="32 bytes"):
            f32.copyin(np.zeros(7, np.float32))
        with pytest.raises(InvalidCommand, match="32 bytes"):
            raw.copyin(bytes(33))
        with pytest.raises(InvalidCommand, match="32 bytes"):
            raw.copyout(bytearray(31))
        readonly = np.zeros(8, np.float32)
        readonly.flags.writeable = False
        with pytest.raises(InvalidCommand, match="writable"):
            f32.copyout(readonly)
        with pytest.raises(InvalidCommand, match="writable"):
            raw.copyout(bytes(32))
        with pytest.raises(InvalidCommand, match="writable"):
            raw.copyout(memoryview(bytes(32)))
        with pytest.raises(InvalidCommand, match="contiguous"):
            f32.copyout(np.zeros(16, np.float32)[::2])
        for wrong in ([0] * 32, "x" * 32, None, 32):
            with pytest.raises(TypeError):
                raw.copyin(wrong)
            with pytest.raises(TypeError):
                raw.copyout(wrong)
        assert d.statistics() == before


# -- numpy_view ----------------------------------------------------------------------------


async def test_numpy_view_when_host_visible() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=True) as d:
        buf = d.alloc(shape=(2, 3), dtype="int16")
        x = np.arange(6, dtype=np.int16).reshape(2, 3)
        await buf.copyin(x)
        view = buf.numpy_view()
        assert (view.dtype, view.shape) == (np.dtype("int16"), (2, 3))
        np.testing.assert_array_equal(view, x)
        view[1, 2] = 99
        out = np.zeros_like(x)
        await buf.copyout(out)
        assert out[1, 2] == 99


async def test_numpy_view_refused_when_not_host_visible() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=False) as d:
        buf = d.alloc(64)
        with pytest.raises(InvalidCommand, match="host-visible"):
            buf.numpy_view()
        with pytest.raises(InvalidCommand, match="host-visible"):
            buf.view(0, 8).numpy_view()


# -- load ----------------------------------------------------------------------------------


@visibility
@pytest.mark.parametrize(
    ("file_size", "offset", "nbytes"),
    [(4096, 0, None), (4096, 100, 1000), (5 * MIB + 3, 7, 5 * MIB - 4), (CHUNK * 2, 0, CHUNK)],
)
async def test_load_from_file(
    tmp_path: Path, host_visible: bool, file_size: int, offset: int, nbytes: int | None
) -> None:
    data = _data(file_size, seed=file_size)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    n = file_size - offset if nbytes is None else nbytes
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=host_visible) as d:
        buf = d.alloc(n + 16)  # bigger than what is loaded
        await buf.copyin(bytes(n + 16))
        uses = _staging_uses(d)
        if nbytes is None:
            whole = d.alloc(n)
            await whole.load(path)
            await buf.view(0, n).load(str(path))
            got = np.zeros(n, np.uint8)
            await whole.copyout(got)
            np.testing.assert_array_equal(got, data)
        else:
            await buf.load(path, offset=offset, nbytes=nbytes)
        got = np.zeros(n + 16, np.uint8)
        await buf.copyout(got)
        np.testing.assert_array_equal(got[:n], data[offset : offset + n])
        np.testing.assert_array_equal(got[n:], 0)
        if host_visible:
            assert _staging_uses(d) == uses
        else:
            assert _staging_uses(d) > uses


@visibility
async def test_load_into_a_view(tmp_path: Path, host_visible: bool) -> None:
    data = _data(1000, seed=5)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=host_visible) as d:
        big = d.alloc(300)
        await big.copyin(bytes(300))
        await big.view(10, 100).load(path, offset=5)
        got = np.zeros(300, np.uint8)
        await big.copyout(got)
        np.testing.assert_array_equal(got[10:110], data[5:105])
        assert not got[:10].any() and not got[110:].any()


async def test_load_errors(tmp_path: Path) -> None:
    path = tmp_path / "small.bin"
    path.write_bytes(bytes(100))
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        buf = d.alloc(64)
        before = d.statistics()
        with pytest.raises(InvalidCommand, match="110"):
            buf.load(path, offset=50, nbytes=60)  # past the end of the file
        with pytest.raises(InvalidCommand, match="offset \\+ nbytes"):
            buf.load(path, offset=40)  # the default nbytes (64) does not fit
        with pytest.raises(InvalidCommand, match="nbytes"):
            d.alloc(128).load(path, nbytes=100 + 1)
        with pytest.raises(InvalidCommand, match="64 bytes"):
            buf.load(path, nbytes=65)  # more than the buffer holds
        with pytest.raises(InvalidCommand, match="nbytes"):
            buf.load(path, nbytes=0)
        with pytest.raises(InvalidCommand, match="offset"):
            buf.load(path, offset=-1)
        with pytest.raises(InvalidCommand, match="must be a readable file"):
            buf.load(tmp_path / "missing.bin")
        with pytest.raises(TypeError):
            buf.load(path, offset=1.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            buf.load(42)  # type: ignore[arg-type]
        assert d.statistics().timeline_reserved == before.timeline_reserved


# -- views -------------------------------------------------------------------------------


@visibility
async def test_views_share_memory(host_visible: bool) -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=host_visible) as d:
        base = d.alloc(256)
        await base.copyin(bytes(256))
        v = base.view(64, 128)
        assert (v.offset, v.nbytes, v.base) == (64, 128, base)
        await v.copyin(bytes([7]) * 128)
        vv = v.view(32, 16, dtype="int32")  # a view of a view
        assert (vv.offset, vv.shape, vv.base) == (96, (4,), base)
        await vv.copyin(np.array([1, 2, 3, 4], np.int32))
        got = bytearray(256)
        await base.copyout(got)
        want = bytearray(256)
        want[64:192] = bytes([7]) * 128
        want[96:112] = np.array([1, 2, 3, 4], np.int32).tobytes()
        assert got == want
        part = np.zeros(4, np.int32)
        await vv.copyout(part)
        np.testing.assert_array_equal(part, [1, 2, 3, 4])


async def test_view_bounds_and_types() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        base = d.alloc(256)
        base.view(0, 256)
        base.view(255, 1)
        for offset, nbytes in ((0, 257), (1, 256), (256, 1), (200, 100)):
            with pytest.raises(InvalidCommand, match="within the buffer's 256 bytes"):
                base.view(offset, nbytes)
        with pytest.raises(InvalidCommand, match="offset"):
            base.view(-1, 8)
        with pytest.raises(InvalidCommand, match="nbytes"):
            base.view(0, 0)
        v = base.view(128, 64)
        with pytest.raises(InvalidCommand, match="64 bytes"):
            v.view(32, 33)  # checked against the view, not the base
        with pytest.raises(InvalidCommand):
            base.view(0, 10, dtype="float32")  # not a whole number of elements
        with pytest.raises(InvalidCommand):
            base.view(0, 16, dtype="float32", shape=(5,))
        with pytest.raises(TypeError):
            base.view("0", 8)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            base.view(0, 8.0)  # type: ignore[arg-type]


# -- transfer ------------------------------------------------------------------------------


@visibility
@pytest.mark.parametrize("nbytes", [100, 5 * MIB + 3])
async def test_transfer_across_devices(host_visible: bool, nbytes: int) -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=5, host_visible=host_visible) as (
        d0,
        d1,
    ):
        x = _data(nbytes, seed=3)
        src, dest = d0.alloc(nbytes), d1.alloc(nbytes)
        src.copyin(x)
        r0 = d0.statistics().timeline_reserved
        r1 = d1.statistics().timeline_reserved
        fence = hcqa.transfer(dest, src)
        # one step on each timeline
        assert d0.statistics().timeline_reserved == r0 + 1
        assert d1.statistics().timeline_reserved == r1 + 1
        assert fence.signal is d1.timeline
        with trio.fail_after(5):
            await d0.synchronize()  # the transfer is on d0's timeline too
            await d1.synchronize()
        assert fence.reached
        got = np.zeros(nbytes, np.uint8)
        await dest.copyout(got)
        np.testing.assert_array_equal(got, x)


@visibility
async def test_transfer_waits_for_writer_and_blocks_next_writer(host_visible: bool) -> None:
    """A slow kernel on d0 writes src; transfer to d1 must wait for it; a copyin into
    src queued right after must wait for the transfer to have read it."""
    import time

    def fill(out: npt.NDArray[Any], value: int) -> None:
        time.sleep(0.02)
        out[:] = value

    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=5, host_visible=host_visible) as (
        d0,
        d1,
    ):
        prog = d0.program("fill", fill)
        src = d0.alloc(shape=(256,), dtype="int32")
        dest = d1.alloc(shape=(256,), dtype="int32")
        src.copyin(np.zeros(256, np.int32))
        prog(src, vals=(5,))
        hcqa.transfer(dest, src)
        src.copyin(np.full(256, 9, np.int32))
        got = np.zeros(256, np.int32)
        with trio.fail_after(5):
            await dest.copyout(got)
            np.testing.assert_array_equal(got, 5)
            await src.copyout(got)
            np.testing.assert_array_equal(got, 9)


@visibility
async def test_transfer_within_one_device_and_views(host_visible: bool) -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=host_visible) as d:
        a, b = d.alloc(4096), d.alloc(4096)
        x = _data(4096, seed=9)
        a.copyin(x)
        b.copyin(bytes(4096))
        fence = hcqa.transfer(b, a)
        assert fence.signal is d.timeline
        hcqa.transfer(b.view(0, 1000), a.view(3000, 1000))
        got = np.zeros(4096, np.uint8)
        await b.copyout(got)
        np.testing.assert_array_equal(got[:1000], x[3000:4000])
        np.testing.assert_array_equal(got[1000:], x[1000:])


async def test_transfer_errors() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=5) as (d0, d1):
        a, b = d0.alloc(64), d1.alloc(65)
        with pytest.raises(InvalidCommand, match="equal sizes"):
            hcqa.transfer(b, a)
        with pytest.raises(InvalidCommand, match="equal sizes"):
            hcqa.transfer(a.view(0, 8), a.view(8, 16))
        with pytest.raises(TypeError):
            hcqa.transfer(np.zeros(64, np.uint8), a)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            hcqa.transfer(a, bytes(64))  # type: ignore[arg-type]
        assert d0.statistics().timeline_reserved == 0
        assert d1.statistics().timeline_reserved == 0


# -- alloc, free, out of memory ------------------------------------------------------------


async def test_alloc_forms() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        raw = d.alloc(10)
        assert (raw.nbytes, raw.dtype, raw.shape) == (10, None, None)
        t = d.alloc(shape=(3, 4), dtype="float64")
        assert (t.nbytes, t.dtype, t.shape) == (96, np.dtype("float64"), (3, 4))
        one = d.alloc(shape=5, dtype="int16")
        assert (one.nbytes, one.shape) == (10, (5,))
        both = d.alloc(16, shape=(4,), dtype="float32")
        assert both.shape == (4,)
        flat = d.alloc(16, dtype="float32")
        assert flat.shape == (4,)


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ((), {}, InvalidCommand),  # no size
        ((), {"shape": (4,)}, InvalidCommand),  # shape without dtype
        ((), {"dtype": "float32"}, InvalidCommand),  # dtype without shape or size
        ((), {"shape": (0,), "dtype": "f4"}, InvalidCommand),
        ((), {"shape": (2, -1), "dtype": "f4"}, InvalidCommand),
        ((), {"shape": (2.0,), "dtype": "f4"}, InvalidCommand),
        ((), {"shape": ["4"], "dtype": "f4"}, InvalidCommand),
        ((), {"shape": "4", "dtype": "f4"}, InvalidCommand),
        ((), {"shape": (True, 2), "dtype": "f4"}, InvalidCommand),
        ((), {"shape": np.zeros((2, 2), np.int64), "dtype": "f4"}, InvalidCommand),
        ((), {"shape": True, "dtype": "f4"}, InvalidCommand),
        ((), {"shape": (4,), "dtype": "object"}, InvalidCommand),
        ((), {"shape": (4,), "dtype": "no-such-dtype"}, TypeError),
        ((0,), {}, InvalidCommand),
        ((-8,), {}, InvalidCommand),
        ((10,), {"dtype": "float32"}, InvalidCommand),  # not a multiple of 4
        ((12,), {"shape": (4,), "dtype": "float32"}, InvalidCommand),  # 12 != 16
        (("8",), {}, TypeError),
        ((8.0,), {}, TypeError),
    ],
)
async def test_alloc_errors(args: tuple[Any, ...], kwargs: dict[str, Any], error: type) -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        before = d.statistics().memory
        with pytest.raises(error):
            d.alloc(*args, **kwargs)
        assert d.statistics().memory == before


async def test_out_of_memory() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, memory=1 << 20) as d:
        with pytest.raises(OutOfMemory, match="out of memory") as info:
            d.alloc(2 * MIB)
        assert isinstance(info.value, MemoryError)
        assert d.statistics().memory.used == 0
        half = d.alloc(MIB // 2)
        with pytest.raises(OutOfMemory):
            d.alloc(MIB // 2 + 4096)
        half.free()
        d.alloc(MIB)  # fits once the half is freed


@visibility
async def test_free_then_use(host_visible: bool) -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=host_visible) as d:
        prog = d.program("touch", lambda out: None)
        buf = d.alloc(shape=(16,), dtype="float32")
        other = d.alloc(shape=(16,), dtype="float32")
        view = buf.view(0, 16)
        with pytest.raises(InvalidCommand, match="owning buffer"):
            view.free()
        used = d.statistics().memory.used
        buf.free()
        assert d.statistics().memory.used < used
        buf.free()  # idempotent
        before = d.statistics()
        for use in (
            lambda: buf.copyin(np.zeros(16, np.float32)),
            lambda: buf.copyout(np.zeros(16, np.float32)),
            lambda: view.copyin(bytes(16)),
            lambda: prog(buf),
            lambda: hcqa.transfer(other, buf),
            lambda: hcqa.transfer(buf, other),
            lambda: d.copy_queue().copy(other, buf, 16),
        ):
            with pytest.raises(InvalidCommand, match="freed"):
                use()
        assert d.statistics() == before


async def test_free_while_work_pending() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        prog = d.program("touch", lambda out: None)
        buf = d.alloc(64)
        gate = hcqa.Signal()
        fence = d.compute_queue().wait(gate, 1).exec(prog, (buf,)).submit()
        with pytest.raises(InvalidCommand, match="still used"):
            buf.free()
        reader = d.alloc(64)
        d.compute_queue().wait(gate, 1).exec(prog, (reader,)).submit()
        hcqa.transfer(buf, reader)  # a pending read of reader, on the copy queue
        with pytest.raises(InvalidCommand, match="still used"):
            reader.free()
        gate.value = 1
        with trio.fail_after(5):
            await fence
            await d.synchronize()
        buf.free()
        reader.free()


async def test_numpy_view_after_free_refused() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        buf = d.alloc(4096)
        buf.free()
        reuser = d.alloc(4096)
        await reuser.copyin(bytes([1]) * 4096)
        with pytest.raises(InvalidCommand, match="freed"):
            alias = buf.numpy_view()
            assert alias[0] == 1  # it aliases the new buffer
            alias[0] = 2


async def test_numpy_view_after_close_raises_device_closed() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        cached = d.alloc(64)
        cached.numpy_view()
        uncached = d.alloc(64)
    with pytest.raises(DeviceClosed):
        uncached.numpy_view()
    with pytest.raises(DeviceClosed):
        cached.numpy_view()


async def test_use_after_close_raises_device_closed(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(64))
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        buf = d.alloc(64)
        other = d.alloc(64)
    for use in (
        lambda: buf.copyin(bytes(64)),
        lambda: buf.copyout(bytearray(64)),
        lambda: buf.load(path),
        lambda: hcqa.transfer(other, buf),
        lambda: d.alloc(64),
    ):
        with pytest.raises(DeviceClosed):
            use()
    buf.free()  # after close: nothing to give back, and no error


async def test_resubmitted_queue_refuses_freed_buffer() -> None:
    def ones(out: npt.NDArray[Any]) -> None:
        out[:] = 1

    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        prog = d.program("ones", ones)
        buf = d.alloc(4096)
        q = d.compute_queue().exec(prog, (buf,))
        await q.submit()
        buf.free()
        reuser = d.alloc(4096)  # gets the freed block back from the cache
        await reuser.copyin(bytes(4096))
        try:
            with pytest.raises(InvalidCommand, match="freed"):
                q.submit()
        finally:
            await d.synchronize()
            got = bytearray(4096)
            await reuser.copyout(got)
            assert got == bytes(4096)  # the reused memory was not written


# -- a transfer spans two devices: closing or faulting one must not break the other ------


async def test_closing_transfer_source_device_waits_for_the_transfer() -> None:
    import gc

    gate = hcqa.Signal()
    state = ["open"]

    async def open_gate_when_stuck() -> None:
        # let the transfer run once d1's close is over (and the test waits on the fence), or,
        # once fixed, when d1's close has waited on the transfer for a good while
        # (the run is never quiet for long while a task owns a signal's eventfd -- the
        # signal re-reader ticks every <= 64 ms -- so a stretch of 0.25 s after quiescence)
        for _ in range(4):
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.25)
            if state[0] == "closed":
                break
        gate.value = 1

    gc.disable()  # no collection may hand other signal slots back meanwhile
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                async with hcqa.open_device("cpu:0", hang_limit=5) as d0:
                    dest = d0.alloc(4096)
                    async with hcqa.open_device("cpu:1", hang_limit=5) as d1:
                        src = d1.alloc(4096)
                        keep = src.numpy_view()  # keeps src mapped: the copy cannot crash here
                        await src.copyin(np.full(4096, 7, np.uint8))
                        d0.copy_queue().wait(gate, 1).submit()  # hold d0's copy queue
                        fence = hcqa.transfer(dest, src)
                        await trio.testing.wait_all_tasks_blocked()
                        nursery.start_soon(open_gate_when_stuck)
                    state[0] = "closed"
                    # new signals, until one takes the slot of d1's timeline signal (if it
                    # was given back)
                    slot = d1.timeline.address
                    fresh = [hcqa.Signal()]
                    while fresh[-1].address != slot and len(fresh) < 300:
                        fresh.append(hcqa.Signal())
                    await fence
                    # the copy queue is FIFO: once this copyout is done, so is all of the
                    # transfer's batch, its step on d1's timeline included
                    out = np.zeros(4096, np.uint8)
                    await dest.copyout(out)
                    await d0.synchronize()
                    del keep
                    assert (out == 7).all()
                    # no unrelated signal was written
                    assert [s.value for s in fresh] == [0] * len(fresh)
    finally:
        gc.enable()


_SEGFAULT_SCRIPT = """
import numpy as np, trio, trio.testing, hcqa

async def main():
    gate = hcqa.Signal()
    state = ["open"]
    async with trio.open_nursery() as nursery, hcqa.open_device("cpu:0", hang_limit=5) as d0:
        dest = d0.alloc(1 << 22)
        async with hcqa.open_device("cpu:1", hang_limit=5) as d1:
            src = d1.alloc(1 << 22)
            await src.copyin(np.full(1 << 22, 7, np.uint8))
            d0.copy_queue().wait(gate, 1).submit()
            fence = hcqa.transfer(dest, src)
            await trio.testing.wait_all_tasks_blocked()
            async def open_gate_when_stuck():
                for _ in range(4):
                    await trio.testing.wait_all_tasks_blocked()
                    await trio.sleep(0.25)
                    if state[0] == "closed":
                        break
                gate.value = 1
            nursery.start_soon(open_gate_when_stuck)
        state[0] = "closed"
        await fence
        out = np.zeros(1 << 22, np.uint8)
        await dest.copyout(out)
        print("survived", bool((out == 7).all()))

trio.run(main)
"""


async def test_closing_transfer_source_device_does_not_crash_the_process() -> None:
    import sys

    with trio.fail_after(60):
        proc = await trio.run_process(
            [sys.executable, "-c", _SEGFAULT_SCRIPT], capture_stdout=True, check=False
        )
    assert proc.returncode == 0
    assert proc.stdout.split() == [b"survived", b"True"]


async def test_fault_on_transfer_destination_leaves_the_source_healthy() -> None:
    import time

    def boom(out: npt.NDArray[Any]) -> None:
        time.sleep(0.02)
        raise ValueError("dest kernel failed")

    with trio.fail_after(10):
        async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=1) as (d0, d1):
            src, dest = d0.alloc(64), d1.alloc(64)
            d1.program("boom", boom)(dest)
            fence = hcqa.transfer(dest, src)  # waits for boom's write of dest
            with pytest.raises(hcqa.DeviceFault) as on_dest:
                await fence
            assert isinstance(on_dest.value.__cause__, ValueError)
            # The source only lent its memory to the failed copy: its timeline moves on
            # at once (no hang limit) and it stays healthy.
            with trio.fail_after(0.5):
                await d0.synchronize()
            assert d0.faulted is None


async def test_a_shape_is_an_int_or_any_sequence_of_ints() -> None:
    """alloc, view and import_buffer take the same shapes: an int, a tuple, a list, numpy
    integers or a 1-d integer array -- the buffer's shape is a tuple of ints."""
    async with hcqa.open_device("cpu:0") as d:
        for shape, want in (
            (256, (256,)),
            ((16, 16), (16, 16)),
            ([16, 16], (16, 16)),
            (np.int64(8), (8,)),
            ([np.int32(4), 2], (4, 2)),
            (np.array([2, 3]), (2, 3)),
        ):
            buf = d.alloc(shape=shape, dtype="float32")
            assert buf.shape == want and all(type(x) is int for x in buf.shape)
            assert buf.nbytes == 4 * int(np.prod(want))
            view = buf.view(0, buf.nbytes, dtype="float32", shape=shape)
            assert view.shape == want
        raw = d.alloc(64, shared=True)
        fd, _ = raw.export()
        imported = d.import_buffer(os.dup(fd), 64, dtype="float32", shape=[4, 4])
        assert imported.shape == (4, 4)


async def test_a_freed_buffer_makes_no_view() -> None:
    async with hcqa.open_device("cpu:0") as d:
        buf = d.alloc(64)
        view = buf.view(0, 8)
        buf.free()
        for b in (buf, view):
            with pytest.raises(InvalidCommand, match="was freed"):
                b.view(0, 4)
        kept = d.alloc(64)
    with pytest.raises(hcqa.DeviceClosed):
        kept.view(0, 4)


async def test_transfer_refuses_the_mismatches_copyin_refuses() -> None:
    """One rule for both: where both ends carry a dtype they must have the same dtype and
    shape (bytes are never converted); a raw buffer or bytes matches any of its size."""
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        f32 = d0.alloc(shape=(4,), dtype="float32")
        await f32.copyin(np.array([1.5, -2.0, 3.25, 0.0], np.float32))
        i32, square = d1.alloc(shape=(4,), dtype="int32"), d1.alloc(shape=(2, 2), dtype="float32")
        reserved = d1.statistics().timeline_reserved
        with pytest.raises(InvalidCommand, match="dtype must be int32") as copyin:
            i32.copyin(np.zeros(4, np.float32))
        with pytest.raises(InvalidCommand, match="src dtype must be int32, dest's") as moved:
            hcqa.transfer(i32, f32)
        assert "(got float32)" in str(copyin.value) and "(got float32)" in str(moved.value)
        with pytest.raises(InvalidCommand, match=r"shape must be \(2, 2\)"):
            square.copyin(np.zeros(4, np.float32))
        with pytest.raises(InvalidCommand, match=r"src shape must be \(2, 2\), dest's"):
            hcqa.transfer(square, f32)
        assert d1.statistics().timeline_reserved == reserved  # nothing was queued
        raw = d1.alloc(16)  # bytes: any end of its size, both ways
        await hcqa.transfer(raw, f32)
        await hcqa.transfer(f32, raw)
        await raw.copyin(np.zeros(4, np.int32))
        await hcqa.transfer(i32, f32.view(0, 16, dtype="int32"))  # reinterpreting on purpose
        out = np.empty(4, np.int32)
        await i32.copyout(out)
        assert out.tolist() == np.array([1.5, -2.0, 3.25, 0.0], np.float32).view(np.int32).tolist()
        await hcqa.transfer(square, f32.view(0, 16, dtype="float32", shape=[2, 2]))


@pytest.mark.parametrize("fast", [True, False])
def test_array_address_is_numpys_data_pointer(
    fast: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The copy path reads an array's data pointer straight from the array object; it
    must be numpy's own answer for every kind of array a copy may be given (and the public
    way is taken where that read was found not to hold)."""
    from hcqa.devices import hostarrays as buffer

    assert buffer._DATA_AT is not None  # CPython and numpy as hcqa supports them
    if not fast:
        monkeypatch.setattr(buffer, "_DATA_AT", None)
    base = np.arange(64, dtype=np.float32)
    path = tmp_path / "m.bin"
    path.write_bytes(bytes(range(64)))
    arrays = [
        base,
        base[5:],  # a view, inside another array
        base.reshape(8, 8)[2],
        np.frombuffer(b"0123456789", np.uint8)[3:],  # read-only, over a bytes object
        np.frombuffer(bytearray(32), np.int64),
        np.memmap(path, dtype=np.uint8, mode="r"),  # a subclass: the public way
        np.ascontiguousarray(base[::2]),
    ]
    for a in arrays:
        assert buffer.array_address(a) == a.__array_interface__["data"][0], repr(a)


async def test_staged_copy_longer_than_the_ring_cycles_a_cache_sized_ring() -> None:
    """A staged copy of 24 MiB goes through the default ring, which stays a few MiB (kept in
    the caches: see memory.StagingRing) and wraps, and every byte arrives both ways."""
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=False) as d:
        ring = d.staging  # type: ignore[attr-defined]
        src = np.random.default_rng(3).integers(0, 255, 24 << 20, dtype=np.uint8)
        buf = d.alloc(src.nbytes)
        await buf.copyin(src)
        out = np.zeros_like(src)
        await buf.copyout(out)
        np.testing.assert_array_equal(out, src)
        stats = ring.statistics()
        assert stats.allocated * stats.chunk_size <= 8 << 20
        assert stats.uses == 2 * (24 << 20) // stats.chunk_size
        assert stats.wraps >= 2


async def test_staged_copies_reuse_chunks_only_once_drained(
    thread_names: Callable[[], set[str]],
) -> None:
    """A copy longer than the ring: each chunk is filled again only after its drain (the
    device side's thread) copied it on; the thread is joined when the device closes."""
    from hcqa.devices.memory import StagingRing

    before = thread_names()
    async with hcqa.open_device("cpu:0", hang_limit=5, host_visible=False) as d:
        d.staging.close()
        d.staging = StagingRing(chunks=2, chunk_size=4096, name="test ring")  # type: ignore[attr-defined]
        src = (np.arange(1 << 18, dtype=np.uint32) * 2654435761).astype(np.uint32)
        buf = d.alloc(shape=src.shape, dtype="uint32")
        for _ in range(3):
            await buf.copyin(src)
            out = np.zeros_like(src)
            await buf.copyout(out)
            np.testing.assert_array_equal(out, src)
            src = src[::-1].copy()
        assert any("drain" in name for name in thread_names() - before)
    assert not any("drain" in name for name in thread_names() - before)
