"""The executor of one OpenCL device queue: runs of commands become driver commands.

Theory of operation
-------------------
A :class:`ClExecutor` stands where a cpu device has an engine thread, with the same interface
(``put``, ``stop``, ``join``, ``exited``, ``error``), but it has no thread: ``put(run)`` is
called on the submitting thread (the trio thread) and only *enqueues*, in queue order, on the
queue's own in-order ``cl.CommandQueue`` (profiling on): ``Exec`` is
``clEnqueueNDRangeKernel`` with NDRange ``global * local`` (hcqa counts work-groups),
``Copy`` a buffer copy, write or read, ``Load`` a write from the file mapped into memory (the
driver's thread takes the page faults). Each of these calls returns in microseconds; nothing
here waits for the device. Consecutive launches go through one tight loop: each ``Exec`` keeps
its launch record (``ClProgram.record``) on the command, so a resubmitted one is a single
driver call; the copies call PyOpenCL's native entry points directly. Every command's event is
kept until its segment completes: PoCL 3 aborts the process when it marks an event the
application already released as failed (a command behind one the driver failed). ``Wait``
reaches the executor only as a :class:`Gate`, see below; any other Wait the queue actor awaits on
the loop and only then hands over what follows (host gating).

Waits the driver keeps: a Wait on the queue signal of an OpenCL queue in the same context (this
device's other queue, or another hcqa device's on the same platform) whose producing command is
already enqueued needs no host: :meth:`ClExecutor.hold` finds the producer's segment (the first
pending one that sets its queue signal to the value or beyond) and returns a :class:`Gate`
holding its event, which the actor puts in the run in the Wait's place. The next driver
command enqueued after it takes the event in its wait list (a marker does, when a ``Signal``,
``Step`` or ``Timestamp`` comes first); a gate at the end of a run waits for the next run's
first command. The host still gates everything else: a producer not yet enqueued (behind a
host wait of its own), a signal set by the host, another process, a cpu device or another
context. Semantics are those of the host wait (``>=`` on the 64-bit value: the producer's
queue signal only grows). A producer that fails in the driver fails the commands waiting on it
(OpenCL propagates the error status); the waiter's fault is then the producer's fault, the very
instance (:meth:`ClExecutor.fail` has the producer's device find its failure first).

What must happen *after* commands complete -- ``Signal``, ``Timestamp``, ``Step`` -- is
collected into a *segment* that ends at the last driver command before it (or at a marker,
when the run has none): the native callback is registered on that command's event with a slot
of its own (``runtime.py``). When the device's pump (a trio task of the device, see
``device.py``) finds the slot fired, it does the segment's work in order on the loop:
timestamps from the events' profiling counters moved to the host clock (a ``Timestamp``
right before a command takes its START, any other the END of the segment's last command;
``Signal.timestamp`` is on the host clock for every device), signal values
(``_set_from_engine``) and timeline steps (``Timeline.complete``). The in-order queue makes
segments complete in the order they were enqueued, so the pump takes them from the front.

The host objects a command reads or fills (the numpy array of a copy, PyOpenCL's
``NannyEvent`` of it, a file mapping) stay referenced by the segment until its completion
is processed: dropping a ``NannyEvent`` earlier would block the interpreter in its destructor.

Tracing: while a :class:`~hcqa.Tracer` records, each enqueued command keeps its event, and
the pump adds a device range per command from its profiling START and END moved to the host
clock (``clock_offset_ns``), with the flow arrows the queue actor announced; signals are then
all set by the pump, after their producer range is recorded.

Faults: a driver call that fails while enqueueing faults the device at once (a
:class:`~hcqa.errors.DeviceFault` with the CL error as its cause); from then on nothing is
enqueued, and the signals of skipped commands are broken, as an engine does. A command that
fails *inside* the driver produces no callback on PoCL 3, so the pump checks the status of
pending events when no segment completed for half the hang limit (see ``device.py``).
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from hcqa import commands as cmd
from hcqa.actors import engine as _engine
from hcqa.devices.buffer import Buffer
from hcqa.devices.opencl import runtime
from hcqa.devices.opencl.memory import ClMemory
from hcqa.devices.timeline import WRAP, _value
from hcqa.errors import DeviceFault
from hcqa.signals import Signal

__all__ = ["ClExecutor", "Gate", "Segment"]

_EXEC, _COPY, _LOAD = cmd.Exec, cmd.Copy, cmd.Load
_SIGNAL, _STEP, _STAMP, _BARRIER = cmd.Signal, cmd.Step, cmd.Timestamp, cmd.MemoryBarrier
_ADDRESS_ALIGN = mmap.ALLOCATIONGRANULARITY
_NO_HANDLERS: dict[type, Any] = {}  # what a tracer wraps for a run: nothing runs on the host


class Gate:
    """A Wait the driver keeps (see the module doc): the commands after it wait for
    ``segment`` of the ``producer`` queue, whose ``event`` completes once its queue signal
    reached ``value`` or more (``event`` None: the producer is this queue, in order)."""

    __slots__ = ("event", "producer", "segment", "signal", "value")

    def __init__(
        self, event: Any, producer: ClExecutor, segment: Segment, signal: Signal, value: int
    ):
        self.event = event
        self.producer = producer
        self.segment = segment
        self.signal = signal
        self.value = value


class Segment:
    """Driver commands up to ``event`` and the work to do once it completed."""

    __slots__ = (
        "address", "books", "event", "flows", "foreign", "gates", "keep", "own", "traced",
        "what", "words",
    )  # fmt: skip

    def __init__(self, event: Any, books: list[tuple[Any, ...]], keep: list[Any], what: str):
        self.traced: list[tuple[Any, Any]] | None = None  # (command, event) while tracing
        self.flows: Any = None  # a tracer's flow sources into this segment's first range
        self.event = event
        # ("stamp", signal, event or None, start?) / ("signal", signal, value) / ("step", tl, seq)
        self.books = books
        self.keep = keep  # commands and host objects the driver may still touch
        self.what = what
        self.words: Any = None
        self.address = 0
        self.foreign: tuple[Any, int] | None = None  # (timeline, seq) the callback completes
        self.own = 0  # the value it sets its queue's signal to (0: none): what Gates look for
        self.gates: list[Gate] | None = None  # the driver-kept waits its commands wait for


class ClExecutor:
    """Enqueues runs on one in-order OpenCL queue; completion through the device's pump."""

    def __init__(
        self,
        device: runtime.ClHost,
        kind: str,
        queue: Any,
        *,
        on_fault: Callable[[Any, BaseException], None],
    ) -> None:
        self.name = f"{device.name} {kind}"
        self.kind = kind
        self.device = device
        self.queue = queue
        self.error: BaseException | None = None
        self.timeline: Any = None
        self.exited = Signal(name=f"{self.name} executor exit")
        self.pending: collections.deque[Segment] = collections.deque()
        self.completed = 0  # segments processed: the pump's measure of progress
        self._on_fault = on_fault
        self._lock = threading.Lock()  # put() from two threads must not interleave runs
        self._stopping = False
        self._started = False
        self._ordered = -1  # the last step the callback completes itself (see _native_stores)
        self._cl = runtime.cl()
        self._native = runtime.native()
        self._low = self._cl._cl  # the driver calls themselves (PyOpenCL's native module)
        self._launch = self._low.enqueue_nd_range_kernel
        self._gate: list[Gate] | None = None  # Gates the next driver command waits for
        self._own: Signal | None = None  # this queue's signal (set by the device at start)

    # -- waits the driver keeps -------------------------------------------------------------

    def hold(self, signal: Signal, value: int) -> Gate | None:
        """A :class:`Gate` for ``Wait(signal, value)`` when the driver can keep it (see the
        module doc), else None: the host must gate it."""
        producer = runtime.producers.get(signal)
        if producer is None or self.error is not None or producer.error is not None:
            return None
        if producer.device.context is not self.device.context:
            return None
        pending = producer.pending
        found: Segment | None = None
        i = len(pending) - 1
        while i >= 0:  # values grow left to right: the last few are the likely ones
            try:
                seg = pending[i]
            except IndexError:  # (another thread's put can't shrink it; be safe anyway)
                break
            own = seg.own
            if own:
                if own < value:
                    break
                found = seg
            i -= 1
        if found is None:  # not enqueued yet (or completed and broken): the host gates
            return None
        return Gate(None if producer is self else found.event, producer, found, signal, value)

    # -- the Executor interface -------------------------------------------------------------

    def start(self) -> None:
        self._started = True

    def put(self, run: list[Any] | None) -> None:
        """Enqueue ``run`` now (never blocks); ``None``: stop once what was queued is done."""
        if run is None:
            with self._lock:
                self._stopping = True
                for seg in self.pending:  # every completion from now on wakes the pump
                    seg.words[runtime.WAKE] = 1
                idle = not self.pending
            if idle and not self.exited.value:  # nothing to wait for (the pump may be gone)
                self.exited._set_from_engine(1)
            self.device._wake_pump()  # (a syscall: the stores above are seen before it)
            return
        with self._lock:
            try:
                self._enqueue_run(run)
            except BaseException as exc:  # the driver refused a marker or a callback
                self._on_fault(None, exc)

    def run_inline(self, run: list[Any]) -> None:
        self.put(run)  # the device runs nothing inline: enqueueing is already immediate

    def stop(self) -> None:
        self.put(None)

    def join(self, timeout: float | None = None) -> bool:
        return not self.pending

    @property
    def alive(self) -> bool:
        """True while the driver may still run (or complete) commands of this queue."""
        return bool(self.pending)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def unused(self) -> bool:
        """Never started (its actor was cancelled first) and nothing was put."""
        return not self._started and not self.pending

    @property
    def finished(self) -> bool:
        return self._stopping and not self.pending

    # -- enqueueing (the submitting thread) --------------------------------------------------

    def _enqueue_run(self, run: list[Any]) -> None:
        hook = _engine.trace_hook  # tracing: ranges from the profiling counters, at completion
        traced: list[tuple[Any, Any]] | None = None
        flows: Any = None
        if hook is not None:
            traced = []
            track = hook._engines.get(self) or hook._track(self)
            hook.engine_run(self, run, _NO_HANDLERS)  # takes the flows waiting for this run
            flows, track.pending = track.pending, None
        books: list[tuple[Any, ...]] = []
        starts: list[Any] = []  # Timestamps that take the next command's START
        keep: list[Any] = []
        gates: list[Gate] | None = None  # the Gates this segment's commands waited for
        gate = self._gate  # Gates the next driver command waits for (None: none)
        last: Any = None
        what = ""
        queue, launch = self.queue, self._launch
        n = len(run)
        i = 0
        while i < n:
            c = run[i]
            if self.error is not None:
                self._skip(run[i:], self.error)
                break
            kind = type(c)
            if gate is not None and (kind is _SIGNAL or kind is _STEP or kind is _STAMP):
                # what follows a driver-kept wait completes after it: a marker that waits
                if books:
                    self._close(last, books, keep, what, traced, flows, gates)
                    books, keep, last, gates = [], [], None, None
                    traced, flows = ([] if traced is not None else None), None
                if not keep:
                    keep.append(run)
                gates = gate if gates is None else gates + gate
                wait_for = [g.event for g in gate if g.event is not None] or None
                gate = None
                try:
                    last = self._low._enqueue_marker_with_wait_list(queue, wait_for)
                except BaseException as exc:
                    self._on_fault(None, exc)
                    self._skip(run[i:], self.error)
                    keep = []
                    break
                keep.append(last)
            if kind is _EXEC or kind is _COPY or kind is _LOAD:
                if books:
                    self._close(last, books, keep, what, traced, flows, gates)
                    books, keep, last, gates = [], [], None, None
                    traced, flows = ([] if traced is not None else None), None
                if not keep:
                    keep.append(run)  # the commands (their buffers) until the segment completes
                first, mark = c, len(keep)
                try:
                    if gate is not None:  # the first command after Gates waits for them
                        wait_for = [g.event for g in gate if g.event is not None] or None
                        gates = gate if gates is None else gates + gate
                        gate = None
                        if kind is _EXEC:
                            rec = self._record(c)
                            last = launch(queue, rec[0], rec[1], rec[2], None, wait_for)
                        else:
                            last = self._enqueue(c, keep, wait_for)
                        keep.append(last)
                        mark = len(keep) - 1
                        if traced is not None:
                            traced.append((c, last))
                    elif kind is not _EXEC:
                        last = self._enqueue(c, keep, None)
                        keep.append(last)  # PoCL touches failed events' successors: keep all
                        mark = len(keep) - 1
                        if traced is not None:
                            traced.append((c, last))
                    else:  # the hot path: consecutive launches, one driver call each
                        end = i + 1
                        while end < n and type(run[end]) is _EXEC:
                            end += 1
                        append = keep.append
                        start = i
                        for i in range(start, end):  # (i, c: the command a fault names)
                            c = run[i]
                            rec = c.native
                            if rec is None:
                                rec = self._record(c)
                            elif rec[3] is not c.program.cl_args:
                                c.program.set_args(rec[3])
                            last = launch(queue, rec[0], rec[1], rec[2])
                            append(last)
                            if traced is not None:
                                traced.append((c, last))
                except BaseException as exc:
                    self._on_fault(c, exc)
                    self._skip(run[i:], self.error)
                    keep = []
                    break
                i += 1
                if not what:
                    what = _describe(first)
                if starts:  # they take the START of the first command after them
                    books.extend(("stamp", s, keep[mark], True) for s in starts)
                    starts = []
                continue
            elif kind is _SIGNAL or kind is _STEP:
                if starts:  # no command follows them first: they stamp this segment's end
                    books.extend(("stamp", s, None, False) for s in starts)
                    starts = []
                if kind is _SIGNAL:
                    books.append(("signal", c.signal, c.value))
                else:
                    books.append(("step", c.timeline, c.seq))
            elif kind is _STAMP:
                if last is None and not books:
                    starts.append(c.signal)
                else:
                    books.append(("stamp", c.signal, None, False))
            elif kind is Gate:  # a Wait the driver keeps: the next command waits for it
                if starts:  # Timestamps before the wait: taken before it, at this segment's end
                    books.extend(("stamp", s, None, False) for s in starts)
                    starts = []
                gate = [c] if gate is None else [*gate, c]
            elif kind is not _BARRIER:  # (an in-order queue orders memory at command ends)
                unknown = TypeError(f"{self.name} has no handler for {kind.__name__} commands")
                self._on_fault(c, unknown)
                self._skip(run[i:], self.error)
                break
            i += 1
        self._gate = gate if self.error is None else None
        books.extend(("stamp", s, None, False) for s in starts)
        self._end(last, books, keep, what, traced, flows, gates)

    def _end(
        self,
        last: Any,
        books: list[tuple[Any, ...]],
        keep: list[Any],
        what: str,
        traced: list[tuple[Any, Any]] | None,
        flows: Any,
        gates: list[Gate] | None,
    ) -> None:
        """A run's end: close its last segment, flush, tidy."""
        if books or keep:
            self._close(last, books, keep, what, traced, flows, gates)
        self.queue.flush()
        self.device._tidy(self)  # segments the callback finished without waking the pump

    def _record(self, c: Any) -> Any:
        """``c``'s launch record (made at its first launch), its arguments set on the kernel."""
        rec = c.native
        if rec is None:
            rec = c.program.record(c)
            object.__setattr__(c, "native", rec)
        if rec[3] is not c.program.cl_args:
            c.program.set_args(rec[3])
        return rec

    def _close(
        self,
        event: Any,
        books: list[tuple[Any, ...]],
        keep: list[Any],
        what: str,
        traced: list[tuple[Any, Any]] | None = None,
        flows: Any = None,
        gates: list[Gate] | None = None,
    ) -> None:
        """End a segment at ``event`` (a marker when None) and register its callback."""
        if event is None:
            event = self._low._enqueue_marker(self.queue)
            what = what or "marker"
        seg = Segment(event, books, keep, what)
        own = self._own
        for book in books:  # (two or three books: the queue signal is among the last)
            if book[1] is own and book[0] == "signal":
                seg.own = book[2]
        seg.gates = gates
        seg.words, seg.address = words, _ = self.device._slots.take()
        if traced is not None:  # the pump sets every signal after recording its producer
            seg.traced, seg.flows = traced, flows
        elif books:
            seg.books = self._native_stores(seg, books)
            if not seg.books:  # all done by the callback: the pump may find it later
                words[runtime.WAKE] = 0
        self.pending.append(seg)
        status = self._native.register(event, seg.address)
        if status != 0:
            raise RuntimeError(f"clSetEventCallback failed with OpenCL status {status}")

    def _native_stores(self, seg: Segment, books: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Let the callback itself complete what needs no Python, while nothing before it
        does (a timestamp, say): this queue's own signal, and this device's timeline step
        -- through the device's C timeline (``hcqa/_native/lane.py``), which keeps the
        completed prefix, the wrap and the wake-ups whatever order steps complete in; or,
        without one, directly when every earlier step is done or enqueued before it on this
        queue (the pump then does the Python timeline's bookkeeping). The waiters of those
        wake straight from the driver's thread. Returns the books left to the pump."""
        words = seg.words
        own = self.device._queues[self.kind].signal
        timeline = self.timeline
        c_timeline = timeline.c_address
        left: list[tuple[Any, ...]] = []
        n = 0
        native = True
        for book in books:
            if native and book[0] == "signal" and book[1] is own and n < runtime.MAX_STORES:
                self._store(words, n, own, book[2])
                n += 1
                continue
            if native and book[0] == "step" and book[1] is timeline:
                seq = book[2]
                if c_timeline is not None:
                    words[runtime.TL_FN] = self._native.tl_complete
                    words[runtime.TL_ARG] = c_timeline
                    words[runtime.TL_SEQ] = seq
                    native = False  # what follows waits for the pump
                    last = len(books) > 1 and book is books[-2]  # only a step follows
                    foreign = self._foreign_step(books[-1], words) if last else None
                    if foreign is not None:  # a transfer's step on the other device
                        seg.foreign = foreign
                        words[runtime.NSTORES] = n
                        return left
                    continue
                in_order = seq - 1 <= timeline.done or seq - 1 == self._ordered
                if in_order and seq % WRAP != 1 and n < runtime.MAX_STORES:
                    self._store(words, n, timeline.signals[(seq - 1) // WRAP % 2], _value(seq))
                    n += 1
                    self._ordered = seq
            else:
                native = False
            left.append(book)
        words[runtime.NSTORES] = n
        return left

    def _foreign_step(self, book: tuple[Any, ...], words: Any) -> tuple[Any, int] | None:
        """Hand the callback a transfer's last step, on the other device's C timeline (an
        OpenCL device's, or a cpu device's that this copy writes to): (timeline, seq), or
        None to leave it to the pump. The callback completes the step under that timeline's
        mutex, and its owner takes the mutex before it closes anything the callback touches
        (``Timeline.close``)."""
        if book[0] != "step":
            return None
        tl, seq = book[1], book[2]
        if tl.c_address is None:
            return None
        if not tl.take_foreign(seq):
            return None
        words[runtime.TL2_FN] = self._native.tl_complete
        words[runtime.TL2_ARG] = tl.c_address
        words[runtime.TL2_SEQ] = seq
        return tl, seq

    @staticmethod
    def _store(words: Any, i: int, signal: Signal, value: int) -> None:
        base = runtime.STORES + 3 * i
        words[base] = signal.address
        words[base + 1] = value
        words[base + 2] = signal.fd

    def probe(self) -> None:
        """A marker with a callback and nothing to do: a clock-offset sample."""
        with self._lock:
            self._close(None, [], [], "marker")
            self.queue.flush()

    def _enqueue(self, c: Any, keep: list[Any], wait_for: list[Any] | None) -> Any:
        """A copy or a load, after the events ``wait_for``: its driver command's event
        (``keep`` gets what it touches)."""
        kind = type(c)
        if kind is _COPY:
            return self._copy(c.dest, c.src, c.nbytes, keep, wait_for)
        return self._load(c, keep, wait_for)

    def _copy(
        self, dest: Any, src: Any, n: int, keep: list[Any], wait_for: list[Any] | None
    ) -> Any:
        """The driver's own entry points, not ``pyopencl.enqueue_copy`` (which dispatches on
        its arguments' types in Python first): a host end is a non-blocking write or read."""
        low = self._low
        d_mem, s_mem = _device_memory(dest), _device_memory(src)
        if d_mem is not None and s_mem is not None:
            if d_mem is s_mem and abs(dest.offset - src.offset) < n:  # overlapping: as memmove
                if dest.offset == src.offset:  # a copy onto itself: nothing to move
                    return low._enqueue_marker_with_wait_list(self.queue, wait_for)
                bounce = self._cl.Buffer(self.device.context, self._cl.mem_flags.READ_WRITE, n)
                keep.append(bounce)
                keep.append(
                    low._enqueue_copy_buffer(
                        self.queue, s_mem.clbuf, bounce, n, src.offset, 0, wait_for
                    )
                )
                return low._enqueue_copy_buffer(
                    self.queue, bounce, d_mem.clbuf, n, 0, dest.offset, None
                )
            return low._enqueue_copy_buffer(
                self.queue, s_mem.clbuf, d_mem.clbuf, n, src.offset, dest.offset, wait_for
            )
        if d_mem is not None:
            host = _host_array(src, n)
            nanny = low._enqueue_write_buffer(
                self.queue, d_mem.clbuf, host, dest.offset, wait_for, False
            )
        elif s_mem is not None:
            host = _host_array(dest, n)
            nanny = low._enqueue_read_buffer(
                self.queue, s_mem.clbuf, host, src.offset, wait_for, False
            )
        else:
            raise TypeError(f"{self.name}: a copy between two host ends belongs to a cpu device")
        keep.append(host)
        keep.append(nanny)  # dropped only once completed (its destructor would block)
        return nanny

    def _load(self, c: Any, keep: list[Any], wait_for: list[Any] | None) -> Any:
        mem = _device_memory(c.dest)
        assert mem is not None
        start = c.offset - c.offset % _ADDRESS_ALIGN
        skip = c.offset - start
        fd = os.open(c.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < c.offset + c.nbytes:
                raise EOFError(f"{c.path!r} holds fewer than {c.offset + c.nbytes} bytes now")
            mapping = mmap.mmap(fd, skip + c.nbytes, prot=mmap.PROT_READ, offset=start)
        finally:
            os.close(fd)
        host = np.frombuffer(mapping, dtype=np.uint8, count=c.nbytes, offset=skip)
        nanny = self._low._enqueue_write_buffer(
            self.queue, mem.clbuf, host, c.dest.offset, wait_for, False
        )
        keep.extend((nanny, host, mapping))  # the nanny goes first, the mapping last
        return nanny

    def _skip(self, commands: list[Any], error: BaseException | None) -> None:
        """Not running ``commands``: break their signals; complete other devices' steps."""
        for c in commands:
            kind = type(c)
            if kind is _SIGNAL and error is not None:
                c.signal._break(error)
            elif kind is _STEP and c.timeline is not self.timeline:
                c.timeline.complete(c.seq)

    # -- completion (the pump, on the loop) ---------------------------------------------------

    def complete(self, seg: Segment) -> None:
        """Do a fired segment's work, in order."""
        status = ctypes.c_int64(seg.words[runtime.STATUS]).value
        if status < 0:  # drivers that report failures through the callback (PoCL >= 7)
            self.fail(seg, status)
            return
        if seg.traced is not None:
            self._trace(seg)
        offset: int | None = None
        for book in seg.books:
            op = book[0]
            if op == "signal":
                book[1]._set_from_engine(book[2])
            elif op == "step":
                book[1].complete(book[2])
            else:  # Signal.timestamp is on the host clock: one offset for the whole segment
                if offset is None:
                    offset = self.device.clock_offset_ns()
                ev = book[2] if book[2] is not None else seg.event
                ns = ev.profile.start if book[3] else ev.profile.end
                book[1]._stamp_from_engine(ns + offset)
        self.completed += 1

    def _trace(self, seg: Segment) -> None:
        """Device ranges of a traced segment, from its events' profiling counters moved to
        the host clock, and the producers of the signals it sets (for flow arrows)."""
        hook = _engine.trace_hook
        if hook is None:
            return
        track = hook._engines.get(self) or hook._track(self)
        offset = self.device.clock_offset_ns()
        if seg.flows:
            track.pending = seg.flows
        if seg.gates:  # driver-kept waits: arrows from their producers' last ranges
            track.pending = [*(track.pending or ()), *_sources(hook, seg.gates)]
        for command, event in seg.traced or ():
            profile = event.profile
            hook._range(track, command, profile.start + offset, profile.end + offset, None)
        for book in seg.books:
            if book[0] == "signal" and track.last is not None:
                hook._produced_by(book[1], book[2], track.last)

    def fail(self, seg: Segment, status: int, *, called_back: bool = True) -> None:
        """The driver failed ``seg``'s commands: fault the device, skip the bookkeeping
        (``called_back``: False when its callback never ran and never will). A segment that
        waited for another queue's commands in the driver (Gates) failed because they did,
        when one of them did: the fault is then the producer's own, the same instance."""
        fault = self._producers_fault(seg)
        if fault is None:
            fault = DeviceFault(
                f"{self.device.name}: {seg.what} failed on the {self.kind} queue: the OpenCL "
                f"driver reported execution status {status} for it",
                device=self.device.name,
                queue=self.kind,
            )
        self.device._fault(fault)
        for book in seg.books:
            if book[0] == "signal":
                book[1]._break(self.device._error)
            elif book[0] == "step" and book[1] is not self.timeline:
                book[1].complete(book[2])
        if seg.foreign is not None and not called_back:  # the other device may close
            tl, seq = seg.foreign
            tl._native.tl_complete(tl.c_address, seq, 1)

    def _producers_fault(self, seg: Segment) -> BaseException | None:
        """The fault of a producer ``seg`` waited for in the driver: its device's sticky
        error, once that device has looked for failures among its pending commands."""
        for gate in seg.gates or ():
            producer = gate.producer
            if producer is self:
                continue
            owner = producer.device
            if owner._error is None:
                owner._check_failed([producer])  # a failure found here faults the producer
            if owner._error is not None:
                return owner._error
        return None


def _sources(hook: Any, gates: list[Gate]) -> list[tuple[int, int, int, int]]:
    """Flow sources (pid, tid, start, end on the host clock) of ``gates``' producers: the
    range their producing segment's last command drew (or will draw) in the trace."""
    out = []
    for gate in gates:
        traced = gate.segment.traced
        if not traced or gate.event is None:  # untraced, or this queue's own (no arrow)
            continue
        try:
            profile = traced[-1][1].profile
            offset = gate.producer.device.clock_offset_ns()
            t0, t1 = int(profile.start) + offset, int(profile.end) + offset
        except Exception:  # a failed producer has no times: no arrow
            continue
        track = hook._engines.get(gate.producer) or hook._track(gate.producer)
        out.append((track.pid, track.tid, t0, t1))
    return out


def _device_memory(end: Any) -> ClMemory | None:
    if isinstance(end, Buffer) and isinstance(end._mem, ClMemory):
        return end._mem
    return None


def _host_array(end: Any, n: int) -> Any:
    """The host memory of a copy's other end, ``n`` bytes: a host array (copyin, copyout),
    or a buffer of a device whose memory is host memory (a cpu device)."""
    if isinstance(end, cmd.HostMemoryRef):
        arr = end.keep[1]  # the contiguous array host_ref checked
        if arr.nbytes == n:
            return arr
    elif isinstance(end, Buffer):
        return end._mem.view()[end.offset : end.offset + n]
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(end.va_addr))


def _describe(c: Any) -> str:
    if type(c) is _EXEC:
        return f"program {c.program.name!r}"
    if type(c) is _COPY:
        return f"copy of {c.nbytes} bytes"
    return f"load of {c.path!r}"
