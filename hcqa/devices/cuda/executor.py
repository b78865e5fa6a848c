"""The executor of one CUDA device queue: runs of commands become work on its stream.

Theory of operation
-------------------
A :class:`CuExecutor` stands where a cpu device has an engine thread, with the same interface
(``put``, ``stop``, ``join``, ``exited``, ``error``), but has no thread: ``put(run)`` is called
on the submitting thread and only *enqueues*, in queue order, on the queue's own CUDA stream
(non-blocking, one per hcqa queue): ``Exec`` is ``cuLaunchKernel`` (grid ``global_size``,
block ``local_size``), a device-to-device ``Copy`` is ``cuMemcpyDtoDAsync``. Nothing here
waits for the GPU. ``Wait`` never reaches an executor: the queue actor awaits it on the loop.

Host memory is pageable, and a CUDA copy from or to pageable memory may block the calling
thread until the stream gets there. So a copy with a host end (a numpy array, a cpu
device's buffer, a mapped file for ``Load``) goes through the executor's pinned staging
buffer (``cuMemHostAlloc``), chunk by chunk, with the host half of each chunk done *in stream
order* by the C host function ``hcqa_cu_memcpy`` (``cuLaunchHostFunc``): host array →
staging → ``cuMemcpyHtoDAsync``, or ``cuMemcpyDtoHAsync`` → staging → host array. The stream
orders every step, so one staging buffer per stream is enough and the loop never blocks
(``copies.py``, a mixin of the executor; small copies go through pinned blocks of their own).

What must happen *after* commands complete -- ``Signal``, ``Timestamp``, ``Step`` -- is
collected into a *segment* that ends with a host function, ``hcqa_cu_complete``, handed a slot
of its own (``driver.py``). What needs no Python (this queue's own signal, this device's
timeline step, a transfer's step on the other device's C timeline) the host function stores
itself, waking the waiters from the driver's thread; the rest (timestamps, signals of other
queues) the device's pump (``device.py``) does on the loop once it finds the slot fired. A
``Timestamp`` records an event where it stands; a segment that needs times (timestamps,
tracing, a clock sample) records an event right before its host function, whose own stamp of
``CLOCK_MONOTONIC`` then samples the offset between the two clocks.

Faults: a driver call that fails while enqueueing (a refused launch) faults the device at once
(a :class:`~hcqa.errors.DeviceFault` with the :class:`~hcqa.devices.cuda.driver.CudaError` as
its cause); from then on nothing is enqueued and the signals of skipped commands are broken. A
kernel that faults on the GPU breaks the CUDA context for good: no later host function runs,
and the pump finds the error by asking the stream (``cuStreamQuery``) when no completion came
for a third of the hang limit.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from collections.abc import Callable
from typing import Any

from hcqa import commands as cmd
from hcqa.actors import engine as _engine
from hcqa.devices.cuda import driver as drv
from hcqa.devices.cuda.copies import SMALL, STAGING, HostCopies, _Pinned, _Temp
from hcqa.devices.cuda.memory import CuMemory
from hcqa.devices.nativestores import NativeStores
from hcqa.errors import DeviceFault
from hcqa.signals import Signal

__all__ = ["SMALL", "STAGING", "CuExecutor", "Segment", "StreamWait", "_Pinned", "_Temp"]

_EXEC, _COPY, _LOAD = cmd.Exec, cmd.Copy, cmd.Load
_SIGNAL, _STEP, _STAMP, _BARRIER = cmd.Signal, cmd.Step, cmd.Timestamp, cmd.MemoryBarrier


class StreamWait:
    """In a run in the place of a ``Wait``: this stream waits on the GPU for ``event``, recorded
    on the producing stream once the producer's work was on it (``CudaDevice._driver_wait``)."""

    __slots__ = ("event", "signal", "value")

    def __init__(self, event: Any, signal: Any, value: int) -> None:
        self.event = event
        self.signal = signal
        self.value = value


