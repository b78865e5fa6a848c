"""Regression tests for issue 14: bad input that used to crash the process, fault a device,
do nothing silently, or get an unclear error. Each test checks the refusal, that nothing was
queued, and that the device still computes afterwards."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing
from conftest import count_fds

import hcqa
from hcqa import DeviceClosed, HcqaError, InvalidCommand, OutOfMemory, Signal

N = 16


def _copy(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
    out[:] = a


@pytest.fixture
async def dev() -> AsyncIterator[hcqa.Device]:
    async with hcqa.open_device("cpu:0", hang_limit=30.0) as d:
        yield d


async def still_computes(d: hcqa.Device) -> None:
    """The device runs a kernel and the copies around it correctly (and never faulted)."""
    assert d.faulted is None
    a, out = (d.alloc(shape=(N,), dtype="float32") for _ in range(2))
    src = np.arange(N, dtype=np.float32) * 3
    await a.copyin(src)
    await d.program("copy", _copy)(out, a)
    host = np.empty(N, np.float32)
    await out.copyout(host)
    assert (host == src).all()
    await d.synchronize()


def _unused_fd() -> int:
    """An fd number that is not open (a closed fd's number is soon reused)."""
    return max(int(fd) for fd in os.listdir("/proc/self/fd")) + 64


def _state(d: hcqa.Device) -> tuple[int, int, int, int]:
    st = d.statistics()
    return st.timeline_value, st.timeline_reserved, st.queues[0].submitted, st.queues[1].submitted


# -- the error hierarchy --------------------------------------------------------------------


def test_invalid_command_is_every_kind_of_bad_argument_error() -> None:
    assert issubclass(InvalidCommand, HcqaError)
    assert issubclass(InvalidCommand, ValueError)
    assert issubclass(InvalidCommand, TypeError)


async def test_misspelled_dtype_is_invalid_command(dev: hcqa.Device) -> None:
    before = _state(dev)
    with pytest.raises(InvalidCommand, match=r"'dtype' must be a numpy dtype \(got 'float33'\)"):
        dev.alloc(8, dtype="float33")
    with pytest.raises(TypeError):  # the old except-form still works
        dev.alloc(8, dtype="float33")
    with pytest.raises(InvalidCommand, match="'nbytes' must be an int"):
        dev.alloc("8")  # type: ignore[arg-type]
    assert _state(dev) == before
    await still_computes(dev)


# -- object and other non-plain dtypes --------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        np.empty(8, dtype=object),
        np.empty(4, dtype=[("a", "f4"), ("o", object)]),
        memoryview(np.empty(8, dtype=object)),
    ],
    ids=["object", "structured-with-object", "memoryview-of-objects"],
)
async def test_object_arrays_are_refused_by_copies(dev: hcqa.Device, host: Any) -> None:
    raw = dev.alloc(np.empty(8, dtype=object).nbytes)
    before = _state(dev)
    with pytest.raises(InvalidCommand, match=r"(object|plain).*\(got"):
        raw.copyout(host)
    with pytest.raises(InvalidCommand, match=r"(object|plain).*\(got"):
        raw.copyin(host)
    assert _state(dev) == before
    await still_computes(dev)


async def test_plain_structured_arrays_still_copy_into_raw_buffers(dev: hcqa.Device) -> None:
    src = np.zeros(4, dtype=[("a", "f4"), ("b", "i4")])
    src["a"], src["b"] = 1.5, 7
    raw = dev.alloc(src.nbytes)
    await raw.copyin(src)
    back = np.empty_like(src)
    await raw.copyout(back)
    assert (back == src).all()


# -- shapes -----------------------------------------------------------------------------------


async def test_copies_check_the_shape_of_typed_buffers(dev: hcqa.Device) -> None:
    x = dev.alloc(shape=(4, 4), dtype="float32")
    before = _state(dev)
    with pytest.raises(InvalidCommand, match=r"shape must be \(4, 4\).*\(got \(2, 8\)"):
        x.copyin(np.ones((2, 8), np.float32))
    with pytest.raises(InvalidCommand, match=r"shape must be \(4, 4\).*\(got \(16,\)"):
        x.copyout(np.empty(16, np.float32))
    assert _state(dev) == before
    await x.copyin(np.ones((4, 4), np.float32))  # the right shape still works
    raw = dev.alloc(64)
    await raw.copyin(np.ones((2, 8), np.float32))  # raw bytes take any shape
    await still_computes(dev)


