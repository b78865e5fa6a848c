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

import ctypes
import math
import os
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from hcqa import commands as cmd
from hcqa.errors import DeviceClosed, InvalidCommand
from hcqa.signals import Fence

if TYPE_CHECKING:
    from hcqa.actors.actor import QueueActor
    from hcqa.devices.base import Device
    from hcqa.devices.memory import HostMemory

__all__ = [
    "Buffer",
    "Hazards",
    "check_int",
    "check_plain_dtype",
    "check_size",
    "hazard_waits",
    "host_ref",
    "typed_size",
]


def check_size(name: str, value: object, *, minimum: int = 0) -> int:
    """``value`` as an int >= minimum, with the house error messages."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidCommand(f"{name!r} must be an int (got {type(value).__name__})")
    if value < minimum:
        raise InvalidCommand(f"{name!r} must be >= {minimum} (got {value})")
    return int(value)


def check_int(name: str, value: object, *, minimum: int) -> int:
    """``value``, a plain int >= minimum (no bools, no numpy ints), with the house error
    messages: for counts and settings, where :func:`check_size` takes sizes."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidCommand(f"{name!r} must be an int (got {type(value).__name__})")
    if value < minimum:
        raise InvalidCommand(f"{name!r} must be >= {minimum} (got {value})")
    return value


def check_plain_dtype(what: str, dt: np.dtype[Any]) -> None:
    """Refuse dtypes whose bytes are not plain data: Python objects (alone or inside a
    structured dtype) would hand raw pointers to engines and kernels."""
    if dt.hasobject:
        raise InvalidCommand(f"{what} must be a plain, non-object dtype (got {dt})")
    if dt.itemsize == 0:
        raise InvalidCommand(f"{what} must be a fixed-size dtype (got {dt}, of 0 bytes)")


def check_sample(
    what: str, x: object, shape: tuple[int, ...], dtype: np.dtype[Any]
) -> npt.NDArray[Any]:
    """``x`` as an array, if it is ``dtype`` of ``shape``; else an ``InvalidCommand`` that says
    what was expected, what was seen, and how to convert it (a Python list of floats becomes
    float64, of ints int64: ``np.asarray(x, dtype=...)`` makes the dtype expected)."""
    arr = np.asarray(x)
    if arr.shape == shape and arr.dtype == dtype:
        return arr
    got = f"{arr.dtype}{list(arr.shape)}"
    if isinstance(x, (list, tuple)):
        got += f" from a Python {type(x).__name__}"
    message = f"{what} must be {dtype}{list(shape)} (got {got})"
    if arr.dtype != dtype:
        message += f"; convert it with np.asarray(x, dtype={dtype_expr(dtype)})"
    raise InvalidCommand(message)


def dtype_expr(dtype: np.dtype[Any]) -> str:
    """How to write ``dtype`` in Python: ``np.float32``, or its string where numpy has no name."""
    named = getattr(np, dtype.name, None)
    if named is dtype.type and np.dtype(named) == dtype:
        return f"np.{dtype.name}"
    return repr(str(dtype))


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
        for q, v in hz.reads.items():
            if q is not actor:
                _after(need, q, v)
    if not need:
        return []
    return [cmd.Wait(signal=q.signal, value=v) for q, v in need.items()]


def _after(need: dict[QueueActor, int], q: QueueActor, v: int) -> None:
    """Wait for ``q`` to reach ``v`` (unless it has, or a higher wait on it is needed)."""
    if q.signal.value < v and need.get(q, 0) < v:
        need[q] = v


def _free(device: Device, mem: HostMemory, lent: set[int]) -> None:
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
        device: Device,
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


def check_shape(shape: object, what: str = "'shape'") -> tuple[int, ...]:
    """``shape`` as a tuple: an int, or a sequence (tuple, list, 1-d array) of ints, each
    > 0 (numpy integers too; never a bool or a str). Every shape hcqa takes follows this
    rule (``alloc``, ``view``, a pipeline's ``in_shape`` and ``out_shape``, a batcher's
    ``sample_shape``)."""
    if isinstance(shape, int | np.integer) and not isinstance(shape, bool):
        dims: tuple[Any, ...] = (shape,)
    elif isinstance(shape, Sequence) and not isinstance(shape, str | bytes):
        dims = tuple(shape)
    elif isinstance(shape, np.ndarray) and shape.ndim == 1:
        dims = tuple(shape.tolist())
    else:
        dims = (None,)
    if not all(isinstance(d, int | np.integer) and not isinstance(d, bool) and d > 0 for d in dims):
        raise InvalidCommand(
            f"{what} must be an int or a sequence of positive ints (got {shape!r})"
        )
    return tuple(int(d) for d in dims)


