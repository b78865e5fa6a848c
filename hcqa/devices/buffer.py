"""Device buffers: memory, views, and the hazards that order work touching them.

Theory of operation
-------------------
A :class:`Buffer` is a range of a device allocation: ``base`` is the buffer
that owns the allocation (``None`` for the owner itself), ``offset`` and
``nbytes`` say where the range lies, ``va_addr`` is its address. A view shares
its base's memory and its base's :class:`Hazards`: two views of one buffer are
treated as overlapping (conservative, never wrong).

Hazards make eager work safe across queues. Every submitted command that
touches a buffer records, on the buffer's hazards, the queue and the value its
queue signal will reach when the command is done: the last write, and the
reads since that write. A later command on *another* queue waits (a ``Wait``
on that queue's signal) for what it conflicts with: a read waits for the last
write; a write waits for the last write and every read. Work on one queue needs
no waits: the queue keeps its order. Waits already satisfied are dropped.

Host copies (``copyin`` / ``copyout`` / ``load``) go through the device's copy
queue and return a :class:`~hcqa.signals.Fence`; ``await`` it, or don't. The
host array is referenced by the queued command until the copy is done.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from hcqa import commands as cmd
from hcqa.devices.sizes import (
    _typed,
    check_size,
)
from hcqa.errors import DeviceClosed, InvalidCommand
from hcqa.signals import Fence, Signal

if TYPE_CHECKING:
    from hcqa.actors.actor import QueueActor
    from hcqa.devices.memory import CachingAllocator, HostMemory

__all__ = ["Buffer", "DeviceRef", "Hazards", "hazard_waits"]


class DeviceRef(Protocol):
    """A :class:`~hcqa.devices.Device` as the modules below it see it: what a buffer, a
    program (``program.py``) and a timed span (``timing.py``) use of their device, and
    the public surface a caller reaches through ``buf.device``. ``Device`` sits above
    these modules (it makes buffers and programs), so they name it through this protocol;
    a ``Device`` is one."""

    name: str
    kind: ClassVar[str]
    host_visible: bool
    hang_limit: float
    shares_native: ClassVar[bool]
    host_memory: ClassVar[bool]
    allocator: CachingAllocator
    compute: QueueActor
    copy: QueueActor
    _queues: dict[str, QueueActor]
    _closed: bool
    _closing: bool

    @property
    def closed(self) -> bool: ...

    @property
    def faulted(self) -> BaseException | None: ...

    @property
    def timeline(self) -> Signal: ...

    def alloc(
        self,
        nbytes: int | None = None,
        *,
        shape: Sequence[int] | int | None = None,
        dtype: npt.DTypeLike | None = None,
        shared: bool = False,
    ) -> Buffer: ...

    async def synchronize(self) -> None: ...

    def clock_offset_ns(self) -> int: ...

    def _check_usable(self) -> None: ...

    def _submit(
        self,
        actor: QueueActor,
        commands: list[Any],
        *,
        reads: Iterable[Buffer] = (),
        writes: Iterable[Buffer] = (),
        also: Sequence[Any] = (),
        waits: bool | None = None,
    ) -> Fence: ...

    def _copyin(self, buf: Buffer, src: Any, *, on_compute: bool = False) -> Fence: ...

    def _copyout(self, buf: Buffer, dest: Any, *, on_compute: bool = False) -> Fence: ...

    def _load(self, buf: Buffer, path: str, offset: int, nbytes: int | None) -> Fence: ...

    def _copyout_queue(self, on_compute: bool) -> QueueActor: ...


class Hazards:
    """The last write and the reads since, per queue, of one allocation."""

    __slots__ = ("reads", "write")

    def __init__(self) -> None:
        self.write: tuple[QueueActor, int] | None = None
        self.reads: dict[QueueActor, int] = {}

    def pending(self) -> bool:
        """True while some recorded use has not completed."""
        if self.write is not None and self.write[0].signal.value < self.write[1]:
            return True
        return any(q.signal.value < v for q, v in self.reads.items())


def hazard_waits(
    actor: QueueActor, reads: Iterable[Buffer], writes: Iterable[Buffer]
) -> list[cmd.Wait]:
    """The Waits a batch on ``actor`` needs before it reads ``reads`` and writes
    ``writes``: on other queues' unfinished writes (and, for a write, reads); one per
    queue, for the highest value needed; none for what is already done. (Called on
    every enqueue: uses recorded by ``actor`` itself cost no call.)"""
    need: dict[QueueActor, int] = {}
    for b in reads:
        w = b._hazards.write
        if w is not None and w[0] is not actor:
            _after(need, *w)
    for b in writes:
        hz = b._hazards
        w = hz.write
        if w is not None and w[0] is not actor:
            _after(need, *w)
    written = set(need)  # queues waited on for a write of theirs
    for b in writes:
        for q, v in b._hazards.reads.items():
            if q is not actor:
                _after(need, q, v)
    if not need:
        return []
    return [cmd.Wait(signal=q.signal, value=v, after_write=q in written) for q, v in need.items()]


def _after(need: dict[QueueActor, int], q: QueueActor, v: int) -> None:
    """Wait for ``q`` to reach ``v`` (unless it has, or a higher wait on it is needed)."""
    if q.signal.value < v and need.get(q, 0) < v:
        need[q] = v


def _free(device: DeviceRef, mem: HostMemory, lent: set[int]) -> None:
    if mem.fd is not None:  # shared memory: not the allocator's
        mem.close()
        if mem.charged:
            device.allocator.uncharge(mem.charged)
            mem.charged = 0
    elif device._closed:
        pass
    elif len(lent):  # a numpy_view() still lives: never hand this memory out again
        device.allocator.retire(mem)
    else:
        device.allocator.free(mem)


class Buffer:
    """Device memory: raw bytes (``dtype=None``) or a typed array of ``shape``."""

    def __init__(
        self,
        device: DeviceRef,
        mem: HostMemory,
        nbytes: int,
        *,
        dtype: np.dtype[Any] | None = None,
        shape: tuple[int, ...] | None = None,
        offset: int = 0,
        base: Buffer | None = None,
    ) -> None:
        self.device = device
        self.nbytes = nbytes
        self.dtype = dtype
        self.shape = shape
        self.offset = offset
        self.base = base
        self._mem = mem
        self.va_addr = mem.address + offset
        self._hazards: Hazards = base._hazards if base is not None else Hazards()
        owner = base if base is not None else self
        self._owner = owner
        self._freed = False
        self._array: npt.NDArray[Any] | None = None
        if base is None:
            # ids of the live anchors of arrays numpy_view() handed out (see _free)
            self._lent: set[int] = set()
            self._finalizer = weakref.finalize(self, _free, device, mem, self._lent)

    # -- views ---------------------------------------------------------------------------

    def view(
        self,
        offset: int,
        nbytes: int,
        *,
        dtype: npt.DTypeLike | None = None,
        shape: Sequence[int] | int | None = None,
    ) -> Buffer:
        """A buffer over ``[offset, offset + nbytes)`` of this one, sharing its memory.
        ``shape``: an int or a sequence of ints (with ``dtype``)."""
        self._check()  # not of a freed buffer, nor on a closed device
        offset = check_size("offset", offset)
        nbytes = check_size("nbytes", nbytes, minimum=1)
        if offset + nbytes > self.nbytes:
            raise InvalidCommand(
                f"view [{offset}, {offset + nbytes}) must lie within the buffer's "
                f"{self.nbytes} bytes (got an end of {offset + nbytes})"
            )
        dt, shp = _typed(nbytes, dtype, shape)
        return Buffer(
            self.device,
            self._mem,
            nbytes,
            dtype=dt,
            shape=shp,
            offset=self.offset + offset,
            base=self._owner,
        )

    def numpy_view(self) -> npt.NDArray[Any]:
        """The buffer's memory as a numpy array (what Python programs receive).

        Only for host-visible devices; reading it while work is queued races that work.
        The array stays safe to hold after ``free()``: memory that a view still covers is
        never handed to another allocation (it is unmapped when the last view goes)."""
        self._check()
        if not self.device.host_visible:
            raise InvalidCommand(
                f"{self.device.name} is not host-visible: use copyout() to read its buffers"
            )
        anchor = self._mem.anchor(self.offset, self.nbytes)
        lent, key = self._owner._lent, id(anchor)
        lent.add(key)
        weakref.finalize(anchor, lent.discard, key)  # set.add / discard: atomic in any thread
        arr = np.frombuffer(memoryview(anchor), self.dtype if self.dtype is not None else np.uint8)
        return arr.reshape(self.shape) if self.shape is not None else arr

    def _kernel_array(self) -> npt.NDArray[Any]:
        arr = self._array
        if arr is None:
            start = self.offset
            raw = self._mem.view()[start : start + self.nbytes]
            arr = raw if self.dtype is None else raw.view(self.dtype)
            if self.shape is not None:
                arr = arr.reshape(self.shape)
            self._array = arr
        return arr

    # -- host copies and files -----------------------------------------------------------

    def copyin(self, src: Any) -> Fence:
        """Copy a host array (or bytes) of exactly ``nbytes`` into the buffer.

        The array is read when the copy *runs*, not now: leave it unchanged until the
        returned fence is reached (hcqa keeps a reference to it until then). A typed
        buffer takes an array of its dtype and shape; a raw one any plain array of its
        size. Not snapshotted: a copy at enqueue would double the memory traffic of every
        transfer, and snapshotting only small arrays would make the rule depend on size."""
        return self.device._copyin(self, src)

    def copyout(self, dest: Any) -> Fence:
        """Copy the buffer into a writable, C-contiguous host array of exactly ``nbytes``
        (of the buffer's dtype and shape, for a typed buffer); it is filled when the copy
        runs: read it once the returned fence is reached."""
        return self.device._copyout(self, dest)

    def load(
        self, path: str | os.PathLike[str], *, offset: int = 0, nbytes: int | None = None
    ) -> Fence:
        """Read ``nbytes`` (default: the buffer size) of a file from ``offset`` into it."""
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidCommand(f"'path' must be a str or os.PathLike (got {type(path).__name__})")
        return self.device._load(self, os.fspath(path), offset, nbytes)

    def export(self) -> tuple[int, dict[str, Any]]:
        """(memfd, description) for another process: see ``Device.import_buffer``.

        Only buffers allocated with ``shared=True`` (and their views) can be exported;
        the buffer keeps owning the fd (send it with SCM_RIGHTS, see ``hcqa.processes.ipc``)."""
        self._check()
        fd = self._mem.fd
        if fd is None:
            raise InvalidCommand(
                "only buffers allocated with alloc(..., shared=True) can be exported "
                "(got an ordinary allocation)"
            )
        meta = {
            "nbytes": self.nbytes,
            "offset": self.offset,
            "dtype": None if self.dtype is None else self.dtype.str,
            "shape": None if self.shape is None else list(self.shape),
        }
        return fd, meta

    def free(self) -> None:
        """Give the memory back now (only the owning buffer, only when no work uses it)."""
        if self.base is not None:
            raise InvalidCommand("free() must be called on the owning buffer, not a view")
        if self._hazards.pending():
            raise InvalidCommand(
                f"buffer of {self.nbytes} bytes on {self.device.name} is still used by "
                "queued work: await its fence before free()"
            )
        self._freed = True
        self._array = None
        self._finalizer()

    def _check(self) -> None:
        if self.device._closed or self.device._closing:
            raise DeviceClosed(f"{self.device.name} is closed")
        if self._owner._freed:
            raise InvalidCommand(f"buffer of {self.nbytes} bytes on {self.device.name} was freed")

    def __repr__(self) -> str:
        typed = f" {self.dtype}{list(self.shape or ())}" if self.dtype is not None else ""
        view = f" view+{self.offset}" if self.base is not None else ""
        return f"<Buffer {self.device.name} {self.nbytes} bytes{typed}{view}>"
