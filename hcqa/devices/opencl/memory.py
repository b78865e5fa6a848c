"""Device memory of an OpenCL device: ``cl.Buffer`` blocks behind hcqa Buffers.

Theory of operation
-------------------
:class:`ClAllocator` has the interface of the core's caching allocator (``alloc``, ``free``,
``retire``, ``charge``, ``uncharge``, ``statistics``, ``free_cache``, ``close``) and serves
:class:`ClMemory` blocks: one ``cl.Buffer`` each, in the size classes of host memory, with
freed blocks cached for reuse (LRU, evicted when a new block would pass the capacity).

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

import collections
import threading
from typing import Any

from hcqa.devices.memory import AllocatorStatistics, size_class
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


class ClAllocator:
    """Size-classed ``cl.Buffer`` blocks with an LRU cache of freed ones."""

    def __init__(self, *, capacity: int, name: str, context: Any, align: int) -> None:
        self._lock = threading.RLock()  # a collected Buffer frees from any thread
        self.capacity = capacity
        self.name = name
        self._context = context
        self._align = align
        self._next_va = _VA_BASE
        self._live: dict[int, ClMemory] = {}
        self._lru: collections.OrderedDict[int, ClMemory] = collections.OrderedDict()
        self._used = self._cached = self._hits = self._misses = 0
        self._closed = False

    def alloc(self, nbytes: int) -> ClMemory:
        from hcqa.devices.opencl.runtime import cl

        size = size_class(nbytes)
        with self._lock:
            if self._closed:
                raise InvalidCommand(f"{self.name}: allocator is closed")
            for key, block in self._lru.items():
                if block.capacity == size:
                    del self._lru[key]
                    self._cached -= size
                    self._hits += 1
                    break
            else:
                if self._used + size > self.capacity:
                    raise OutOfMemory(
                        f"{self.name}: out of memory: 'nbytes' {nbytes} requested, "
                        f"{self.capacity - self._used} of {self.capacity} bytes free"
                    )
                while self._lru and self._used + self._cached + size > self.capacity:
                    self._evict_oldest()
                pyopencl = cl()
                try:
                    clbuf = pyopencl.Buffer(self._context, pyopencl.mem_flags.READ_WRITE, size)
                except pyopencl.Error as exc:
                    raise OutOfMemory(
                        f"{self.name}: OpenCL could not allocate {size} bytes: {exc}"
                    ) from exc
                block = ClMemory(clbuf, size, self._next_va, self._align)
                self._next_va += size
                self._misses += 1
            block._resize(nbytes)
            self._live[id(block)] = block
            self._used += size
            return block

    def charge(self, nbytes: int) -> None:
        raise InvalidCommand(f"{self.name}: OpenCL memory can't be shared with other processes")

    def uncharge(self, nbytes: int) -> None:
        pass

    def free(self, block: ClMemory) -> None:
        with self._lock:
            if self._live.pop(id(block), None) is not block:
                raise InvalidCommand(f"{self.name}: not allocated here: {block!r}")
            self._used -= block.capacity
            if self._closed:
                block.close()
                return
            self._lru[id(block)] = block
            self._cached += block.capacity

    retire = free  # no host view of this memory can exist

    def _evict_oldest(self) -> None:
        _, block = self._lru.popitem(last=False)
        self._cached -= block.capacity
        block.close()

    def free_cache(self) -> None:
        with self._lock:
            while self._lru:
                self._evict_oldest()

    def close(self) -> None:
        """Release every block, live ones included (idempotent)."""
        with self._lock:
            self._closed = True
            self.free_cache()
            for block in self._live.values():
                block.close()

    def statistics(self) -> AllocatorStatistics:
        with self._lock:
            return AllocatorStatistics(
                capacity=self.capacity,
                used=self._used,
                cached=self._cached,
                allocations=len(self._live),
                hits=self._hits,
                misses=self._misses,
            )