# -- device specs -------------------------------------------------------------------------------


async def test_a_spec_without_an_index_is_refused() -> None:
    for spec in ("cpu", "cuda", "cpu:"):
        with pytest.raises(InvalidCommand, match=r"must look like 'cpu:N'.*\(got"):
            async with hcqa.open_device(spec):
                pass  # pragma: no cover


# -- files --------------------------------------------------------------------------------------


async def test_load_refuses_what_is_not_a_regular_file(dev: hcqa.Device, tmp_path: Path) -> None:
    raw = dev.alloc(64)
    before = _state(dev)
    with pytest.raises(InvalidCommand, match=r"must be a regular file \(got a directory\)"):
        raw.load(tmp_path)
    r, w = os.pipe()
    try:
        with pytest.raises(InvalidCommand, match=r"regular file \(got a pipe\)"):
            raw.load(f"/proc/self/fd/{r}")
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(InvalidCommand, match=r"'path' must be a str or os.PathLike \(got int\)"):
        raw.load(3)  # type: ignore[arg-type]
    assert _state(dev) == before
    await still_computes(dev)


# -- signals --------------------------------------------------------------------------------------


async def test_queue_verbs_refuse_a_closed_signal(dev: hcqa.Device) -> None:
    s = Signal()
    s.close()
    before = _state(dev)
    for verb in ("wait", "signal"):
        with pytest.raises(DeviceClosed, match=rf"{verb}: signal .* is closed"):
            getattr(dev.compute_queue(), verb)(s, 1)
    with pytest.raises(DeviceClosed, match=r"timestamp: signal .* is closed"):
        dev.compute_queue().timestamp(s)
    assert _state(dev) == before
    await still_computes(dev)


async def test_a_built_queue_refuses_a_signal_closed_since(dev: hcqa.Device) -> None:
    s = Signal(name="late")
    q = dev.compute_queue().wait(s, 1)
    s.close()
    before = _state(dev)
    with pytest.raises(DeviceClosed, match="signal 'late' is closed"):
        q.submit()
    with pytest.raises(DeviceClosed, match="signal 'late' is closed"):
        await q.submit_async()
    assert _state(dev) == before
    await still_computes(dev)


async def test_a_wait_on_a_fence_taken_during_a_capture_is_refused(dev: hcqa.Device) -> None:
    a, out = (dev.alloc(shape=(N,), dtype="float32") for _ in range(2))
    with hcqa.capture():
        fence = dev.program("copy", _copy)(out, a)
    before = _state(dev)
    with pytest.raises(InvalidCommand, match=r"can't be waited on.*await the replay"):
        dev.compute_queue().wait(fence.signal, fence.value)
    assert _state(dev) == before
    await still_computes(dev)


async def test_add_peer_takes_only_an_open_eventfd(dev: hcqa.Device, tmp_path: Path) -> None:
    s = Signal()
    closed = _unused_fd()
    f = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    try:
        for bad, expect in (
            (-1, r"must be an open fd >= 0 \(got -1\)"),
            ("x", r"must be an int fd \(got str\)"),
            (True, r"must be an int fd \(got bool\)"),
            (closed, rf"must be an open fd \(got {closed}, not open\)"),
            (f, rf"must be an eventfd \(got fd {f}: .*/f\)"),
        ):
            with pytest.raises(InvalidCommand, match=expect):
                s.add_peer(bad)  # type: ignore[arg-type]
        assert s._peers == []
        # a device writing the signal afterwards is unharmed, and a real peer is woken
        peer = os.eventfd(0, os.EFD_NONBLOCK)
        s.add_peer(peer)
        await dev.compute_queue().signal(s, 5).submit()
        assert s.value == 5 and os.eventfd_read(peer) >= 1
        await still_computes(dev)
    finally:
        os.close(f)
        s.close()