class Segment:
    """Stream work up to a host function, and what to do once it ran."""

    __slots__ = ("address", "books", "end", "events", "flows", "foreign", "hostw", "keep",
                 "served", "temps", "traced", "what", "words")  # fmt: skip

    def __init__(self, books: list[tuple[Any, ...]], keep: list[Any], what: str) -> None:
        self.traced: list[tuple[Any, Any, Any]] | None = None  # (command, start, end event)
        self.flows: Any = None
        self.served: Any = None  # (fed, tag): the served request or batch that sent it
        self.books = (
            books  # ("stamp", signal, event) / ("signal", signal, value) / ("step", tl, seq)
        )
        self.keep = keep  # commands and host objects the stream may still touch
        self.what = what
        self.end: Any = None  # an event right before the host function (times, clock samples)
        self.events: list[Any] = []  # pooled events this segment recorded
        self.temps: list[CuMemory] = []  # device blocks freed once it completed (a bounce)
        self.hostw = 0  # copies into host memory it makes (see ``CudaDevice._host_writes``)
        self.words: Any = None
        self.address = 0
        self.foreign: tuple[Any, int] | None = None


class CuExecutor(HostCopies, NativeStores):
    """Enqueues runs on one CUDA stream; completion through host functions and the pump."""

    def __init__(
        self, device: Any, kind: str, stream: Any, *, on_fault: Callable[[Any, BaseException], None]
    ) -> None:
        self.name = f"{device.name} {kind}"
        self.kind = kind
        self.device = device
        self.stream = stream
        self.handle = int(stream)
        self.error: BaseException | None = None
        self.timeline: Any = None
        self.exited = Signal(name=f"{self.name} executor exit")
        self.pending: collections.deque[Segment] = collections.deque()
        self.completed = 0
        self._on_fault = on_fault
        self._lock = threading.Lock()
        self._stopping = False
        self._started = False
        self._ordered = -1
        self._driver, _ = drv.bindings()
        self._native = drv.native()
        self._launch = self._driver.cuLaunchKernel
        self._staging = 0  # pinned host memory (address), made at the first host copy
        self.segments = 0  # segments closed (every 256th samples the clocks)
        self._blocks: list[int] = []  # free pinned blocks of SMALL bytes
        self._all_blocks: list[int] = []
        self._post: list[tuple[int, int, int]] = []  # the open segment's copies out of blocks
        self._hostw = 0  # the open segment's copies into host memory
        self._served: Any = None  # tracing: the served source of the run being enqueued
        self.enqueued = 0  # the highest value of this queue's signal handed to the stream
        self.own: Signal | None = None  # that signal (known from the first run)
        self.device_waits = 0  # Waits ordered on the GPU (``StreamWait``)

    # -- the Executor interface -------------------------------------------------------------

    def start(self) -> None:
        self._started = True

    def put(self, run: list[Any] | None) -> None:
        """Enqueue ``run`` now (never blocks); ``None``: stop once what was queued is done."""
        if run is None:
            with self._lock:
                self._stopping = True
                for seg in self.pending:
                    seg.words[drv.WAKE] = 1
                idle = not self.pending
            if idle and not self.exited.value:
                self.exited._set_from_engine(1)
            self.device._wake_pump()
            return
        with self._lock:
            try:
                self._enqueue_run(run)
            except BaseException as exc:  # the driver refused an event or a host function
                self._on_fault(None, exc)

    def run_inline(self, run: list[Any]) -> None:
        self.put(run)

    def stop(self) -> None:
        self.put(None)

    def join(self, timeout: float | None = None) -> bool:
        return not self.pending

    @property
    def alive(self) -> bool:
        return bool(self.pending)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def unused(self) -> bool:
        return not self._started and not self.pending

    @property
    def finished(self) -> bool:
        return self._stopping and not self.pending

    # -- enqueueing (the submitting thread) --------------------------------------------------

    def _enqueue_run(self, run: list[Any]) -> None:
        drv.current(self.device.cu_context)
        hook = _engine.trace_hook
        traced: list[tuple[Any, Any, Any]] | None = None
        flows: Any = None
        if hook is not None:
            traced = []
            flows, self._served = hook._driver_run(self, run)  # the flows into it, who sent it
        books: list[tuple[Any, ...]] = []
        keep: list[Any] = []
        seg_events: list[Any] = []
        what = ""
        busy = False  # stream work since the last segment
        stream, launch = self.stream, self._launch
        own = self.own = self.device._queues[self.kind].signal
        for i, c in enumerate(run):
            if self.error is not None:
                self._skip(run[i:], self.error)
                break
            kind = type(c)
            if kind is _EXEC or kind is _COPY or kind is _LOAD:
                if books:
                    self._close(books, keep, seg_events, what, traced, flows)
                    books, keep, seg_events, what = [], [], [], ""
                    traced, flows = ([] if traced is not None else None), None
                if not keep:
                    keep.append(run)
                try:
                    start = self._event(seg_events) if traced is not None else None
                    if kind is _EXEC:
                        rec = c.native
                        if rec is None:
                            rec = c.program.record(c)
                            object.__setattr__(c, "native", rec)
                        g, n = rec[1], rec[2]
                        err = launch(
                            rec[0], g[0], g[1], g[2], n[0], n[1], n[2], 0, stream, rec[3], 0
                        )
                        if int(err[0]):
                            drv.check("cuLaunchKernel", err)
                    elif kind is _COPY:
                        self._copy(c.dest, c.src, c.nbytes, keep)
                    else:
                        self._load(c, keep)
                    if traced is not None:
                        traced.append((c, start, self._event(seg_events)))
                except BaseException as exc:
                    self._on_fault(c, exc)
                    self._skip(run[i:], self.error)
                    break
                busy = True
                what = what or _describe(c)
            elif kind is _SIGNAL:
                books.append(("signal", c.signal, c.value))
                if c.signal is own and c.value > self.enqueued:
                    self.enqueued = c.value
            elif kind is _STEP:
                books.append(("step", c.timeline, c.seq))
            elif kind is _STAMP:
                books.append(("stamp", c.signal, self._event(seg_events)))
            elif kind is StreamWait:  # a Wait the device keeps (``CudaDevice._driver_wait``)
                try:
                    drv.check(
                        "cuStreamWaitEvent", self._driver.cuStreamWaitEvent(stream, c.event, 0)
                    )
                    self.device_waits += 1
                except BaseException as exc:
                    self._on_fault(c, exc)
                    self._skip(run[i:], self.error)
                    break
                finally:  # the wait took the event's state at the call: it may be recorded again
                    self.device._free_events.append(c.event)
            elif kind is not _BARRIER:  # (a stream orders memory at command ends)
                unknown = TypeError(f"{self.name} has no handler for {kind.__name__} commands")
                self._on_fault(c, unknown)
                self._skip(run[i:], self.error)
                break
        if books or busy:
            self._close(books, keep, seg_events, what, traced, flows)
        self.device._tidy(self)

    def _event(self, owned: list[Any]) -> Any:
        """A pooled timing event recorded here on the stream (``owned`` returns it later)."""
        ev = self.device._take_event()
        owned.append(ev)
        drv.check("cuEventRecord", self._driver.cuEventRecord(ev, self.stream))
        return ev

    def _close(
        self,
        books: list[tuple[Any, ...]],
        keep: list[Any],
        events: list[Any],
        what: str,
        traced: list[tuple[Any, Any, Any]] | None = None,
        flows: Any = None,
    ) -> None:
        """End a segment here: its host function, after an event when times are needed."""
        seg = Segment(books, keep, what or "marker")
        seg.events = events
        seg.hostw, self._hostw = self._hostw, 0
        seg.words, seg.address = words, _ = self.device._slots.take()
        self.segments += 1
        if self._post:  # small copy-outs: their host half, made first by the host function
            post, self._post = self._post, []
            pre = (ctypes.c_uint64 * (1 + 3 * len(post)))(len(post))
            for i, (dest, src, n) in enumerate(post):
                pre[1 + 3 * i], pre[2 + 3 * i], pre[3 + 3 * i] = dest, src, n
            keep.append(pre)
            words[drv.PRE] = ctypes.addressof(pre)
        timed = traced is not None or any(b[0] == "stamp" for b in books)
        if timed or self.device._wants_sample(self.segments):
            seg.end = self._event(events)
        if traced is not None:
            seg.traced, seg.flows, served = traced, flows, self._served
            if served is not None:  # the run's first segment takes the arrow, all its tag
                seg.served, self._served = served, (None, served[1])
        elif books:
            seg.books = self._native_stores(seg, books)
            if not seg.books and seg.end is None:
                words[drv.WAKE] = 0  # all done by the host function: the pump finds it later
        self.pending.append(seg)
        try:
            self._native.host_func(self.handle, self._native.complete, seg.address)
        except BaseException:
            self.pending.pop()  # never enqueued: its slot is free again
            self.device._slots.give(words, seg.address)
            raise

    @property
    def _stores_in_callback(self) -> bool:
        return bool(self._native.c_host_functions)  # not through the ctypes fallback

    def probe(self) -> None:
        """A segment with nothing to do but sample the clocks."""
        with self._lock:
            drv.current(self.device.cu_context)
            self._close([], [], [], "marker")

    def _skip(self, commands: list[Any], error: BaseException | None) -> None:
        """Not running ``commands``: break their signals; complete other devices' steps."""
        for c in commands:
            kind = type(c)
            if kind is StreamWait and c.event not in self.device._free_events:
                self.device._free_events.append(c.event)
            elif kind is _SIGNAL and error is not None:
                c.signal._break(error)
            elif kind is _STEP and c.timeline is not self.timeline:
                c.timeline.complete(c.seq)

    # -- completion (the pump, on the loop) ---------------------------------------------------

    def complete(self, seg: Segment) -> None:
        """Do a fired segment's work, in order."""
        if seg.traced is not None:
            self._trace(seg)
        offset: int | None = None
        for book in seg.books:
            op = book[0]
            if op == "signal":
                book[1]._set_from_engine(book[2])
            elif op == "step":
                book[1].complete(book[2])
            else:  # Signal.timestamp is on the host clock
                if offset is None:
                    offset = self.device.clock_offset_ns()
                book[1]._stamp_from_engine(self.device._device_ns(book[2]) + offset)
        self.completed += 1

    def _trace(self, seg: Segment) -> None:
        hook = _engine.trace_hook
        if hook is None:
            return
        offset = self.device.clock_offset_ns()
        ns = self.device._device_ns
        ranges = [(c, ns(start) + offset, ns(end) + offset) for c, start, end in seg.traced or ()]
        track = hook._driver_ranges(self, seg.flows, seg.served, ranges)
        for book in seg.books:
            if book[0] == "signal" and track.last is not None:
                hook._produced_by(book[1], book[2], track.last)

    def fail(self, seg: Segment, reason: str) -> None:
        """The GPU failed ``seg``'s work (its host function never ran and never will)."""
        fault = DeviceFault(
            f"{self.device.name}: {seg.what} failed on the {self.kind} queue: {reason}",
            device=self.device.name,
            queue=self.kind,
        )
        self.device._fault(fault)
        for book in seg.books:
            if book[0] == "signal":
                book[1]._break(self.device._error)
            elif book[0] == "step" and book[1] is not self.timeline:
                book[1].complete(book[2])
        if seg.foreign is not None:  # the other device may close
            tl, seq = seg.foreign
            tl._native.tl_complete(tl.c_address, seq, 1)


def _describe(c: Any) -> str:
    if type(c) is _EXEC:
        return f"program {c.program.name!r}"
    if type(c) is _COPY:
        return f"copy of {c.nbytes} bytes"
    return f"load of {c.path!r}"
