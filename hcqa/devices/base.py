"""The Device: queues, timeline, memory and programs, and the path of one enqueue.

Theory of operation
-------------------
A device owns two :class:`~hcqa.actors.QueueActor` s (``compute`` and
``copy``), each with its executor (an engine thread on the cpu backend), one
:class:`~hcqa.devices.timeline.Timeline`, an allocator and its programs. What a backend
provides is the section "what a backend provides" below (docs/architecture.md, "The
backend seam"); everything else here is the same for every backend.

Everything a user calls -- ``prog(...)``, ``buf.copyin``, ``hcqa.transfer``,
``Queue.submit`` -- ends in :meth:`Device._submit`, which runs on the caller's task and
never blocks:

1. check the device is open and not faulted (a fault is sticky and re-raised);
2. add a ``Wait`` for each buffer hazard on another queue (see ``buffer.py``);
3. append ``Signal(queue signal, v)`` and ``Step(timeline, seq)``;
4. ``send_nowait`` the batch to the queue's channel -- or, for a short copy on an
   idle queue with no hazard (``_inline``), run it at once on the caller's thread --
   record the hazards, and return the timeline's ``Fence`` for ``seq``.

The path of one launch, ``fence = prog(out, a)``, hop by hop:

* ``Program.__call__`` (``program.py``): a repeat of the last call reuses its checked
  ``Exec`` (the launch record), else ``Program.validate`` checks types, devices, counts,
  ranges and geometry and builds the ``Exec``; ``Program._enqueue`` refuses an unbound
  variable, takes the buffers the program reads and writes, and calls
* ``Device._submit`` (here): capture (the graph records the batch instead), the checks,
  the hazard ``Wait`` s, ``Signal`` and ``Step``; then ``QueueActor.run_inline`` or
  ``QueueActor.send_commands`` (``hcqa/actors/actor.py``), which hands a batch without
  ``Wait`` s straight to the executor when the actor is idle, else queues it on the
  channel, where the actor awaits each ``Wait`` and puts the runs between them;
* the executor (``Engine._execute`` in ``hcqa/actors/engine.py`` for the cpu backend)
  runs the ``Exec`` -- a C kernel's ready call, or the backend's handler -- then sets the
  queue signal (``Signal._set_from_engine``) and completes the step
  (``Timeline.complete``), which reaches the returned fence and wakes its waiter.

Errors are sticky: the first fault (a kernel or copy raising in an engine, or a
Wait that broke) is stored in ``_error`` and breaks the device's signals with
that instance; later enqueues raise it, later waits raise it (``faults.py``).
"""

from __future__ import annotations

import functools
import mmap
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import numpy.typing as npt
import trio

from hcqa import aio
from hcqa import commands as cmd
from hcqa.actors import Engine, Executor, QueueActor, QueueStatistics
from hcqa.actors import engine as _engine
from hcqa.actors.actor import LOST
from hcqa.devices.buffer import Buffer, hazard_waits
from hcqa.devices.builder import QueueBuilder
from hcqa.devices.capture import capturing as _capturing
from hcqa.devices.faults import Faults
from hcqa.devices.hostcopies import HostCopies
from hcqa.devices.lifetime import Lifetime
from hcqa.devices.memory import AllocatorStatistics, CachingAllocator, HostMemory
from hcqa.devices.offers import FastPaths
from hcqa.devices.program import Program, check_flags
from hcqa.devices.sizes import check_size, typed_size
from hcqa.devices.timeline import Timeline
from hcqa.devices.timing import TimedSpan
from hcqa.errors import (
    DeviceClosed,
    InvalidCommand,
    QueueFull,
    work_owner,
)
from hcqa.signals import Fence, Signal

if TYPE_CHECKING:
    pass

__all__ = ["Device", "DeviceStatistics"]

