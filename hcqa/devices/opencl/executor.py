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
driver call; the copies call PyOpenCL's native entry points directly. A queue sent again
(or a graph) sends runs of launches as a ``ClRun``, enqueued by one native call
(``runs.py``). Every command's event is kept until its segment completes: PoCL 3 aborts the
process when it marks an event the application already released as failed (a command
behind one the driver failed). ``Wait``
reaches the executor only as a :class:`~hcqa.devices.opencl.waits.Gate`, a Wait the driver
keeps (``waits.py``: the next driver command takes the producer's event in its wait list);
any other Wait the queue actor awaits on the loop and only then hands over what follows (host
gating).

What must happen *after* commands complete -- ``Signal``, ``Timestamp``, ``Step`` -- is
collected into a *segment* (``completion.py``) that ends at the last driver command before
it (or at a marker, when the run has none): the native callback is registered on that
command's event with a slot of its own (``runtime.py``). When the device's pump (a trio task
of the device, see ``device.py``) finds the slot fired, it does the segment's work in order
on the loop: timestamps from the events' profiling counters moved to the host clock (a ``Timestamp``
right before a command takes its START, any other the END of the segment's last command;
``Signal.timestamp`` is on the host clock for every device), signal values
(``_set_from_engine``) and timeline steps (``Timeline.complete``). The in-order queue makes
segments complete in the order they were enqueued, so the pump takes them from the front.

The host objects a command reads or fills (the numpy array of a copy, PyOpenCL's
``NannyEvent`` of it, a file mapping: ``copies.py``) stay referenced by the segment until
its completion is processed: dropping a ``NannyEvent`` earlier would block the interpreter
in its destructor.

Tracing: while a :class:`~hcqa.Tracer` records, each enqueued command keeps its event, and
the pump adds a device range per command from its profiling START and END moved to the host
clock (``clock_offset_ns``), with the flow arrows the queue actor announced; signals are then
all set by the pump, after their producer range is recorded.

A bounded window: at most ``WINDOW`` segments of a queue are in the driver at once; runs put
beyond that wait in the executor's backlog, in order, and the pump hands them over as the
driver completes segments (``refill``; while a backlog waits, every completion wakes the
pump). A driver can't take back what it was given, so this is what bounds a cancelled close:
once the device's error is set (a cancellation, a fault) the backlog is skipped at once --
signals broken, other devices' steps completed -- and the close waits only for the window.

