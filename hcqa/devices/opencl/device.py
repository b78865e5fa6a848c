"""The ``opencl:N`` device: the core's Device over an OpenCL driver.

Theory of operation
-------------------
An :class:`OpenCLDevice` is the core's :class:`~hcqa.devices.base.Device` (queue actors,
timeline, hazards, faults, hang limits, capture, ``timed``) with four backend pieces:

* memory: :class:`~hcqa.devices.opencl.memory.ClAllocator` (``cl.Buffer`` blocks; the host
  never maps them, so the device is not host-visible and ``numpy_view()`` is refused);
* programs: OpenCL C built at ``program()`` (``program.py``);
* execution: each queue (compute, copy) is a
  :class:`~hcqa.devices.opencl.executor.ClExecutor` over its own in-order, profiling
  ``cl.CommandQueue`` in the platform's shared context (``runtime.py``);
* completion: the native callback writes the device's eventfd; the **pump**, a trio task of
  the device, sleeps on it and does each fired segment's work in queue order. A segment the
  callback finished by itself (its signal and timeline step) does not wake the pump: the
  next enqueue on the loop's thread tidies it (refs dropped, slot back), or the pump when it
  next wakes (a stop, its timer). When no
  callback came for a third of the hang limit it asks the driver for the status of what is
  pending (nothing when idle: a wake every 10 s at the default limit): PoCL 3 never calls back
  for a command that failed, so a negative status found there becomes the device's
  ``DeviceFault``, before a waiter's hang limit passes.

Closing: the actors stop their executors once drained (or cancelled); the pump keeps running
(shielded) until every segment has completed and every callback has made its last store, then
ends; ``_release`` frees the slots, the eventfd, the queues and the memory. A device declared
hung leaves what the driver may still touch (its slots are abandoned, its memory kept).

Clocks: profiling counters are the device's clock (PoCL: ``CLOCK_MONOTONIC_RAW``). Each
callback also stamps ``CLOCK_MONOTONIC`` the moment it runs, after its event's END: so
(callback stamp - END) is the offset plus a delay that is never negative and usually a
fraction of a microsecond. :meth:`OpenCLDevice.clock_offset_ns` is the smallest of the last
64 such samples (a median would keep the delays of a loaded host), seeded at open by markers;
the two clocks drift apart slowly (NTP slews one of them), which the window follows.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import trio

from hcqa.devices.base import Device
from hcqa.devices.opencl import platforms, runtime
from hcqa.devices.opencl.executor import ClExecutor, Segment
from hcqa.devices.opencl.memory import ClAllocator
from hcqa.devices.opencl.program import ClProgram, build
from hcqa.devices.opencl.runs import ClRun, fusable, make_run
from hcqa.devices.program import Program
from hcqa.errors import InvalidCommand

__all__ = ["OpenCLDevice"]

_SEED_PROBES = 8
_SAMPLES = 64


class OpenCLDevice(Device):
    """A device on an OpenCL driver (``opencl:N``)."""

    kind = "opencl"
    host_memory = False  # buffers are driver memory: the host can't address them
    driver_waits = True  # a Wait on an OpenCL queue of the same context: event wait lists
    # A launch record (kernel, NDRange, arguments) passed on to a program's repeat calls: its
    # memory objects keep no memory alive (a block is released explicitly when the pool
    # evicts it or the device closes; a record matches only while its buffers live).
    shares_native = True

    def __init__(self, name: str, **options: Any) -> None:
        index = int(name.partition(":")[2].partition("#")[0])  # "opencl:0", "opencl:0#2"
        pyopencl = runtime.cl()
        try:
            self.cl_device = platforms.cl_device(index)
        except IndexError as exc:
            raise InvalidCommand(str(exc)) from None
        if platforms.missing_ld() and "Portable Computing" in self.cl_device.platform.name:
            raise InvalidCommand(
                f"{name}: PoCL links each kernel with the system linker 'ld', and none is on "
                "PATH (install binutils): it would abort the process at a kernel's first launch"
            )
        self.context = runtime.context_for(self.cl_device)
        props = pyopencl.command_queue_properties.PROFILING_ENABLE
        self._cl_queues = {
            k: pyopencl.CommandQueue(self.context, self.cl_device, properties=props)
            for k in ("compute", "copy")
        }
        self._fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._slots = runtime.SlotTable(self._fd)
        self._lingering: list[Segment] = []  # processed, but the callback's last store not seen
        self._offsets: collections.deque[int] = collections.deque(maxlen=_SAMPLES)
        self._sampled = 0
        self._pump_running = False
        self._loop = -1  # the thread the pump runs on (the event loop's)
        self._fd_closed = False
        self._align = max(1, int(self.cl_device.mem_base_addr_align) // 8)
        try:
            options["host_visible"] = False
            super().__init__(name, **options)
        except BaseException:
            os.close(self._fd)
            self._fd_closed = True
            raise
        for actor in self._queues.values():  # its queue signals: Waits the driver may keep
            actor.engine._own = actor.signal  # type: ignore[attr-defined]
            runtime.producers[actor.signal] = actor.engine

    # -- the backend seam --------------------------------------------------------------------

    def _make_allocator(self, capacity: int) -> ClAllocator:  # type: ignore[override]
        capacity = min(capacity, int(self.cl_device.global_mem_size))
        return ClAllocator(
            capacity=capacity, name=self.name, context=self.context, align=self._align
        )

    def _copies_on_compute(self) -> bool:
        return True  # every command queue takes every verb

    def _executor(self, kind: str) -> ClExecutor:
        return ClExecutor(
            self,
            kind,
            self._cl_queues[kind],
            on_fault=lambda command, exc: self._on_engine_fault(kind, command, exc),
        )

    def _driver_wait(self, actor: Any, signal: Any, value: int) -> Any:
        """A Wait the driver keeps (``ClExecutor.hold``): a Gate, or None."""
        return actor.engine.hold(signal, value)

    def _patches_in_place(self, exec_: Any) -> bool:
        """Every launch: a symbolic val is resolved from the batch's Bind when its launch
        record sets the kernel's arguments (``program.Patched``)."""
        return True

    def _fusable(self, exec_: Any) -> bool:
        """A launch whose vals and sizes are plain ints joins a native run (``runs.py``)."""
        return fusable(exec_)

    def _fuse(self, run: Sequence[Any]) -> ClRun:
        """One ``hcqa_cl_run`` call over a table of the launches (nothing is compiled)."""
        return make_run(run)

    def _make_program(self, name: str, src: Any, **options: Any) -> Program:
        if options.get("geometry"):
            raise InvalidCommand(
                "'geometry' is for C kernels: an OpenCL kernel reads its geometry with "
                "get_global_id / get_local_size / get_num_groups"
            )
        kernel, params = build(self, name, src, options.get("entry"), options.get("flags", ()))
        return ClProgram(
            self, name, kernel, params, writes=options.get("writes"), reads=options.get("reads")
        )

    def clock_offset_ns(self) -> int:
        """Nanoseconds to add to this device's profiling timestamps to get ``time.monotonic_ns``."""
        if not self._offsets:
            self._measure_offset()
        return min(self._offsets)

    def _measure_offset(self) -> None:
        """Before any callback sampled the clocks: sandwich markers between host reads
        (blocks for well under a millisecond)."""
        queue = self._cl_queues["compute"]
        pyopencl = runtime.cl()
        for _ in range(9):
            marker = pyopencl.enqueue_marker(queue)
            marker.wait()
            t1 = time.monotonic_ns()
            self._offsets.append(t1 - int(marker.profile.end))

    # -- the pump ------------------------------------------------------------------------------

    async def _start(self, nursery: trio.Nursery) -> None:
        # start_soon, not start: a cancellation during nursery.start leaves the child in
        # start's own nursery (trio ignores started() there), where the shielded pump would
        # keep start waiting forever.
        nursery.start_soon(self._pump)
        try:
            await super()._start(nursery)
        except BaseException:
            # A set-up cut short (a cancellation, a failed start): a queue whose actor never
            # ran never stops its executor, and the pump ends only once every executor is
            # stopping and drained -- stop them all (what was enqueued still completes).
            for executor in self._executors():
                executor.stop()
            raise
        for _ in range(_SEED_PROBES):
            self._executors()[0].probe()

    def _executors(self) -> list[ClExecutor]:
        return [a.engine for a in self._queues.values()]  # type: ignore[misc]

    def _wake_pump(self) -> None:
        if not self._fd_closed:
            os.eventfd_write(self._fd, 1)

    async def _pump(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._pump_running = True
        self._loop = threading.get_ident()
        task_status.started()
        executors = self._executors()
        try:
            try:
                await self._pump_loop(executors, cancelled=False)
            except trio.Cancelled:  # completions must still be seen: go on, shielded
                with trio.CancelScope(shield=True):
                    await self._pump_loop(executors, cancelled=True)
                raise
        finally:
            self._pump_running = False

    async def _pump_loop(self, executors: list[ClExecutor], *, cancelled: bool) -> None:
        """Until every executor has stopped with nothing pending (cancelled: or was never
        started, when the device was left while opening)."""
        check = max(self.hang_limit / 3, 0.001) if not math.isinf(self.hang_limit) else 3600.0
        while True:
            self._drain(executors)
            for ex in executors:  # room in the window: the backlog's next runs
                ex.refill()
            if self._lingering:
                self._linger()
            ended = all(e.finished or (cancelled and e.unused) for e in executors)
            if ended and not self._lingering:
                return
            if self._hung and all(e.stopping for e in executors):
                self._abandon(executors)
                return
            if self._lingering:  # a callback between its eventfd write and `done`
                await trio.sleep(0.0002)
                continue
            with trio.move_on_after(check) as scope:
                await trio.lowlevel.wait_readable(self._fd)
                # the tasks the same callback woke (a fence's waiter) go first: our work
                # (another device's step, bookkeeping) is not what they wait for
                await trio.lowlevel.cancel_shielded_checkpoint()
            if scope.cancelled_caught:  # no callback meanwhile: did a command fail?
                self._check_failed(executors)
            try:
                os.eventfd_read(self._fd)
            except BlockingIOError:
                pass

    def _tidy(self, executor: ClExecutor) -> None:
        """After an enqueue on the loop's thread (the device runs meanwhile): process the
        segments the callback completed by itself, which did not wake the pump."""
        pending = executor.pending
        if pending and pending[0].words[runtime.FIRED] and threading.get_ident() == self._loop:
            self._drain([executor])

    def _drain(self, executors: list[ClExecutor]) -> bool:
        """Process every fired segment, oldest first per queue; True if any was."""
        progress = False
        for ex in executors:
            pending = ex.pending
            while pending and pending[0].words[runtime.FIRED]:
                seg = pending.popleft()
                progress = True
                ex.complete(seg)
                self._sample(seg)
                seg.keep = []  # host copies are complete: dropping their events can't block
                if seg.words[runtime.DONE]:
                    self._slots.give(seg.words, seg.address)
                else:
                    self._lingering.append(seg)
            ex.note_exit()
        return progress

    def _unsampled(self) -> bool:
        """A completion that takes no clock sample (counted): True; False when this one
        should (then it goes through :meth:`_sample`, which counts it)."""
        if len(self._offsets) >= 16 and (self._sampled + 1) % 256:
            self._sampled += 1
            return True
        return False

    def _sample(self, seg: Segment) -> None:
        self._sampled += 1
        if len(self._offsets) >= 16 and self._sampled % 256:
            return
        host = int(seg.words[runtime.HOST_NS])
        try:
            end = int(seg.event.profile.end)
        except runtime.cl().Error:
            return
        if host and end:
            self._offsets.append(host - end)

    def _linger(self) -> None:
        still = []
        for seg in self._lingering:
            if seg.words[runtime.DONE]:
                self._slots.give(seg.words, seg.address)
            else:
                still.append(seg)
        self._lingering = still

    def _check_failed(self, executors: list[ClExecutor]) -> None:
        """No completion for half the hang limit: did the driver fail a command?"""
        for ex in executors:
            for seg in list(ex.pending):
                if seg.words[runtime.FIRED]:
                    continue  # called back (a later driver does for failures): drained next
                status = int(seg.event.command_execution_status)
                if status < 0:
                    ex.pending.remove(seg)
                    self._slots.abandon(seg.words)
                    runtime.keep_forever(seg)
                    ex.fail(seg, status, called_back=False)

    def _abandon(self, executors: list[ClExecutor]) -> None:
        """Hung: what the driver may still complete keeps its slots and memory for good."""
        for ex in executors:
            for seg in ex.pending:
                self._slots.abandon(seg.words)
                runtime.keep_forever(seg)
            if not ex.exited.value:
                ex.exited._set_from_engine(1)  # its queue actor stops waiting; memory stays
        for seg in self._lingering:
            self._slots.abandon(seg.words)
        self._lingering = []

    # -- lifetime --------------------------------------------------------------------------

    def _release(self) -> None:
        for actor in self._queues.values():  # no Wait may name its commands any more
            runtime.producers.pop(actor.signal, None)
        super()._release()
        if self._hung or any(e.alive for e in self._executors()) or self._pump_running:
            return  # the driver may still complete commands: keep the fd and memory
        if not self._fd_closed:
            self._fd_closed = True
            os.close(self._fd)
        self._cl_queues.clear()