def _typed(
    nbytes: int | None, dtype: npt.DTypeLike | None, shape: Sequence[int] | int | None
) -> tuple[np.dtype[Any] | None, tuple[int, ...] | None]:
    """Check ``dtype`` / ``shape`` against ``nbytes``; the dtype and shape to keep."""
    if dtype is None:
        if shape is not None:
            raise InvalidCommand("'shape' needs a 'dtype' (got shape without dtype)")
        return None, None
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise InvalidCommand(f"'dtype' must be a numpy dtype (got {dtype!r})") from exc
    check_plain_dtype("'dtype'", dt)
    if shape is None:
        if nbytes is None or nbytes % dt.itemsize:
            raise InvalidCommand(
                f"'nbytes' must be a multiple of {dt} itemsize {dt.itemsize} (got {nbytes})"
            )
        return dt, (nbytes // dt.itemsize,)
    shape = check_shape(shape)
    need = math.prod(shape) * dt.itemsize
    if nbytes is not None and nbytes != need:
        raise InvalidCommand(
            f"'nbytes' must equal shape {shape} x {dt} = {need} bytes (got {nbytes})"
        )
    return dt, shape


def typed_size(
    nbytes: int | None, dtype: npt.DTypeLike | None, shape: Sequence[int] | int | None
) -> tuple[int, np.dtype[Any] | None, tuple[int, ...] | None]:
    """Resolve ``alloc``'s arguments into (nbytes, dtype, shape)."""
    if nbytes is not None:
        nbytes = check_size("nbytes", nbytes, minimum=1)
    dt, shp = _typed(nbytes, dtype, shape)
    if nbytes is None:
        if dt is None or shp is None:
            raise InvalidCommand("alloc() needs 'nbytes' or 'shape' and 'dtype' (got neither)")
        nbytes = math.prod(shp) * dt.itemsize
    return nbytes, dt, shp


def _data_pointer_offset() -> int | None:
    """Where a numpy array object keeps its data pointer: numpy's array struct starts with
    it, right after the object header. Checked against numpy's own answer on arrays that
    own their memory, view another's and borrow a bytes object's; None (so the slower
    public way is taken) if any differs."""
    at = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)  # refcount, type
    samples = (np.zeros(3), np.arange(8, dtype=np.uint8)[3:], np.frombuffer(b"hcqa", np.uint8))
    for a in samples:
        if ctypes.c_void_p.from_address(id(a) + at).value != a.__array_interface__["data"][0]:
            return None
    return at


_DATA_AT = _data_pointer_offset()
_pointer_at = ctypes.c_void_p.from_address


def array_address(arr: npt.NDArray[Any]) -> int:
    """The address of ``arr``'s first byte. A copy's hot path: read straight from the array
    object (0.15 us) rather than through ``__array_interface__``, which builds a dict each
    time (1.7 us)."""
    if _DATA_AT is not None and type(arr) is np.ndarray:
        return _pointer_at(id(arr) + _DATA_AT).value or 0
    return int(arr.__array_interface__["data"][0])


_host_memory_ref = cmd.maker(cmd.HostMemoryRef)  # (va_addr, nbytes, keep)


def host_ref(obj: Any, buf: Buffer, *, writable: bool) -> cmd.HostMemoryRef:
    """Check a host array for copyin (writable=False) / copyout (writable=True)."""
    what = "copyout" if writable else "copyin"
    if isinstance(obj, np.ndarray):
        arr = obj
        check_plain_dtype(f"{what}: the host array's dtype", arr.dtype)
        if buf.dtype is not None and arr.dtype != buf.dtype:
            how = (
                f"np.empty({buf.shape}, dtype={dtype_expr(buf.dtype)})"
                if writable
                else f"np.asarray(x, dtype={dtype_expr(buf.dtype)})"
            )
            raise InvalidCommand(f"{what}: dtype must be {buf.dtype} (got {arr.dtype}); pass {how}")
        if writable:
            if not arr.flags.c_contiguous or not arr.flags.writeable:
                raise InvalidCommand(
                    f"{what}: the array must be writable and C-contiguous "
                    f"(got contiguous={arr.flags.c_contiguous}, writable={arr.flags.writeable})"
                )
        elif not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        if writable and (isinstance(obj, bytes) or (isinstance(obj, memoryview) and obj.readonly)):
            raise InvalidCommand(
                f"{what}: the destination must be writable (got {type(obj).__name__})"
            )
        if isinstance(obj, memoryview) and ("O" in obj.format or not obj.c_contiguous):
            raise InvalidCommand(
                f"{what}: a memoryview must be C-contiguous plain data "
                f"(got format {obj.format!r}, contiguous={obj.c_contiguous})"
            )
        try:
            arr = np.frombuffer(obj, dtype=np.uint8)
        except (ValueError, BufferError, TypeError) as exc:
            raise InvalidCommand(f"{what}: need a contiguous buffer (got {exc})") from exc
    else:
        raise InvalidCommand(
            f"{what} needs a numpy array, bytes, bytearray or memoryview (got {type(obj).__name__})"
        )
    if arr.nbytes != buf.nbytes:
        raise InvalidCommand(
            f"{what}: host data must be {buf.nbytes} bytes, the buffer's size "
            f"(got {arr.nbytes}; use buf.view() for part of a buffer)"
        )
    if isinstance(obj, np.ndarray) and buf.shape is not None and obj.shape != buf.shape:
        raise InvalidCommand(
            f"{what}: shape must be {buf.shape}, the buffer's (got {obj.shape}; "
            "reshape the array to match)"
        )
    return _host_memory_ref(array_address(arr), arr.nbytes, (obj, arr))