# The two commands every batch ends with, made on the launch path (see ``cmd.maker``):
# (signal, value, native) and (timeline, seq, native).
_signal_command = cmd.maker(cmd.Signal)
_step_command = cmd.maker(cmd.Step)
_copy_command = cmd.maker(cmd.Copy)  # (dest, src, nbytes, native): a host copy's command


@attrs.frozen(kw_only=True)
class DeviceStatistics:
    """What :meth:`Device.statistics` reports."""

    name: str
    timeline_value: int
    timeline_reserved: int
    queues: tuple[QueueStatistics, ...]
    memory: AllocatorStatistics
    faulted: bool
    hung: bool
    closed: bool


class Device(Faults, HostCopies, Lifetime, FastPaths):
    """Base class of the devices (``cpu:N``, ``opencl:N``, ``cuda:N``;
    ``hcqa.devices.backends`` lists the kinds)."""

    kind: ClassVar[str] = "?"
    # The HCQ builder (hcqa.queue.Queue), which registers itself here when imported (``import
    # hcqa`` imports it): the device core sits below the builder and names it only through
    # the QueueBuilder protocol (``builder.py``).
    _queue_class: ClassVar[Callable[[Device, str], QueueBuilder]]
    # True where a buffer's ``va_addr`` is host memory any thread may read and write (cpu);
    # False for driver memory (OpenCL): a transfer to a device of another kind then runs
    # on this device's copy queue, which can read its own memory (see ``transfer``).
    host_memory: ClassVar[bool] = True

    def __init__(
        self,
        name: str,
        *,
        hang_limit: float,
        host_visible: bool,
        queue_depth: int,
        memory: int,
        timeline_start: int = 0,
        inline_kernels: bool = False,
    ) -> None:
        self.name = name
        self.hang_limit = hang_limit
        self.host_visible = host_visible
        self.inline_kernels = inline_kernels  # opt-in: short repeat kernel calls run inline
        try:
            self._build(memory, timeline_start, queue_depth)
        except BaseException:  # (no fd left, say): nothing it made waits for the GC
            self._abandon_build()
            raise

    def _build(self, memory: int, timeline_start: int, queue_depth: int) -> None:
        self.allocator = self._make_allocator(memory)
        self._timeline = Timeline(
            self.name, hang_limit=self.hang_limit, owner=self, start=timeline_start
        )
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._owners = {}
        self._closed = False
        self._closing = False
        self._hung = False
        self._still_read = False
        self._shared: weakref.WeakSet[HostMemory] = weakref.WeakSet()  # memfd-backed memory
        self._made: list[Any] = []  # executors, then signals: closed if the rest fails
        for kind in ("compute", "copy"):
            executor = self._executor(kind)
            self._made.append(executor)
            actor = QueueActor(self, kind, executor, capacity=queue_depth)
            self._made.append(actor.signal)
            setattr(self, kind, actor)
        del self._made
        self._queues = {"compute": self.compute, "copy": self.copy}
        for actor in self._queues.values():
            actor.engine.timeline = self._timeline

    # -- what a backend provides (the seam: see docs/architecture.md) ----------------------

    def _make_allocator(self, capacity: int) -> CachingAllocator:
        """The device's memory: host memory, cached (``memory.py``), unless overridden."""
        return CachingAllocator(capacity=capacity, name=self.name)

    def _make_program(self, name: str, src: Any, **options: Any) -> Program:
        """Build a program from ``src`` now (options: ``entry``, ``writes``, ``reads``,
        ``geometry``, ``flags``: a checked tuple of str); refuse what this backend can't
        run with :class:`InvalidCommand`. May run in a worker thread (``program_async``):
        touch nothing the loop's thread changes."""
        raise NotImplementedError

    def _executor(self, kind: str) -> Executor:
        """What executes the runs of queue ``kind`` (``"compute"`` or ``"copy"``): by
        default an engine thread dispatching through :meth:`_handlers`. A backend that
        runs commands some other way returns its own :class:`~hcqa.actors.Executor`; it
        must report failures through :meth:`_on_engine_fault` (see ``faults.py``)."""
        return Engine(
            f"{self.name} {kind}",
            self._handlers(kind),
            on_fault=lambda command, exc: self._on_engine_fault(kind, command, exc),
            native=self.native_runner,
        )

    def _handlers(self, kind: str) -> dict[type, Callable[[Any], None]]:
        """The engine's handlers for queue ``kind``: ``Exec`` (compute), ``Copy`` and
        ``Load`` (copy); the engine itself does ``Signal``, ``Timestamp``,
        ``MemoryBarrier`` and ``Step``. Only used by the default :meth:`_executor`."""
        raise NotImplementedError

    # -- public surface --------------------------------------------------------------------

    @property
    def timeline(self) -> Signal:
        """The timeline signal of the current epoch (see ``timeline.py``)."""
        return self._timeline.signal

    @property
    def closed(self) -> bool:
        """True once the device's ``open_device`` block is being left."""
        return self._closed or self._closing

    @property
    def faulted(self) -> BaseException | None:
        """The sticky error, if the device faulted or hung."""
        return self._error

    def alloc(
        self,
        nbytes: int | None = None,
        *,
        shape: Sequence[int] | int | None = None,
        dtype: npt.DTypeLike | None = None,
        shared: bool = False,
    ) -> Buffer:
        """Allocate ``nbytes`` raw bytes, or a typed buffer of ``shape`` (an int or a
        sequence of ints: ``256``, ``(16, 16)``, ``[16, 16]``) and ``dtype``.

        ``shared=True`` puts it in memory another process can map (``Buffer.export``)."""
        self._check_usable()
        if not isinstance(shared, bool):
            raise InvalidCommand(f"'shared' must be a bool (got {type(shared).__name__})")
        n, dt, shp = typed_size(nbytes, dtype, shape)  # an int shape becomes (shape,)
        if shared:  # counted against the device's memory like any allocation
            size = -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
            self.allocator.charge(size)
            try:
                mem = HostMemory(n, shareable=True)
            except BaseException:
                self.allocator.uncharge(size)
                raise
            mem.charged = size
            self._shared.add(mem)
        else:
            mem = self.allocator.alloc(n)
        return Buffer(self, mem, n, dtype=dt, shape=shp)

    def import_buffer(
        self,
        fd: int,
        nbytes: int,
        *,
        offset: int = 0,
        dtype: npt.DTypeLike | None = None,
        shape: Sequence[int] | int | None = None,
    ) -> Buffer:
        """A buffer over shared memory exported by another process.

        Takes ownership of ``fd`` when it returns; when it raises (a bad, closed or
        too small fd) the fd is left to the caller."""
        self._check_usable()
        if not self.host_visible:
            raise InvalidCommand(f"{self.name} is not host-visible: it can't map shared memory")
        n, dt, shp = typed_size(nbytes, dtype, shape)
        offset = check_size("offset", offset)
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise InvalidCommand(f"'fd' must be an int file descriptor (got {type(fd).__name__})")
        mem = HostMemory(offset + n, fd=fd)
        self._shared.add(mem)
        whole = Buffer(self, mem, offset + n)
        return whole.view(offset, n, dtype=dt, shape=shp) if offset or dt is not None else whole

    def program(
        self,
        name: str,
        src: Any,
        *,
        entry: str | None = None,
        writes: Sequence[int] | None = None,
        reads: Sequence[int] | None = None,
        geometry: bool = False,
        flags: Sequence[str] = (),
    ) -> Program:
        """A program from a Python callable or C source (``entry`` names the function).

        Builds on the calling thread: a cold C compile or OpenCL build blocks the event
        loop for as long as it takes (tens of milliseconds to seconds). In async code use
        :meth:`program_async`, which builds in a worker thread; this form is for scripts.

        ``geometry=True`` (C only): the kernel's last six ``int`` parameters receive the
        launch geometry ``gx, gy, gz, lx, ly, lz`` (a Python kernel declares keyword-only
        ``global_size`` / ``local_size`` instead).

        ``flags``: compiler flags for this program, a tuple of str -- C flags for a
        ``cpu:N`` C kernel (after hcqa's own ``-std=c11 -shared -fPIC -O2``, so a later
        ``-O3`` or ``-std=`` wins; part of the on-disk cache key), OpenCL build options
        for ``opencl:N``. Refused for a Python callable."""
        options = self._program_options(name, entry, writes, reads, geometry, flags)
        return self._make_program(name, src, **options)

    async def program_async(
        self,
        name: str,
        src: Any,
        *,
        entry: str | None = None,
        writes: Sequence[int] | None = None,
        reads: Sequence[int] | None = None,
        geometry: bool = False,
        flags: Sequence[str] = (),
    ) -> Program:
        """:meth:`program`, built in a worker thread: the event loop keeps running through
        a cold compile or build (also what a fused queue's first submit would load). The
        arguments are checked first, on the caller's task. A cancellation waits for the
        build already running (a compiler is not interrupted) and then raises."""
        if aio.asyncio_caller():
            return await aio.call(
                self.program_async,
                name,
                src,
                entry=entry,
                writes=writes,
                reads=reads,
                geometry=geometry,
                flags=flags,
            )
        options = self._program_options(name, entry, writes, reads, geometry, flags)
        build = functools.partial(self._make_program, name, src, **options)
        prog = await trio.to_thread.run_sync(build)
        self._check_usable()  # closed or faulted while it built
        return prog

    def _program_options(
        self,
        name: object,
        entry: object,
        writes: Sequence[int] | None,
        reads: Sequence[int] | None,
        geometry: bool,
        flags: object,
    ) -> dict[str, Any]:
        """``program()``'s arguments checked (``InvalidCommand``), as ``_make_program``'s
        options."""
        self._check_usable()
        if entry is not None and (not isinstance(entry, str) or not entry):
            raise InvalidCommand(f"'entry' must be a non-empty str or None (got {entry!r})")
        if not isinstance(name, str) or not name:
            raise InvalidCommand(f"'name' must be a non-empty str (got {name!r})")
        return {
            "entry": entry,
            "writes": writes,
            "reads": reads,
            "geometry": geometry,
            "flags": check_flags(flags),
        }

    def compute_queue(self) -> QueueBuilder:
        """An empty :class:`hcqa.Queue` for this device's compute queue (``exec`` etc.;
        typed by its verbs, the ``QueueBuilder`` protocol: the core sits below the builder)."""
        return Device._queue_class(self, "compute")

    def copy_queue(self) -> QueueBuilder:
        """An empty :class:`hcqa.Queue` for this device's copy queue (``copy`` etc.)."""
        return Device._queue_class(self, "copy")

    def timed(self, *, queue: str = "compute") -> TimedSpan:
        """``async with d.timed() as span: ...``: the device time (``span.seconds``, from
        device timestamps) of the work the block queued on this device; see
        ``hcqa/devices/timing.py``. ``queue`` takes the start timestamp."""
        return TimedSpan(self, queue)

    def clock_offset_ns(self) -> int:
        """Nanoseconds to add to this device's own clock (its profiling counters, say) to
        get the host clock (``time.monotonic_ns``, the clock of ``Signal.timestamp``, which
        such a device applies when it stores a timestamp; traces apply it to device
        ranges). A device with a clock of its own overrides this (the model's
        ``_at_profile_finalize``); the engines of a host device stamp with the host clock,
        so the base answer is exactly 0."""
        return 0

    async def synchronize(self) -> None:
        """Wait until everything enqueued so far is done; raise the device's error if any
        (not a batch's that failed alone: its own fence raises that)."""
        if self._closed:
            await aio.checkpoint()
            raise DeviceClosed(f"{self.name} is closed")
        if self._error is not None:
            await aio.checkpoint()
            self._raise_error()
        fence = self._timeline.fence(self._timeline.reserved)
        try:
            await fence.wait()
        except DeviceClosed as exc:  # the last batch failed alone: done, not the device's
            if fence.signal._failed.get(fence.value) is not exc:
                raise
        if self._error is not None:
            self._raise_error()

    def statistics(self) -> DeviceStatistics:
        """A frozen snapshot: timeline, queues, memory, fault and close state."""
        return DeviceStatistics(
            name=self.name,
            timeline_value=self.timeline.value,
            timeline_reserved=self._timeline.reserved,
            queues=(self.compute.statistics(), self.copy.statistics()),
            memory=self.allocator.statistics(),
            faulted=self._error is not None,
            hung=self._hung,
            closed=self.closed,
        )

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("faulted" if self._error else "open")
        return f"<{type(self).__name__} {self.name} {state}>"

    # -- the path of one enqueue (the module doc follows one launch through it) -------------

    def _submit(
        self,
        actor: QueueActor,
        commands: list[Any],
        *,
        reads: Iterable[Buffer] = (),
        writes: Iterable[Buffer] = (),
        also: Sequence[Device] = (),
        waits: bool | None = None,
    ) -> Fence:
        """Send one batch to ``actor``; the Fence of this device's timeline step.

        ``waits``: whether ``commands`` hold a Wait, when the caller knows.

        While a graph is being captured the batch is recorded instead."""
        graph = _capturing.get()
        if graph is not None:
            fence: Fence = graph._record(self, actor, commands, reads, writes, also)
            return fence
        if self._closed or self._closing or self._error is not None:  # (the hot path: no call)
            self._check_usable()
        for other in also:
            other._check_usable()
        if actor.sent - actor.received >= actor.capacity:  # actor.full, without two properties
            raise QueueFull(
                f"{actor.name} queue is full ({actor.capacity} batches pending): "
                "await submit_async() / the fences to apply backpressure"
            )
        if LOST:  # a failed batch left data unwritten (rare: see QueueActor._fail)
            _check_lost(reads, writes)
        batch: list[Any] = hazard_waits(actor, reads, writes)
        inline = (
            not batch  # no hazard to wait for
            and len(commands) == 1
            and self._inline(commands[0])
            and actor.idle()
            and _engine.trace_hook is None  # a tracer records engine runs: keep it exact
        )
        if waits is not None:
            waits = waits or bool(batch)
        batch.extend(commands)
        value = actor.value = actor.value + 1
        batch.append(_signal_command(actor.signal, value, None))
        seq = self._steps(batch, also)
        owner = work_owner.get()
        if owner is not None:
            self._own(actor, value, value, owner, batch)
        if inline:
            actor.run_inline(batch)
        else:
            actor.send_commands(batch, waits)
        for b in reads:
            b._hazards.reads[actor] = value
        for b in writes:
            hz = b._hazards
            hz.write = (actor, value)
            hz.reads.clear()
        return self._timeline.fence(seq)

    def _steps(self, batch: list[Any], also: Iterable[Device]) -> int:
        """Append a batch's last commands to it: the step it takes on this device's
        timeline (its ``seq``, reserved now and returned) and one on each device in
        ``also``."""
        timeline = self._timeline
        seq = timeline.reserve()
        batch.append(_step_command(timeline, seq, None))
        for other in also:
            foreign = other._timeline
            batch.append(_step_command(foreign, foreign.reserve_foreign(), None))
        return seq


def _check_lost(reads: Iterable[Buffer], writes: Iterable[Buffer]) -> None:
    """Refuse a batch that reads what a failed batch was to write (its error, before
    anything is queued); one that writes it makes it valid again."""
    for b in reads:
        cause = LOST.get(b._hazards)
        if cause is not None:
            error = DeviceClosed(f"{b!r} holds no valid data: {cause}")
            error.__cause__ = cause
            raise error
    for b in writes:
        LOST.pop(b._hazards, None)