@pytest.mark.parametrize("timeout", [math.inf, 1e300, 2.0**70])
def test_wait_sync_takes_any_long_timeout(timeout: float) -> None:
    s = Signal()
    try:
        s.wait_sync(0, timeout=timeout)  # reached: returns at once
        done = threading.Event()
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                s.wait_sync(1, timeout=timeout)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
            done.set()

        t = threading.Thread(target=waiter)
        t.start()
        s.value = 1
        t.join(10)
        assert done.is_set() and errors == []
    finally:
        s.close()


def test_wait_sync_refuses_nan_and_non_numbers() -> None:
    s = Signal()
    try:
        with pytest.raises(InvalidCommand, match=r"'timeout' must be >= 0 or None \(got nan\)"):
            s.wait_sync(1, timeout=math.nan)
        with pytest.raises(InvalidCommand, match=r"'timeout' must be a number .* \(got str\)"):
            s.wait_sync(1, timeout="1")  # type: ignore[arg-type]
    finally:
        s.close()


async def test_a_queued_timestamp_never_writes_a_recycled_slot(dev: hcqa.Device) -> None:
    hold, s = Signal(name="hold"), Signal(name="stamped")
    page, index = s._page, s._index
    dev.compute_queue().wait(hold, 1).timestamp(s).submit()
    await trio.testing.wait_all_tasks_blocked()
    s.close()  # closed with a timestamp still queued
    heir = Signal(name="heir")  # the pool hands the freed slot out again at once
    assert (heir._page, heir._index) == (page, index)
    hold.value = 1
    await dev.synchronize()
    assert heir.timestamp == 0.0 and heir.value == 0
    assert dev.faulted is None
    heir.close()
    hold.close()
    await still_computes(dev)


def test_write_timestamp_on_a_closed_signal_is_refused() -> None:
    s = Signal(name="gone")
    s.close()
    with pytest.raises(DeviceClosed, match="'gone' is closed"):
        s.write_timestamp(5)


# -- kernels that would do nothing --------------------------------------------------------------


async def _async_kernel(out: Any) -> None:  # pragma: no cover - must never be accepted
    out[:] = 1


def _generator_kernel(out: Any) -> Iterator[None]:  # pragma: no cover
    out[:] = 1
    yield


async def _async_generator_kernel(out: Any) -> AsyncIterator[None]:  # pragma: no cover
    out[:] = 1
    yield


class _AsyncCallable:
    async def __call__(self, out: Any) -> None:  # pragma: no cover
        out[:] = 1


@pytest.mark.parametrize(
    ("fn", "what"),
    [
        (_async_kernel, "an async def function"),
        (_generator_kernel, "a generator function"),
        (_async_generator_kernel, "an async generator function"),
        (_AsyncCallable(), "an async def function"),
    ],
    ids=["async-def", "generator", "async-generator", "async-callable-object"],
)
async def test_kernels_that_would_run_nothing_are_refused(
    dev: hcqa.Device, fn: Any, what: str
) -> None:
    with pytest.raises(InvalidCommand, match=rf"must be a plain function .*\(got {what}"):
        dev.program("k", fn)
    await still_computes(dev)


# -- shared memory --------------------------------------------------------------------------------


async def test_shared_allocations_count_against_the_device_memory() -> None:
    async with hcqa.open_device("cpu:0", memory=1 << 20) as d:
        first = d.alloc(768 << 10, shared=True)
        assert d.statistics().memory.used == 768 << 10
        with pytest.raises(OutOfMemory, match=r"out of memory.*requested"):
            d.alloc(512 << 10, shared=True)
        with pytest.raises(OutOfMemory, match=r"out of memory.*requested"):
            d.alloc(512 << 10)  # ordinary allocations see the shared bytes too
        first.free()
        assert d.statistics().memory.used == 0
        second = d.alloc(768 << 10, shared=True)
        await second.copyin(bytes(768 << 10))
        await still_computes(d)


