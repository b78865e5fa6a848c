"""The ``cuda:N`` device. Without a GPU (no cuda-bindings, or cuInit failing) only the first
part runs: parameter parsing, the refusals, ``hcqa info``. On an NVIDIA GPU the rest runs:
memory, programs, every queue verb, transfers with cpu devices and between two hcqa devices
on one GPU, waits that hold a queue without holding the loop, faults (a refused launch, a
kernel that faults on the GPU), timing, graphs, pipelines, tracing, closing. Results are
checked against numpy."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import hcqa
from hcqa.devices.cuda import driver as drv
from hcqa.devices.cuda.program import parse_params

# -- without a GPU ---------------------------------------------------------------------------


def test_parameters_are_read_from_the_entrys_declaration() -> None:
    src = """
    // a comment naming __global__ void k(float x)
    extern "C" __global__ void __launch_bounds__(256) k(float *__restrict__ y,
        const float * x, unsigned long long n, int8_t m, size_t s) { }
    __global__ void other(int a) {}
    """
    assert parse_params(src, "k") == [
        ("y", None), ("x", None), ("n", np.uint64), ("m", np.int8), ("s", np.uint64)
    ]  # fmt: skip
    assert parse_params(src, "other") == [("a", np.int32)]
    assert parse_params("__global__ void z() {}", "z") == []
    assert parse_params("__global__ void z(void) {}", "z") == []


@pytest.mark.parametrize(
    ("src", "match"),
    [
        ("__global__ void k(float a) {}", "must be a pointer or an integer"),
        ("__global__ void k(int n, float *y) {}", "buffers must come first"),
        ("__global__ void j(int *y) {}", "must name a '__global__ void k"),
        ("__global__ void k(int *y) {}\n__global__ void k(int *y) {}", "declared once"),
        ("__global__ void k(int) {}", "must be named"),
    ],
)
def test_parameter_refusals(src: str, match: str) -> None:
    with pytest.raises(hcqa.InvalidCommand, match=match):
        parse_params(src, "k")


def test_specs_parse_as_a_registered_kind() -> None:
    from hcqa.devices import backends

    assert backends.parse_spec(" cuda:3 ") == ("cuda", 3, "cuda:3")
    assert backends.shared("cuda")


def _gpu() -> str | None:
    """Why the GPU tests are skipped here (None: they run)."""
    try:
        drv.init()
    except hcqa.InvalidCommand as exc:
        return str(exc)
    return None if drv.list_devices() else "the driver answered, but no CUDA device is here"


async def test_opening_without_a_driver_is_refused() -> None:
    if _gpu() is None:
        pytest.skip("a CUDA device is here")
    with pytest.raises(hcqa.InvalidCommand, match=r"CUDA (driver|backend)"):
        async with hcqa.open_device("cuda:0"):
            pass


async def test_opening_without_the_bindings_says_how_to_get_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # an import of it fails
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    with pytest.raises(hcqa.InvalidCommand, match=r"cuda-bindings: pip install -e '\.\[cuda\]'"):
        drv.bindings()


def test_info_says_whether_there_is_a_cuda_device() -> None:
    from hcqa.cli._cuda import cuda_rows

    rows = dict(cuda_rows())
    if _gpu() is None:
        assert "cuda:0" in rows and "compute capability" in rows["cuda:0"]
    else:
        assert list(rows) == ["cuda"]
        assert "no CUDA device" in rows["cuda"] or "not installed" in rows["cuda"]


# -- on a GPU --------------------------------------------------------------------------------

REAL = _gpu() is None
real_only = pytest.mark.skipif(not REAL, reason="needs a CUDA device")


@pytest.fixture
def cuda_driver(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The real driver on a GPU; elsewhere the stand-in of ``_fake_cuda.py``, so the backend's
    own logic (segments, host functions, the pump, copies, faults, closing) runs here too."""
    if REAL:
        yield None
        return
    from _fake_cuda import FakeDriver, FakeNvrtc

    fake, nvrtc = FakeDriver(), FakeNvrtc()
    monkeypatch.setattr(drv, "bindings", lambda: (fake, nvrtc))
    monkeypatch.setattr(drv, "_initialised", False)
    # restored with _initialised: else the stand-in's clean cuInit outlives it, and a later
    # open on this machine skips the real cuInit's refusal and meets the missing driver raw
    monkeypatch.setattr(drv, "_init_error", drv._init_error)
    monkeypatch.setattr(drv, "_contexts", {})
    monkeypatch.setattr(drv, "_local", threading.local())
    monkeypatch.setattr(drv, "_native", drv._Native(launch=fake.launch_host_func))
    yield fake
    for stream in list(fake.streams.values()):  # a device left open by a failed test
        fake.cuStreamDestroy(stream)


