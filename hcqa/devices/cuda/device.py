"""The ``cuda:N`` device: the core's Device over NVIDIA's CUDA driver (``cuda-bindings``).

Theory of operation
-------------------
A :class:`CudaDevice` is the core's :class:`~hcqa.devices.base.Device` (queue actors,
timeline, hazards, faults, hang limits, capture, ``timed``) with four backend pieces:

* memory: :class:`~hcqa.devices.cuda.memory.CuAllocator` (``cuMemAlloc`` blocks in the GPU's
  primary context; not host-visible, so ``numpy_view()`` is refused);
* programs: CUDA C++ built by NVRTC at ``program()`` (``program.py``);
* execution: each queue (compute, copy) is a
  :class:`~hcqa.devices.cuda.executor.CuExecutor` over its own non-blocking stream;
* completion: host functions (``cuLaunchHostFunc``) store signal values and timeline steps
  from the driver's thread and write the device's eventfd; the **pump**, a trio task of the
  device, sleeps on that eventfd and does what needs Python (timestamps, other signals) in
  queue order. A segment its host function finished by itself does not wake the pump: the
  next enqueue on the loop's thread tidies it, or the pump when it next wakes. Nothing spins
  and nothing synchronizes: no ``cuStreamSynchronize`` (which spins by default) is called.

When no host function ran for a third of the hang limit, the pump asks each stream with
pending work for its status (``cuStreamQuery``): a kernel that faulted breaks the context
for good, and the error found there becomes the device's ``DeviceFault`` before a waiter's
hang limit passes.

Clocks: the device clock is the time since a reference event recorded at open, read with
``cuEventElapsedTime`` (single-precision milliseconds: about 0.5 us of resolution after an
hour open). A segment that needs times records an event right before its host function,
which stamps ``CLOCK_MONOTONIC`` when it runs: (host stamp - event time) is the offset plus a
delay that is never negative. :meth:`CudaDevice.clock_offset_ns` is the smallest of the
last 64 samples, seeded at open by probes.

Closing: the actors stop their executors once drained (or cancelled); the pump keeps running
(shielded) until every segment completed and every host function made its last store, then
``_release`` frees the slots, the eventfd, the events, the streams, the staging and the
memory. A device declared hung leaves what the GPU may still touch.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from typing import Any

import trio

from hcqa.devices.base import Device
from hcqa.devices.cuda import driver as drv
from hcqa.devices.cuda.executor import CuExecutor, Segment, StreamWait, _Pinned, _Temp
from hcqa.devices.cuda.memory import CuAllocator
from hcqa.devices.cuda.program import CuProgram, build
from hcqa.devices.program import Program
from hcqa.errors import InvalidCommand

__all__ = ["CudaDevice"]

_SEED_PROBES = 8
_SAMPLES = 64
_NOT_READY = 600  # CUDA_ERROR_NOT_READY


class CudaDevice(Device):
    """A device on an NVIDIA GPU (``cuda:N``)."""

    kind = "cuda"
    host_memory = False  # buffers are device memory: the host can't address them
    driver_waits = True  # a Wait between its own two streams is kept on the GPU

    def __init__(self, name: str, **options: Any) -> None:
        index = int(name.partition(":")[2].partition("#")[0])
        self._driver = drv.init()
        self.cu_device, self.cu_context = drv.context(index)
        drv.native()  # the host functions (compiled once per process)
        drv.current(self.cu_context)
        driver = self._driver
        attr = driver.CUdevice_attribute
        self.arch = tuple(
            int(drv.check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(a, self.cu_device)))
            for a in (attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                      attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        )  # fmt: skip
        self._total = int(drv.check("cuDeviceTotalMem", driver.cuDeviceTotalMem(self.cu_device)))
        flags = int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self._streams = {
            k: drv.check("cuStreamCreate", driver.cuStreamCreate(flags))
            for k in ("compute", "copy")
        }
        self._free_events: list[Any] = []
        self._all_events: list[Any] = []
        self._ref = self._take_event()  # the device clock's zero
        drv.check("cuEventRecord", driver.cuEventRecord(self._ref, self._streams["compute"]))
        self._fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._slots = drv.SlotTable(self._fd)
        self._lingering: list[Segment] = []
        self._offsets: collections.deque[int] = collections.deque(maxlen=_SAMPLES)
        self._pump_running = False
        self._loop = -1
        self._fd_closed = False
        self._released = False
        # copies into host memory enqueued and not yet processed: while any is, a small
        # copy-in reads its host array in stream order too, not at once (it may be that one)
        self._host_writes = 0
        try:
            options["host_visible"] = False
            super().__init__(name, **options)
        except BaseException:
            os.close(self._fd)
            self._fd_closed = True
            self._free_driver()
            raise

    # -- the backend seam --------------------------------------------------------------------

    def _make_allocator(self, capacity: int) -> CuAllocator:  # type: ignore[override]
        return CuAllocator(capacity=min(capacity, self._total), name=self.name, ctx=self.cu_context)

    def _copies_on_compute(self) -> bool:
        return True  # every stream takes every verb

    def _executor(self, kind: str) -> CuExecutor:
        return CuExecutor(
            self,
            kind,
            self._streams[kind],
            on_fault=lambda command, exc: self._on_engine_fault(kind, command, exc),
        )

    def _make_program(self, name: str, src: Any, **options: Any) -> Program:
        if options.get("geometry"):
            raise InvalidCommand(
                "'geometry' is for C kernels: a CUDA kernel reads its geometry from "
                "blockIdx / blockDim / gridDim"
            )
        arch = (self.arch[0], self.arch[1])
        module, function, params = build(self.cu_context, arch, name, src, options.get("entry"))
        return CuProgram(
            self, name, module, function, params,
            writes=options.get("writes"), reads=options.get("reads"),
        )  # fmt: skip

    def _driver_wait(self, actor: Any, signal: Any, value: int) -> StreamWait | None:
        """The seam's driver-side wait: for a Wait of one of this device's queues on the
        other's queue signal whose producer is already on that stream, record an event
        there now (it captures all of that work) and hand the waiting queue a
        ``StreamWait`` (``cuStreamWaitEvent``) in the Wait's place. None otherwise: the
        actor awaits it on the host (a signal of another device, the host, another
        process; a producer not yet handed to the driver). One device, one sticky error:
        a producer refused by the driver faults the waiter's device too."""
        if self._error is not None:
            return None
        other = next(
            (e for e in self._executors() if e is not actor.engine and e.own is signal), None
        )
        if other is None or other.enqueued < value or other.error is not None:
            return None
        with other._lock:  # (no lock is held while this one is taken)
            drv.current(self.cu_context)
            ev = self._take_event()
            try:
                drv.check("cuEventRecord", self._driver.cuEventRecord(ev, other.stream))
            except drv.CudaError:
                self._free_events.append(ev)
                return None
        return StreamWait(ev, signal, value)

    # -- clocks ------------------------------------------------------------------------------

    def clock_offset_ns(self) -> int:
        """Nanoseconds to add to this device's clock (ns since its reference event) to get
        ``time.monotonic_ns``."""
        if not self._offsets:
            self._measure_offset()
        return min(self._offsets)

    def _device_ns(self, event: Any) -> int:
        """``event``'s time on the device clock (it has completed)."""
        ms = drv.check("cuEventElapsedTime", self._driver.cuEventElapsedTime(self._ref, event))
        return round(float(ms) * 1e6)

    def _wants_sample(self, k: int) -> bool:
        return len(self._offsets) < 16 or k % 256 == 0

    def _sample(self, seg: Segment) -> None:
        host = int(seg.words[drv.HOST_NS])
        if seg.end is None or not host:
            return
        try:
            self._offsets.append(host - self._device_ns(seg.end))
        except drv.CudaError:
            return

    def _measure_offset(self) -> None:
        """No sample yet (a caller asked before the first probe came back): one event,
        polled with sleeps of 50 us (once per device at most)."""
        driver = self._driver
        drv.current(self.cu_context)
        ev = self._take_event()
        stream = self._streams["compute"]
        for _ in range(3):
            drv.check("cuEventRecord", driver.cuEventRecord(ev, stream))
            while int(driver.cuEventQuery(ev)[0]) == _NOT_READY:
                time.sleep(0.00005)
            self._offsets.append(time.monotonic_ns() - self._device_ns(ev))
        self._free_events.append(ev)

    def _take_event(self) -> Any:
        if self._free_events:
            return self._free_events.pop()
        flags = int(self._driver.CUevent_flags.CU_EVENT_DEFAULT)
        ev = drv.check("cuEventCreate", self._driver.cuEventCreate(flags))
        self._all_events.append(ev)
        return ev

    # -- the pump ------------------------------------------------------------------------------

    async def _start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._pump)
        try:
            await super()._start(nursery)
        except BaseException:
            for executor in self._executors():
                executor.stop()
            raise
        for _ in range(_SEED_PROBES):
            self._executors()[0].probe()

    def _executors(self) -> list[CuExecutor]:
        return [a.engine for a in self._queues.values()]  # type: ignore[misc]

    def _wake_pump(self) -> None:
        if not self._fd_closed:
            os.eventfd_write(self._fd, 1)

    async def _pump(self) -> None:
        self._pump_running = True
        self._loop = threading.get_ident()
        executors = self._executors()
        try:
            try:
                await self._pump_loop(executors, cancelled=False)
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    await self._pump_loop(executors, cancelled=True)
                raise
        finally:
            self._pump_running = False

    async def _pump_loop(self, executors: list[CuExecutor], *, cancelled: bool) -> None:
        check = max(self.hang_limit / 3, 0.001) if not math.isinf(self.hang_limit) else 3600.0
        while True:
            self._drain(executors)
            if self._lingering:
                self._linger()
            ended = all(e.finished or (cancelled and e.unused) for e in executors)
            if ended and not self._lingering:
                return
            if self._hung and all(e.stopping for e in executors):
                self._abandon(executors)
                return
            if self._lingering:  # a host function between its eventfd write and `done`
                await trio.sleep(0.0002)
                continue
            with trio.move_on_after(check) as scope:
                await trio.lowlevel.wait_readable(self._fd)
                await trio.lowlevel.cancel_shielded_checkpoint()
            if scope.cancelled_caught:
                self._check_failed(executors)
            try:
                os.eventfd_read(self._fd)
            except BlockingIOError:
                pass

    def _tidy(self, executor: CuExecutor) -> None:
        pending = executor.pending
        if pending and pending[0].words[drv.FIRED] and threading.get_ident() == self._loop:
            self._drain([executor])

    def _tidy_all(self) -> None:
        for ex in self._executors():
            self._tidy(ex)

    def _drain(self, executors: list[CuExecutor]) -> bool:
        progress = False
        for ex in executors:
            pending = ex.pending
            while pending and pending[0].words[drv.FIRED]:
                seg = pending.popleft()
                progress = True
                self._sample(seg)
                ex.complete(seg)
                self._free_events.extend(seg.events)
                self._host_writes -= seg.hostw
                for k in seg.keep:
                    if type(k) is _Pinned:
                        k.executor._blocks.append(k.block)
                    elif type(k) is _Temp:
                        self.allocator.free(k.block)  # type: ignore[arg-type]
                seg.keep = []
                if seg.words[drv.DONE]:
                    self._slots.give(seg.words, seg.address)
                else:
                    self._lingering.append(seg)
            if ex.finished and not ex.exited.value:
                ex.exited._set_from_engine(1)
        return progress

    def _linger(self) -> None:
        still = []
        for seg in self._lingering:
            if seg.words[drv.DONE]:
                self._slots.give(seg.words, seg.address)
            else:
                still.append(seg)
        self._lingering = still

    def _check_failed(self, executors: list[CuExecutor]) -> None:
        """No completion for a third of the hang limit: did the GPU fail a command?"""
        for ex in executors:
            if not ex.pending:
                continue
            drv.current(self.cu_context)
            code = int(self._driver.cuStreamQuery(ex.stream)[0])
            if code in (0, _NOT_READY):
                continue
            reason = f"the CUDA driver reported {drv.error_name(code)} for its stream"
            for seg in list(ex.pending):
                if seg.words[drv.FIRED]:
                    continue
                ex.pending.remove(seg)
                self._slots.abandon(seg.words)
                drv.keep_forever(seg)
                ex.fail(seg, reason)

    def _abandon(self, executors: list[CuExecutor]) -> None:
        for ex in executors:
            for seg in ex.pending:
                self._slots.abandon(seg.words)
                drv.keep_forever(seg)
            if not ex.exited.value:
                ex.exited._set_from_engine(1)
        for seg in self._lingering:
            self._slots.abandon(seg.words)
        self._lingering = []

    # -- lifetime --------------------------------------------------------------------------

    def _release(self) -> None:
        super()._release()
        if self._hung or any(e.alive for e in self._executors()) or self._pump_running:
            return  # the GPU may still run host functions: keep the fd and memory
        if not self._fd_closed:
            self._fd_closed = True
            os.close(self._fd)
        for ex in self._executors():
            _quietly(ex.free_staging)
        self._free_driver()

    def _free_driver(self) -> None:
        """Destroy the events and streams (errors of a broken context are ignored)."""
        if self._released:
            return
        self._released = True
        driver = self._driver
        _quietly(lambda: drv.current(self.cu_context))
        for ev in self._all_events:
            driver.cuEventDestroy(ev)
        for stream in self._streams.values():
            driver.cuStreamDestroy(stream)
        self._all_events, self._free_events = [], []


def _quietly(fn: Any) -> None:
    try:
        fn()
    except drv.CudaError:
        pass