Faults: a driver call that fails while enqueueing faults the device at once (a
:class:`~hcqa.errors.DeviceFault` with the CL error as its cause); from then on nothing is
enqueued, and the signals of skipped commands are broken, as an engine does. A command that
fails *inside* the driver produces no callback on PoCL 3, so the pump checks the status of
pending events when no segment completed for half the hang limit (see ``device.py``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from hcqa import commands as cmd
from hcqa.actors import engine as _engine
from hcqa.devices.opencl import runtime
from hcqa.devices.opencl.completion import Completion, Segment, describe
from hcqa.devices.opencl.copies import DriverCopies
from hcqa.devices.opencl.lean import LeanEnqueue
from hcqa.devices.opencl.runs import ClRun, NativeRuns, one_cpu
from hcqa.devices.opencl.waits import Gate, hold, wait_list
from hcqa.signals import Signal

__all__ = ["ClExecutor", "Segment"]

_EXEC, _COPY, _LOAD, _RUN = cmd.Exec, cmd.Copy, cmd.Load, ClRun
_SIGNAL, _STEP, _STAMP, _BARRIER = cmd.Signal, cmd.Step, cmd.Timestamp, cmd.MemoryBarrier
_BIND = cmd.Bind
# Segments of one queue in the driver at once (see the module doc): enough to keep a device
# fed while the pump refills, few enough that a cancelled close waits for little.
WINDOW = 4


class ClExecutor(DriverCopies, NativeRuns, Completion, LeanEnqueue):
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
        self.backlog: collections.deque[list[Any]] = collections.deque()  # runs past the window
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
        self._own: Signal | None = None  # this queue's signal (set by the device)
        self._bound: list[Any] = [{}]  # the values of the latest Bind (see program.Patched)
        self._served: Any = None  # tracing: the served source of the run being enqueued
        # (one CPU for the process: a run's launches wait for a gate, ``runs.py``)
        self._gate_context = int(device.context.int_ptr) if one_cpu() else 0

    def hold(self, signal: Signal, value: int) -> Gate | None:
        """A Gate for ``Wait(signal, value)`` when the driver can keep it (``waits.py``)."""
        return hold(self, signal, value)

    # -- the Executor interface -------------------------------------------------------------

    def start(self) -> None:
        self._started = True

    def put(self, run: list[Any] | None) -> None:
        """Enqueue ``run`` now (never blocks); ``None``: stop once what was queued is done."""
        if run is None:
            self.refill()
            with self._lock:
                self._stopping = True
                for seg in self.pending:  # every completion from now on wakes the pump
                    seg.words[runtime.WAKE] = 1
            self.note_exit()  # nothing to wait for (the pump may be gone)
            self.device._wake_pump()  # (a syscall: the stores above are seen before it)
            return
        with self._lock:
            if self.backlog or len(self.pending) >= WINDOW:  # the driver has enough
                first = not self.backlog
                self.backlog.append(run)
                if not first:
                    return
                for seg in self.pending:  # their completions wake the pump to refill
                    seg.words[runtime.WAKE] = 1
            else:
                self._put_now(run)
                return
        # A segment that fired before it saw ``wake`` did not wake the pump: wake it now (the
        # callback stores ``fired`` before it reads ``wake``; this write follows ours).
        self.device._wake_pump()

    def _put_now(self, run: list[Any]) -> None:
        try:
            self._enqueue_run(run)
        except BaseException as exc:  # the driver refused a marker or a callback
            self._on_fault(None, exc)

    def refill(self) -> None:
        """Hand the driver backlog runs while the window has room (the pump, after it
        processed completions); skip the whole backlog once the device's error is set."""
        if not self.backlog:
            return
        with self._lock:
            backlog = self.backlog
            if self.error is not None:
                while backlog:
                    self._skip(backlog.popleft(), self.error)
            while backlog and len(self.pending) < WINDOW:
                self._put_now(backlog.popleft())
        # A stopping queue's last backlog runs may all have completed inside their enqueue
        # (the lean path lists no segment for them): no drain will see it finish, so say so here
        self.note_exit()

    def note_exit(self) -> None:
        """Set :attr:`exited` once the queue is stopping with nothing pending or backlogged
        (the loop's thread: a drain, a refill, the stop)."""
        if self._stopping and not self.pending and not self.backlog and not self.exited.value:
            self.exited._set_from_engine(1)

    def run_inline(self, run: list[Any]) -> None:
        self.put(run)  # the device runs nothing inline: enqueueing is already immediate

    def stop(self) -> None:
        self.put(None)

    def join(self, timeout: float | None = None) -> bool:
        return not self.pending

    @property
    def alive(self) -> bool:
        """True while the driver may still run (or complete) commands of this queue."""
        return bool(self.pending or self.backlog)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def unused(self) -> bool:
        """Never started (its actor was cancelled first) and nothing was put."""
        return not self._started and not self.pending and not self.backlog

    @property
    def finished(self) -> bool:
        return self._stopping and not self.pending and not self.backlog

    # -- enqueueing (the submitting thread) --------------------------------------------------

    def _enqueue_run(self, run: list[Any]) -> None:
        if len(run) < 5 and self._gate is None and self._lean(run):
            return
        hook = _engine.trace_hook  # tracing: ranges from the profiling counters, at completion
        traced: list[tuple[Any, Any]] | None = None
        flows: Any = None
        if hook is not None:  # (every kernel a range of its own: a native run's one by one)
            run = [x for c in run for x in (c.execs if type(c) is _RUN else (c,))]
            traced = []
            flows, self._served = hook._driver_run(self, run)  # the flows into it, who sent it
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
                wait_for = wait_list(gate)
                gate = None
                try:
                    last = self._low._enqueue_marker_with_wait_list(queue, wait_for)
                except BaseException as exc:
                    self._on_fault(None, exc)
                    self._skip(run[i:], self.error)
                    keep = []
                    break
                keep.append(last)
            if kind is _EXEC or kind is _COPY or kind is _LOAD or kind is _RUN:
                if books:
                    self._close(last, books, keep, what, traced, flows, gates)
                    books, keep, last, gates = [], [], None, None
                    traced, flows = ([] if traced is not None else None), None
                if not keep:
                    keep.append(run)  # the commands (their buffers) until the segment completes
                first, mark = c, len(keep)
                try:
                    if kind is _RUN:  # launches enqueued by one native call (runs.py)
                        wait_for = None
                        if gate is not None:
                            wait_for = wait_list(gate)
                            gates = gate if gates is None else gates + gate
                            gate = None
                        head, last = self._run(c, keep, wait_for, bool(starts))
                        if head is not None:  # a Timestamp before it takes its START
                            mark = len(keep)
                            keep.append(head)
                        keep.append(last)
                    elif gate is not None:  # the first command after Gates waits for them
                        wait_for = wait_list(gate)
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
                    what = describe(first)
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
            elif kind is _BIND:  # values for the launches after it patched in place
                self._bound[0] = c.values
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
            seg.traced, seg.flows, served = traced, flows, self._served
            if served is not None:  # the run's first segment takes the arrow, all its tag
                seg.served, self._served = served, (None, served[1])
        elif books:
            seg.books = self._native_stores(seg, books)
            if not seg.books and not self.backlog:  # all done by the callback: the pump
                words[runtime.WAKE] = 0  # may find it later (unless it must refill)
        self.pending.append(seg)
        status = self._native.register(event, seg.address)
        if status != 0:
            raise RuntimeError(f"clSetEventCallback failed with OpenCL status {status}")

    def probe(self) -> None:
        """A marker with a callback and nothing to do: a clock-offset sample."""
        with self._lock:
            self._close(None, [], [], "marker")
            self.queue.flush()

    def _skip(self, commands: list[Any], error: BaseException | None) -> None:
        """Not running ``commands``: break their signals; complete other devices' steps."""
        for c in commands:
            kind = type(c)
            if kind is _SIGNAL and error is not None:
                c.signal._break(error)
            elif kind is _STEP and c.timeline is not self.timeline:
                c.timeline.complete(c.seq)