gpu = pytest.mark.usefixtures("cuda_driver")

SOURCE = r"""
extern "C" __global__ void saxpy(float *y, const float *x, int n, int a) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void geometry(int *out) {
    if (blockIdx.x + blockIdx.y + blockIdx.z + threadIdx.x + threadIdx.y + threadIdx.z == 0) {
        out[0] = gridDim.x; out[1] = gridDim.y; out[2] = gridDim.z;
        out[3] = blockDim.x; out[4] = blockDim.y; out[5] = blockDim.z;
    }
}
extern "C" __global__ void scale(float *out, const float *a, int n, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * k;
}
extern "C" __global__ void inc(int *y) { y[blockIdx.x * blockDim.x + threadIdx.x] += 1; }
extern "C" __global__ void wide(long long *y, long long v, unsigned char u) { y[0] = v; y[1] = u; }
extern "C" __global__ void spin(float *x, int n) {
    float a = x[0];
    for (int i = 0; i < n; i++) a = a * 0.9999999f + 1e-7f;
    x[0] = a;
}
"""


async def _read(buf: hcqa.Buffer) -> np.ndarray[Any, Any]:
    assert buf.dtype is not None and buf.shape is not None
    out = np.empty(buf.shape, buf.dtype)
    await buf.copyout(out)
    return out


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@gpu
async def test_open_names_and_memory_rules() -> None:
    async with hcqa.open_devices("cuda:0", "cuda:0") as (g0, g1):
        assert (g0.name, g1.name) == ("cuda:0", "cuda:0#2")
        assert g0.cu_context == g1.cu_context  # type: ignore[attr-defined]
        x = g0.alloc(shape=(8,), dtype="float32")
        with pytest.raises(hcqa.InvalidCommand, match="not host-visible"):
            x.numpy_view()
        with pytest.raises(hcqa.InvalidCommand, match="shared"):
            g0.alloc(64, shared=True)
        assert drv.native().c_host_functions  # the C host functions, not the ctypes fallback
    with pytest.raises(hcqa.InvalidCommand, match="does not exist"):
        async with hcqa.open_devices("cuda:999"):
            pass


