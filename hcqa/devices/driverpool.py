"""A caching allocator for driver memory: the part every driver backend's allocator shares.

Theory of operation
-------------------
A backend whose memory belongs to a driver (an OpenCL ``cl.Buffer``, a CUDA ``cuMemAlloc``
block) serves its Buffers from a :class:`DriverPool`: blocks in the size classes of host
memory (``size_class``), freed blocks kept in an LRU cache for reuse, the oldest evicted when a
new block would pass the capacity. It has the interface of the core's caching allocator
(``alloc``, ``free``, ``retire``, ``charge``, ``uncharge``, ``statistics``, ``free_cache``,
``close``); a backend subclasses it and supplies only ``_new_block(size, nbytes)``, the driver
call that makes a block of ``size`` bytes (called with the pool's lock held; it may call
``_evict_oldest`` to make room when the driver says it is out of memory).

Driver memory can't be shared with other processes (``charge`` refuses), and no host view of
it can exist, so freeing and retiring a block are the same. A collected Buffer frees from any
thread: every method takes the pool's lock.
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, Protocol, TypeVar

from hcqa.devices.memory import AllocatorStatistics, size_class
from hcqa.errors import InvalidCommand, OutOfMemory

__all__ = ["DriverBlock", "DriverPool"]


class DriverBlock(Protocol):
    """What the pool needs of a backend's block."""

    @property
    def capacity(self) -> int: ...

    def _resize(self, nbytes: int) -> None: ...

    def close(self) -> None: ...


B = TypeVar("B", bound=DriverBlock)


class DriverPool(Generic[B]):
    """Size-classed driver blocks with an LRU cache of freed ones (see the module doc).
    ``driver`` names the driver in messages ("OpenCL", "CUDA")."""

    driver = "driver"

    def __init__(self, *, capacity: int, name: str) -> None:
        self._lock = threading.RLock()  # a collected Buffer frees from any thread
        self.capacity = capacity
        self.name = name
        self._live: dict[int, B] = {}
        self._lru: collections.OrderedDict[int, B] = collections.OrderedDict()
        self._used = self._cached = self._hits = self._misses = 0
        self._closed = False

    def _new_block(self, size: int, nbytes: int) -> B:
        raise NotImplementedError

    def alloc(self, nbytes: int) -> B:
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
                block = self._new_block(size, nbytes)
                self._misses += 1
            block._resize(nbytes)
            self._live[id(block)] = block
            self._used += size
            return block

    def charge(self, nbytes: int) -> None:
        raise InvalidCommand(
            f"{self.name}: {self.driver} memory can't be shared with other processes"
        )

    def uncharge(self, nbytes: int) -> None:
        pass

    def free(self, block: B) -> None:
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
