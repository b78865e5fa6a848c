"""Device memory of an OpenCL device: ``cl.Buffer`` blocks behind hcqa Buffers.

Theory of operation
-------------------
:class:`ClAllocator`, a :class:`~hcqa.devices.driverpool.DriverPool` (the caching allocator
every driver backend shares), serves :class:`ClMemory` blocks: one ``cl.Buffer`` each, in the
size classes of host memory, with freed blocks cached for reuse (LRU, evicted when a new block
would pass the capacity).

The host never addresses this memory: a block's ``address`` is a made-up device address
(unique within the device, never dereferenced) so that hcqa Buffers and their views keep
``va_addr`` arithmetic; kernels and copies use ``clbuf`` and the view's ``offset``. A kernel
argument that is a view starting past the buffer's start is a sub-buffer, made once per
(offset, size) and released with the block; OpenCL requires its start to be aligned to the
device's base address alignment.

A block handed back while commands that use it are still queued stays valid: those commands
hold the hcqa Buffer (and so the block) until their completion is processed.
"""

from __future__ import annotations

from typing import Any

from hcqa.devices.driverpool import DriverPool
from hcqa.errors import InvalidCommand, OutOfMemory

__all__ = ["ClAllocator", "ClMemory"]

_VA_BASE = 1 << 44  # where made-up device addresses start


class ClMemory:
    """One ``cl.Buffer`` (``clbuf``) of ``capacity`` bytes serving ``nbytes``."""

    fd = None  # never shared with other processes
    charged = 0

    def __init__(self, clbuf: Any, capacity: int, address: int, align: int) -> None:
        self.clbuf = clbuf
        self.capacity = capacity
        self.address = address
        self._nbytes = capacity
        self._align = align
        self._subs: dict[tuple[int, int], Any] = {}

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def closed(self) -> bool:
        return self.clbuf is None

    def _resize(self, nbytes: int) -> None:
        self._nbytes = nbytes

    def arg(self, offset: int, nbytes: int) -> Any:
        """The kernel argument for ``[offset, offset + nbytes)``: the buffer, or a sub-buffer."""
        if offset == 0:
            return self.clbuf
        sub = self._subs.get((offset, nbytes))
        if sub is None:
            if offset % self._align:
                raise InvalidCommand(
                    f"a view passed to an OpenCL kernel must start at a multiple of "
                    f"{self._align} bytes of its buffer (got offset {offset})"
                )
            sub = self._subs[(offset, nbytes)] = self.clbuf.get_sub_region(offset, nbytes)
        return sub

    def close(self) -> None:
        """Release the OpenCL memory (idempotent)."""
        clbuf, self.clbuf = self.clbuf, None
        subs, self._subs = self._subs, {}
        for sub in subs.values():
            sub.release()
        if clbuf is not None:
            clbuf.release()

    def __repr__(self) -> str:
        return f"<ClMemory {self._nbytes} bytes at {self.address:#x}>"


class ClAllocator(DriverPool[ClMemory]):
    """Size-classed ``cl.Buffer`` blocks with an LRU cache of freed ones (``DriverPool``)."""

    driver = "OpenCL"

    def __init__(self, *, capacity: int, name: str, context: Any, align: int) -> None:
        super().__init__(capacity=capacity, name=name)
        self._context = context
        self._align = align
        self._next_va = _VA_BASE

    def _new_block(self, size: int, nbytes: int) -> ClMemory:
        from hcqa.devices.opencl.runtime import cl

        pyopencl = cl()
        try:
            clbuf = pyopencl.Buffer(self._context, pyopencl.mem_flags.READ_WRITE, size)
        except pyopencl.Error as exc:
            raise OutOfMemory(
                f"{self.name}: OpenCL could not allocate {size} bytes: {exc}"
            ) from exc
        block = ClMemory(clbuf, size, self._next_va, self._align)
        self._next_va += size
        return block
