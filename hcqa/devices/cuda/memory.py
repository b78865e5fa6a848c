"""Device memory of a CUDA device: ``cuMemAlloc`` blocks behind hcqa Buffers.

Theory of operation
-------------------
:class:`CuAllocator` has the interface of the core's caching allocator (``alloc``, ``free``,
``retire``, ``charge``, ``uncharge``, ``statistics``, ``free_cache``, ``close``) and serves
:class:`CuMemory` blocks: one ``cuMemAlloc`` each (plain device memory, never managed
memory), in the size classes of host memory, freed blocks cached for reuse (LRU, evicted
when a new block would pass the capacity, or when the driver says it is out of memory).

A block's ``address`` is its real device pointer: a Buffer's ``va_addr`` (address + view
offset) is what a kernel argument or a copy takes. The host never dereferences it (the
device is not host-visible). A block freed while commands that use it are queued stays
valid: those commands hold the hcqa Buffer until their completion is processed.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from hcqa.devices.cuda import driver as drv
from hcqa.devices.memory import AllocatorStatistics, size_class
from hcqa.errors import InvalidCommand, OutOfMemory

__all__ = ["CuAllocator", "CuMemory"]

_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


class CuMemory:
    """One ``cuMemAlloc`` block of ``capacity`` bytes at ``address``, serving ``nbytes``."""

    fd = None  # never shared with other processes
    charged = 0

    def __init__(self, address: int, capacity: int, ctx: Any) -> None:
        self.address = address
        self.capacity = capacity
        self._nbytes = capacity
        self._ctx = ctx
        self._closed = False

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def closed(self) -> bool:
        return self._closed

    def _resize(self, nbytes: int) -> None:
        self._nbytes = nbytes

    def close(self) -> None:
        """``cuMemFree`` (idempotent)."""
        if self._closed:
            return
        self._closed = True
        driver, _ = drv.bindings()
        try:
            drv.current(self._ctx)
        except drv.CudaError:
            return  # a broken context (a GPU fault): nothing to free it with
        driver.cuMemFree(self.address)  # (an error here is a broken context's: ignored)

    def __repr__(self) -> str:
        return f"<CuMemory {self._nbytes} bytes at {self.address:#x}>"


class CuAllocator:
    """Size-classed ``cuMemAlloc`` blocks with an LRU cache of freed ones."""

    def __init__(self, *, capacity: int, name: str, ctx: Any) -> None:
        self._lock = threading.RLock()  # a collected Buffer frees from any thread
        self.capacity = capacity
        self.name = name
        self._ctx = ctx
        self._live: dict[int, CuMemory] = {}
        self._lru: collections.OrderedDict[int, CuMemory] = collections.OrderedDict()
        self._used = self._cached = self._hits = self._misses = 0
        self._closed = False

    def alloc(self, nbytes: int) -> CuMemory:
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
                block = CuMemory(self._driver_alloc(size, nbytes), size, self._ctx)
                self._misses += 1
            block._resize(nbytes)
            self._live[id(block)] = block
            self._used += size
            return block

    def _driver_alloc(self, size: int, nbytes: int) -> int:
        driver, _ = drv.bindings()
        drv.current(self._ctx)
        while True:
            try:
                return int(drv.check("cuMemAlloc", driver.cuMemAlloc(size)))
            except drv.CudaError as exc:
                if exc.code == _OUT_OF_MEMORY and self._lru:
                    self._evict_oldest()  # cached blocks first, then try again
                    continue
                raise OutOfMemory(
                    f"{self.name}: CUDA could not allocate {size} bytes for 'nbytes' "
                    f"{nbytes}: {exc}"
                ) from exc

    def charge(self, nbytes: int) -> None:
        raise InvalidCommand(f"{self.name}: CUDA memory can't be shared with other processes")

    def uncharge(self, nbytes: int) -> None:
        pass

    def free(self, block: CuMemory) -> None:
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
        """Free every block, live ones included (idempotent)."""
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