@gpu
async def test_copies_and_saxpy_against_numpy() -> None:
    n = 1024
    a = np.arange(n, dtype=np.float32)
    async with hcqa.open_device("cuda:0") as g:
        x = g.alloc(shape=(n,), dtype="float32")
        y = g.alloc(shape=(n,), dtype="float32")
        await x.copyin(a)
        await y.copyin(np.ones(n, np.float32))
        k = g.program("saxpy", SOURCE)
        await k(y, x, vals=(n, 3), global_size=(n // 64, 1, 1), local_size=(64, 1, 1))
        np.testing.assert_array_equal(await _read(y), 3 * a + 1)
        part = np.empty(16, np.float32)
        await y.view(64, 64, dtype="float32").copyout(part)
        np.testing.assert_array_equal(part, 3 * a[16:32] + 1)
        raw = g.alloc(8 * 2)
        w = g.program("wide", SOURCE)
        await w(raw, vals=(-(2**40), 255))
        back = bytearray(16)
        await raw.copyout(back)
        assert np.frombuffer(back, np.int64).tolist() == [-(2**40), 255]
        with pytest.raises(hcqa.InvalidCommand, match=r"must be in \[0, 255\]"):
            w(raw, vals=(1, 256))


@gpu
async def test_completions_nobody_waits_for_write_no_queue_eventfd() -> None:
    """The host function writes a queue signal's eventfd only for a listed waiter (its wake
    word, ``hcqa_signal_complete``), as the OpenCL callback does; a waiter is still woken."""

    def writes(sig: Any) -> int:
        try:
            return os.eventfd_read(sig.fd)
        except BlockingIOError:
            return 0

    async with hcqa.open_device("cuda:0") as g:
        y = g.alloc(shape=(64,), dtype="int32")
        k = g.program("inc", SOURCE)
        compute, copy = g._queues["compute"].signal, g._queues["copy"].signal
        await y.copyin(np.zeros(64, np.int32))
        writes(compute), writes(copy)
        for _ in range(5):
            await k(y, global_size=(1, 1, 1), local_size=(64, 1, 1))
            await y.copyin(np.zeros(64, np.int32))
        assert (writes(compute), writes(copy)) == (0, 0)
        compute._rereads = False  # only the eventfd wakes the wait below
        target = compute.value + 1
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(compute.wait, target)
                await trio.testing.wait_all_tasks_blocked()
                fence = k(y, global_size=(1, 1, 1), local_size=(64, 1, 1))
            await fence
        assert compute.value >= target


@gpu
async def test_large_copies_go_through_the_staging_buffer_in_chunks() -> None:
    from hcqa.devices.cuda.executor import STAGING

    n = (2 * STAGING + 12345) // 4
    a = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    async with hcqa.open_device("cuda:0") as g:
        x = g.alloc(shape=(n,), dtype="float32")
        await x.copyin(a)
        np.testing.assert_array_equal(await _read(x), a)


@gpu
async def test_launches_in_one_submit_each_get_their_own_arguments() -> None:
    n = 64
    async with hcqa.open_device("cuda:0") as g:
        a = g.alloc(shape=(n,), dtype="float32")
        b = g.alloc(shape=(n,), dtype="float32")
        big = g.alloc(shape=(2 * n,), dtype="float32")
        x = g.alloc(shape=(n,), dtype="float32")
        for buf in (a, b, big):
            await buf.copyin(np.zeros(buf.shape, np.float32))
        await x.copyin(np.ones(n, np.float32))
        k = g.program("saxpy", SOURCE)
        tail = big.view(n * 4, n * 4, dtype="float32")
        q = g.compute_queue()
        geo = {"global_size": (n // 16, 1, 1), "local_size": (16, 1, 1)}
        for y, m in ((a, 1), (a, 1), (b, 2), (a, 3), (tail, 5), (tail, 5), (b, 7)):
            q.exec(k, (y, x), vals=(n, m), **geo)
        await q.submit()
        await q.submit()  # again: the launch records are reused
        np.testing.assert_array_equal(await _read(a), np.full(n, 10, np.float32))
        np.testing.assert_array_equal(await _read(b), np.full(n, 18, np.float32))
        whole = await _read(big)
        np.testing.assert_array_equal(whole[n:], np.full(n, 20, np.float32))
        np.testing.assert_array_equal(whole[:n], np.zeros(n, np.float32))


@gpu
async def test_geometry_counts_blocks() -> None:
    async with hcqa.open_device("cuda:0") as g:
        out = g.alloc(shape=(6,), dtype="int32")
        await g.program("geometry", SOURCE)(out, global_size=(3, 2, 1), local_size=(4, 5, 2))
        assert (await _read(out)).tolist() == [3, 2, 1, 4, 5, 2]


@gpu
async def test_program_refusals_and_build_log() -> None:
    async with hcqa.open_device("cuda:0") as g:
        with pytest.raises(hcqa.InvalidCommand, match="CUDA build of 'bad' failed") as info:
            g.program("bad", "__global__ void bad(int *y) { y[0] = undefined_name; }")
        assert "undefined_name" in str(info.value)
        with pytest.raises(hcqa.InvalidCommand, match="not a Python callable"):
            g.program("f", lambda y: None)
        k = g.program("saxpy", SOURCE)
        y = g.alloc(shape=(4,), dtype="float32")
        with pytest.raises(hcqa.InvalidCommand, match="takes 2 buffers and 2 vals"):
            k(y, vals=(1, 2))


@gpu
async def test_queue_verbs_waits_and_timestamps() -> None:
    async with hcqa.open_device("cuda:0") as g:
        y = g.alloc(shape=(4,), dtype="int32")
        z = g.alloc(shape=(4,), dtype="int32")
        await y.copyin(np.zeros(4, np.int32))
        k = g.program("inc", SOURCE)
        gate, done, t0, t1 = hcqa.Signal(), hcqa.Signal(), hcqa.Signal(), hcqa.Signal()
        q = g.compute_queue()
        q.wait(gate, 1).timestamp(t0).exec(k, (y,), local_size=(4, 1, 1))
        q.memory_barrier().exec(k, (y,), local_size=(4, 1, 1)).timestamp(t1).signal(done, 7)
        q.submit()
        await trio.sleep(0.05)
        assert done.value == 0 and t0._stamp.value == 0
        gate.value = 1
        with trio.fail_after(10):
            await done.wait(7)
        assert t1._stamp.value > t0._stamp.value > 0
        g.copy_queue().copy(z, y, 16).signal(done, 8).submit()
        with trio.fail_after(10):
            await done.wait(8)
        assert (await _read(z)).tolist() == [2, 2, 2, 2]


async def _tick_for_a_second() -> tuple[float, list[float]]:
    """CPU seconds used while a task ticks at 100 Hz for 1 s, and each tick's lateness."""
    cpu0 = _cpu_seconds()
    lags: list[float] = []
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        t = time.monotonic()
        await trio.sleep(0.01)
        lags.append(time.monotonic() - t - 0.01)
    return _cpu_seconds() - cpu0, lags


@gpu
async def test_waits_hold_the_queue_not_the_loop() -> None:
    async with hcqa.open_devices("cuda:0", "cpu:0") as (g, c):
        y = g.alloc(shape=(4,), dtype="int32")
        await y.copyin(np.zeros(4, np.int32))
        k = g.program("inc", SOURCE)
        await k(y, local_size=(4, 1, 1))
        floor, _ = await _tick_for_a_second()  # the 100 Hz ticker alone: this host's floor
        s = hcqa.Signal()
        fence = g.compute_queue().wait(s, 1).exec(k, (y,), local_size=(4, 1, 1)).submit()
        used, lags = await _tick_for_a_second()
        assert not fence.reached
        assert max(lags) < 0.25, lags
        # the wait itself (the ticker's own wake-ups are the floor, measured just before)
        assert used - floor < 0.01, f"{used:.3f} s of CPU in 1 s of waiting, {floor:.3f} ticking"
        c.compute_queue().signal(s, 1).submit()
        with trio.fail_after(10):
            await fence
        assert (await _read(y)).tolist() == [2, 2, 2, 2]


@gpu
async def test_awaiting_a_long_kernel_costs_no_cpu() -> None:
    """The loop sleeps on the eventfd while the GPU works: no spinning synchronize."""
    async with hcqa.open_device("cuda:0") as g:
        x = g.alloc(shape=(1,), dtype="float32")
        await x.copyin(np.ones(1, np.float32))
        spin = g.program("spin", SOURCE)
        await spin(x, vals=(1000,))
        t0, cpu0 = time.monotonic(), _cpu_seconds()
        await spin(x, vals=(20_000_000,))  # one thread, tens of ms or more
        wall, used = time.monotonic() - t0, _cpu_seconds() - cpu0
        assert wall > 0.02, wall
        assert used < 0.2 * wall + 0.005, f"{used:.4f} s of CPU while awaiting {wall:.3f} s"


@gpu
async def test_transfers_between_all_kinds_of_pairs(tmp_path: Path) -> None:
    n = 4096
    a = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 128 + a.tobytes())
    async with hcqa.open_devices("cuda:0", "cuda:0", "cpu:0") as (g0, g1, c0):
        x0 = g0.alloc(shape=(n,), dtype="float32")
        await x0.load(path, offset=128)
        x1 = g1.alloc(shape=(n,), dtype="float32")
        await hcqa.transfer(x1, x0)
        xc = c0.alloc(shape=(n,), dtype="float32")
        await hcqa.transfer(xc, x1)
        np.testing.assert_array_equal(xc.numpy_view(), a)
        xc.numpy_view()[:] *= 2
        await hcqa.transfer(x0, xc)
        np.testing.assert_array_equal(await _read(x0), 2 * a)
        np.testing.assert_array_equal(await _read(x1), a)


@gpu
async def test_a_transfer_between_two_cuda_devices_completes_in_the_host_function() -> None:
    n = 1 << 16
    a = np.arange(n, dtype=np.float32)
    async with hcqa.open_device("cuda:0") as g1:
        y1 = g1.alloc(shape=(n,), dtype="float32")
        async with hcqa.open_device("cuda:0") as g0:
            x0 = g0.alloc(shape=(n,), dtype="float32")
            await x0.copyin(a)
            tl = g0._timeline
            for _ in range(3):
                await hcqa.transfer(y1, x0)
            with trio.fail_after(5):
                await tl.foreign_done.wait(tl.foreign_reserved)
        np.testing.assert_array_equal(await _read(y1), a)


@gpu
async def test_timing_and_timestamps_on_the_host_clock() -> None:
    async with hcqa.open_device("cuda:0") as g:
        n = 1 << 16
        x = g.alloc(shape=(n,), dtype="float32")
        y = g.alloc(shape=(n,), dtype="float32")
        await x.copyin(np.ones(n, np.float32))
        await y.copyin(np.ones(n, np.float32))
        k = g.program("saxpy", SOURCE)
        geo = {"global_size": (n // 64, 1, 1), "local_size": (64, 1, 1)}
        secs = await k.timed(y, x, vals=(n, 2), **geo)
        assert 0 < secs < 1
        before = time.monotonic_ns()
        async with g.timed() as span:
            k(y, x, vals=(n, 2), **geo)
        after = time.monotonic_ns()
        assert span.seconds is not None and 0 < span.seconds < 1
        assert span.start_us is not None and span.end_us is not None
        assert before / 1000 - 50 <= span.start_us <= span.end_us <= after / 1000 + 50
        s = hcqa.Signal()
        t0 = time.monotonic_ns() / 1000
        await g.compute_queue().timestamp(s).submit()
        t1 = time.monotonic_ns() / 1000
        assert t0 - 50 <= s.timestamp <= t1 + 50


@gpu
async def test_overlapping_copies_within_one_buffer() -> None:
    async with hcqa.open_device("cuda:0") as g:
        buf = g.alloc(shape=(64,), dtype="int32")
        a = np.arange(64, dtype=np.int32)
        await buf.copyin(a)
        whole = buf.view(0, 256)
        await g.copy_queue().copy(whole, whole, 256).submit()
        await g.copy_queue().copy(buf.view(16, 128), buf.view(0, 128), 128).submit()
        expect = a.copy()
        expect[4:36] = a[0:32]
        np.testing.assert_array_equal(await _read(buf), expect)


@gpu
async def test_geometry_past_cudas_limits_is_refused_before_anything_is_queued() -> None:
    async with hcqa.open_device("cuda:0") as g:
        y = g.alloc(shape=(4,), dtype="int32")
        k = g.program("inc", SOURCE)
        for geo, match in (
            ({"local_size": (64, 32, 1)}, r"must hold <= \d+ threads per block"),
            ({"local_size": (1, 1, 65)}, r"local_size\[2\] must be <= 64"),
            ({"global_size": (1, 65536, 1)}, r"global_size\[1\] must be <= 65535"),
        ):
            with pytest.raises(hcqa.InvalidCommand, match=match):
                k(y, **geo)
        await k(y, local_size=(4, 1, 1))  # nothing was queued: the device is healthy
        assert (await _read(y)).tolist() == [1, 1, 1, 1]


@gpu
async def test_a_launch_the_driver_refuses_is_a_sticky_device_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with hcqa.open_device("cuda:0") as g:
        y = g.alloc(shape=(4,), dtype="int32")
        k = g.program("inc", SOURCE)
        await k(y)
        ex = g.compute.engine
        monkeypatch.setattr(ex, "_launch", lambda *args: (1,))  # CUDA_ERROR_INVALID_VALUE
        fence = k(y, local_size=(2, 1, 1))
        with pytest.raises(hcqa.DeviceFault, match="program 'inc' failed") as info:
            await fence
        assert isinstance(info.value.__cause__, drv.CudaError)
        assert "CUDA_ERROR_INVALID_VALUE" in str(info.value)
        with pytest.raises(hcqa.DeviceFault) as again:
            y.copyin(np.zeros(4, np.int32))
        assert again.value is info.value


_FAULTING_CHILD = textwrap.dedent(
    """
    import time, trio, hcqa
    SRC = 'extern "C" __global__ void bad(int *y, long long at) { *(int *)at = 1; y[0] = 2; }'
    async def main():
        async with hcqa.open_device("cuda:0", hang_limit=2.0) as g:
            y = g.alloc(shape=(4,), dtype="int32")
            k = g.program("bad", SRC)
            t0 = time.monotonic()
            try:
                await k(y, vals=(8,))
            except hcqa.DeviceFault as exc:
                print("FAULT", round(time.monotonic() - t0, 3), exc)
            else:
                print("NO FAULT")
    try:
        trio.run(main)
    except hcqa.DeviceFault:
        pass
    print("CLOSED")
    """
)


@real_only
def test_a_kernel_that_faults_on_the_gpu_is_found_by_the_hang_check() -> None:
    """An illegal address breaks the context: no host function runs again, and the pump
    finds the error by asking the stream before the hang limit (2 s) passes. In a child:
    the primary context stays broken for the rest of its process."""
    out = subprocess.run(
        [sys.executable, "-c", _FAULTING_CHILD], capture_output=True, text=True, timeout=120,
        env={**os.environ},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("FAULT"), out.stdout + out.stderr[-2000:]
    assert float(lines[0].split()[1]) < 2.0
    assert "ILLEGAL_ADDRESS" in lines[0] or "CUDA_ERROR" in lines[0]
    assert lines[-1] == "CLOSED"


@gpu
async def test_close_waits_for_host_functions_and_leaks_nothing(fd_count: Any) -> None:
    async with hcqa.open_device("cuda:0") as g:
        await g.program("inc", SOURCE)(g.alloc(shape=(64,), dtype="int32"), local_size=(64, 1, 1))
    fds, threads = fd_count(), threading.active_count()
    for _ in range(3):
        async with hcqa.open_devices("cuda:0", "cuda:0") as (g0, g1):
            y = g0.alloc(shape=(1024,), dtype="int32")
            k = g0.program("inc", SOURCE)
            for _ in range(50):
                k(y, global_size=(16, 1, 1), local_size=(64, 1, 1))
            slots = g0._slots  # type: ignore[attr-defined]
            y1 = g1.alloc(shape=(1024,), dtype="int32")
            hcqa.transfer(y1, y)
        assert slots.in_use == 0
        assert g0._fd_closed and g1._fd_closed  # type: ignore[attr-defined]
    assert fd_count() == fds
    assert threading.active_count() == threads


@gpu
async def test_leaving_by_an_exception_drains_the_gpu() -> None:
    with pytest.raises(KeyError):
        async with hcqa.open_device("cuda:0") as g:
            y = g.alloc(shape=(1 << 16,), dtype="int32")
            k = g.program("inc", SOURCE)
            for _ in range(20):
                k(y, global_size=(1 << 10, 1, 1), local_size=(64, 1, 1))
            raise KeyError("body")
    assert g._fd_closed and g._slots.in_use == 0  # type: ignore[attr-defined]


@gpu
async def test_cancelling_the_await_leaves_the_work_to_finish() -> None:
    async with hcqa.open_device("cuda:0") as g:
        x = g.alloc(shape=(1,), dtype="float32")
        await x.copyin(np.ones(1, np.float32))
        spin = g.program("spin", SOURCE)
        with trio.move_on_after(0.001):
            await spin(x, vals=(5_000_000,))
        await g.synchronize()  # the launch still completed; the device is healthy
        assert g.faulted is None


@gpu
async def test_no_thread_of_its_own() -> None:
    async with hcqa.open_device("cuda:0") as g:
        await g.program("inc", SOURCE)(g.alloc(shape=(4,), dtype="int32"))
        assert [t.name for t in threading.enumerate() if t.name.startswith("hcqa")] == []


@gpu
async def test_graph_replays_on_other_buffers_across_cuda_devices() -> None:
    n = 256
    geo = {"global_size": (n // 64, 1, 1), "local_size": (64, 1, 1)}
    async with hcqa.open_devices("cuda:0", "cuda:0") as (g0, g1):
        saxpy = g0.program("saxpy", SOURCE)
        scale = g1.program("scale", SOURCE)
        k = hcqa.Variable("k", 1, 10)
        x, y, x2, y2 = (g0.alloc(shape=(n,), dtype="float32") for _ in range(4))
        t, z, z2 = (g1.alloc(shape=(n,), dtype="float32") for _ in range(3))
        a = np.arange(n, dtype=np.float32)
        await x.copyin(a)
        await x2.copyin(2 * a)
        for buf in (y, y2):
            await buf.copyin(np.zeros(n, np.float32))
        with hcqa.capture() as graph:
            saxpy(y, x, vals=(n, k), **geo)
            hcqa.transfer(t, y)
            scale(z, t, vals=(n, 5), **geo)
        with trio.fail_after(30):
            await graph(k=2)
            np.testing.assert_array_equal(await _read(y), 2 * a)
            np.testing.assert_array_equal(await _read(z), 10 * a)
            await graph(buffers={x: x2, y: y2, z: z2}, k=3)
            np.testing.assert_array_equal(await _read(y2), 6 * a)
            np.testing.assert_array_equal(await _read(z2), 30 * a)
            np.testing.assert_array_equal(await _read(z), 10 * a)  # left alone


@gpu
async def test_pipeline_over_a_cuda_device_and_a_cpu_device() -> None:
    n = 256
    geo = {"global_size": (n // 64, 1, 1), "local_size": (64, 1, 1)}

    def negate(out: Any, a: Any) -> None:
        np.negative(a, out=out)

    async with hcqa.open_devices("cuda:0", "cpu:0") as (g, c):
        stages = [
            hcqa.Stage(device=g, program=g.program("scale", SOURCE), vals=(n, 3), **geo),
            hcqa.Stage(device=c, program=negate),
        ]
        pipe = hcqa.Pipeline(stages, in_shape=(n,), depth=3)
        xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(8)]
        with trio.fail_after(30):
            results = await pipe.map(xs)
        for x, y in zip(xs, results, strict=True):
            np.testing.assert_allclose(y, -3 * x, rtol=1e-6)


@gpu
async def test_tracer_records_device_ranges_on_the_host_clock(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    async with hcqa.open_device("cuda:0") as g:
        y = g.alloc(shape=(1 << 14,), dtype="int32")
        k = g.program("inc", SOURCE)
        await k(y, global_size=(1 << 8, 1, 1), local_size=(64, 1, 1))
        with hcqa.Tracer(path) as tracer:
            t0 = time.monotonic_ns()
            await k(y, global_size=(1 << 8, 1, 1), local_size=(64, 1, 1))
            t1 = time.monotonic_ns()
            await g.synchronize()
        origin = tracer._origin
    doc = json.loads(path.read_text())
    pids = {e["args"]["name"]: e["pid"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    ranges = [e for e in doc["traceEvents"] if e.get("pid") == pids["cuda:0"] and e["ph"] == "X"]
    assert [e["name"] for e in ranges] == ["inc"]
    start_ns = origin + ranges[0]["ts"] * 1000
    assert t0 - 50_000 <= start_ns <= start_ns + ranges[0]["dur"] * 1000 <= t1 + 50_000


@pytest.mark.skipif(REAL, reason="the stand-in driver's in-process version of the test above")
@gpu
async def test_a_kernel_fault_without_a_host_function_is_found_by_the_hang_check() -> None:
    src = 'extern "C" __global__ void bad(int *y, long long at) { *(int *)at = 1; }'
    async with hcqa.open_device("cuda:0", hang_limit=1.0) as g:
        y = g.alloc(shape=(4,), dtype="int32")
        k = g.program("bad", src)
        t0 = time.monotonic()
        with pytest.raises(hcqa.DeviceFault, match="CUDA_ERROR_ILLEGAL_ADDRESS") as info:
            await k(y, vals=(8,))
        assert time.monotonic() - t0 < 1.0  # before the hang limit's SignalTimeout
        assert "program 'bad' failed on the compute queue" in str(info.value)
        with pytest.raises(hcqa.DeviceFault):
            y.copyin(np.zeros(4, np.int32))


def _opencl() -> str | None:
    from _kinds import opencl_missing

    return opencl_missing()


@pytest.mark.skipif(_opencl() is not None, reason=f"no OpenCL device: {_opencl()}")
@gpu
async def test_transfers_between_cuda_and_opencl_go_through_host_memory() -> None:
    n = 1 << 12
    a = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    async with hcqa.open_devices("cuda:0", "opencl:0") as (g, o):
        x = g.alloc(shape=(n,), dtype="float32")
        y = o.alloc(shape=(n,), dtype="float32")
        z = g.alloc(shape=(n,), dtype="float32")
        await x.copyin(a)
        gate = hcqa.Signal()
        saxpy = g.program("saxpy", SOURCE)
        geo = {"global_size": (n // 64, 1, 1), "local_size": (64, 1, 1)}
        held = g.compute_queue().wait(gate, 1).exec(saxpy, (x, x), vals=(n, 1), **geo).submit()
        fence = hcqa.transfer(y, x)  # after the saxpy that writes x (a hazard): 2 * a
        await trio.sleep(0.02)
        assert not fence.reached
        gate.value = 1
        await held
        await fence
        await hcqa.transfer(z, y)
        np.testing.assert_array_equal(await _read(y), 2 * a)
        np.testing.assert_array_equal(await _read(z), 2 * a)
        with pytest.raises(hcqa.InvalidCommand, match="goes through host memory"):
            with hcqa.capture():
                hcqa.transfer(y, x)


def _actors_ask_for_driver_waits() -> bool:
    import inspect

    from hcqa.actors import actor

    return "_driver_wait" in inspect.getsource(actor)


@gpu
async def test_a_wait_kept_on_the_gpu_orders_one_stream_behind_the_other() -> None:
    """The device's driver-side wait: an event recorded on the compute stream behind a long
    kernel, and the copy stream made to wait for it (cuStreamWaitEvent): the copy sees the
    kernel's result. Here the run is handed to the copy executor directly."""
    from hcqa import commands as cmd
    from hcqa.devices.cuda.executor import StreamWait

    async with hcqa.open_device("cuda:0") as g:
        x = g.alloc(shape=(1,), dtype="float32")
        z = g.alloc(shape=(1,), dtype="float32")
        spin = g.program("spin", SOURCE)
        await x.copyin(np.full(1, 2.0, np.float32))
        await spin(x, vals=(1000,))
        spin(x, vals=(20_000_000,))  # tens of milliseconds
        value = g.compute.value
        other = g.copy.engine
        assert g._driver_wait(g.copy, g.compute.signal, value + 1) is None  # not enqueued
        assert g._driver_wait(g.copy, hcqa.Signal(), 1) is None  # not one of its streams
        gate = g._driver_wait(g.copy, g.compute.signal, value)
        assert isinstance(gate, StreamWait)
        done = hcqa.Signal()
        before = other.device_waits
        other.put([gate, cmd.Copy(dest=z, src=x, nbytes=4), cmd.Signal(signal=done, value=1)])
        with trio.fail_after(10):
            await done.wait(1)
        assert other.device_waits == before + 1
        got, final = await _read(z), await _read(x)
        assert got[0] == final[0] and final[0] != 2.0, (got, final)


@pytest.mark.skipif(
    not _actors_ask_for_driver_waits(), reason="the queue actors don't ask for driver waits here"
)
@gpu
async def test_a_hazard_between_its_own_streams_is_waited_for_on_the_gpu() -> None:
    """A copy that reads what a long kernel writes: the copy queue's Wait for the compute
    queue is kept on the GPU (the actor does not park on the host), and the copy still sees
    the kernel's result."""
    async with hcqa.open_device("cuda:0") as g:
        x = g.alloc(shape=(1,), dtype="float32")
        z = g.alloc(shape=(1,), dtype="float32")
        spin = g.program("spin", SOURCE)
        await x.copyin(np.full(1, 2.0, np.float32))
        await spin(x, vals=(1000,))
        before = g.copy.engine.device_waits
        spin(x, vals=(20_000_000,))  # tens of milliseconds
        fence = g.copy_queue().copy(z, x, 4).submit()  # reads x: waits for the kernel
        await fence
        assert g.copy.engine.device_waits == before + 1
        got, final = await _read(z), await _read(x)
        assert got[0] == final[0] and final[0] != 2.0, (got, final)


@gpu
async def test_a_copy_in_after_a_copy_out_to_the_same_array_reads_what_it_wrote() -> None:
    """A small copy-in takes its host bytes at once, unless a copy-out into host memory may
    still be writing them: then in stream order, after it."""
    async with hcqa.open_device("cuda:0") as g:
        x, y, z = (g.alloc(shape=(1,), dtype="float32") for _ in range(3))
        spin = g.program("spin", SOURCE)
        await x.copyin(np.full(1, 2.0, np.float32))
        await spin(x, vals=(1000,))
        host = np.full(1, -1.0, np.float32)
        spin(x, vals=(20_000_000,))  # tens of milliseconds
        x.copyout(host)  # not awaited: it waits for the kernel (a hazard) ...
        await y.copyin(host)  # ... and this copy-in behind it on the copy queue reads host
        final = await _read(x)
        assert final[0] != 2.0
        np.testing.assert_array_equal(await _read(y), final)
        await z.copyin(host)  # nothing pending now: taken at once
        np.testing.assert_array_equal(await _read(z), final)


@pytest.mark.skipif(REAL, reason="the flag applies once per process: checked on the stand-in")
@gpu
async def test_the_schedule_flag_is_set_before_the_context_is_made(
    cuda_driver: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HCQA_CUDA_SCHED", "bogus")
    with pytest.raises(hcqa.InvalidCommand, match=r"HCQA_CUDA_SCHED must be one of .*'bogus'"):
        async with hcqa.open_device("cuda:0"):
            pass
    monkeypatch.setenv("HCQA_CUDA_SCHED", "blocking")
    async with hcqa.open_device("cuda:0"):
        assert cuda_driver.ctx_flags == 4  # CU_CTX_SCHED_BLOCKING_SYNC


@gpu
async def test_a_kernel_compiled_otherwise_than_its_source_reads_is_refused() -> None:
    """The parameters read from the source are checked against the compiled kernel's own
    layout (cuFuncGetParamInfo): a macro that makes ``n`` 64-bit would misplace the vals.
    (The stand-in driver compiles ``misread`` as (pointer, 64-bit) whatever the source.)"""
    sneaky = '#define int long long\nextern "C" __global__ void misread(char *y, int n) { }'
    async with hcqa.open_device("cuda:0") as g:
        with pytest.raises(hcqa.InvalidCommand, match=r"sizes \[8, 4\] bytes; got sizes \[8, 8\]"):
            g.program("misread", sneaky)


@gpu
def test_info_lists_each_gpu_by_its_spec() -> None:
    from hcqa.cli._cuda import cuda_rows

    rows = dict(cuda_rows())
    assert rows["cuda"].endswith("device(s)")
    assert "compute capability" in rows["cuda:0"] and "GiB" in rows["cuda:0"]