async def test_a_failed_shared_alloc_leaks_no_fd() -> None:
    async with hcqa.open_device("cpu:0", memory=1 << 62) as d:
        before = count_fds()
        for _ in range(5):
            with pytest.raises(OutOfMemory, match=r"can't map 'nbytes' = \d+ bytes \(got"):
                d.alloc(1 << 61, shared=True)
        assert count_fds() == before
        assert d.statistics().memory.used == 0
        await still_computes(d)


async def test_import_buffer_refuses_bad_fds_and_leaves_them_to_the_caller(
    dev: hcqa.Device, tmp_path: Path
) -> None:
    closed = _unused_fd()
    folder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    small = os.memfd_create("small")
    os.ftruncate(small, 16)
    before = _state(dev)
    try:
        for fd, expect in (
            (-1, r"must be an open memfd \(got fd -1: Bad file descriptor\)"),
            (closed, rf"must be an open memfd \(got fd {closed}: Bad file descriptor\)"),
            (folder, rf"must be a memfd or a regular file \(got fd {folder}, not one\)"),
            (small, r"must hold 'nbytes' = 64 bytes \(got 16\)"),
            ("3", r"'fd' must be an int file descriptor \(got str\)"),
        ):
            with pytest.raises(InvalidCommand, match=expect):
                dev.import_buffer(fd, 64)  # type: ignore[arg-type]
        os.fstat(folder)  # still open: a refused fd stays the caller's
        os.fstat(small)
        assert _state(dev) == before
        await still_computes(dev)
    finally:
        os.close(folder)
        os.close(small)


# -- views kept past free() -----------------------------------------------------------------------


async def test_freed_memory_is_reused_when_no_view_survives(dev: hcqa.Device) -> None:
    """The baseline the next test depends on: without a view, the cache reuses the block."""
    a = dev.alloc(8192)
    addr = a.va_addr
    a.free()
    assert dev.alloc(8192).va_addr == addr


async def test_a_view_kept_after_free_never_aliases_the_next_allocation(
    dev: hcqa.Device,
) -> None:
    a = dev.alloc(8192)
    kept = a.numpy_view()[16:]  # a slice of the view: it keeps the memory too
    a.free()
    b = dev.alloc(8192)  # same size class: would be served from a's block
    await b.copyin(bytes(8192))
    kept[:] = 0xAB
    host = bytearray(8192)
    await b.copyout(host)
    assert host == bytes(8192)
    assert dev.statistics().memory.cached == 0  # retired, not cached for the next one
    del kept
    await still_computes(dev)


# -- the copyin read-timing rule (documented, not snapshotted) --------------------------------


async def test_copyin_reads_the_host_array_when_the_copy_runs(dev: hcqa.Device) -> None:
    """The documented rule (README usage, getting-started, the docstring): the host array
    is read when the copy runs. Here the copy is held behind a kernel that writes the
    same buffer and waits on a gate; a change made before the gate opens is what lands."""
    gate = Signal(name="gate")
    buf = dev.alloc(shape=(N,), dtype="float32")
    dev.compute_queue().wait(gate, 1).exec(dev.program("w", lambda out: None), (buf,)).submit()
    host = np.zeros(N, np.float32)
    fence = buf.copyin(host)
    await trio.testing.wait_all_tasks_blocked()
    assert not fence.reached
    host += 5  # too early: the copy has not read it yet
    gate.value = 1
    await fence
    back = np.empty(N, np.float32)
    await buf.copyout(back)
    assert (back == 5).all()
    gate.close()


@pytest.mark.parametrize("verb", ["wait", "signal", "timestamp"])
async def test_a_replay_refuses_a_signal_closed_since_the_capture(
    dev: hcqa.Device, verb: str
) -> None:
    w = Signal(name="w")
    q = dev.compute_queue()
    with hcqa.capture() as g:
        (q.timestamp(w) if verb == "timestamp" else getattr(q, verb)(w, 1)).submit()
    w.close()
    before = _state(dev)
    with trio.fail_after(10), pytest.raises(DeviceClosed, match=r"replay: signal 'w' is closed"):
        await g()
    with pytest.raises(DeviceClosed, match=r"replay: signal 'w' is closed"):
        g.submit()
    assert _state(dev) == before  # nothing queued
    assert dev.faulted is None
    await still_computes(dev)
