"""Host memory blocks, the caching allocator, the kernel-argument bump allocator, the staging ring.

Theory of operation
-------------------
Everything here is plain bookkeeping: no trio, no threads, no locks. The device that owns an
allocator is the one caller, and it serializes its calls (its actor, or its own lock).

:class:`HostMemory` is one anonymous private mapping (``mmap(-1, size)``, size rounded up to whole
pages). Its ``address`` is stable for its whole life, so engine threads and C kernels can use it as
a raw pointer while numpy sees the same bytes through :meth:`HostMemory.view`. Views export the
mapping's buffer, and Python refuses to unmap a buffer that is exported; so :meth:`HostMemory.close`
unmaps at once when no view survives, and otherwise only drops the block's own reference: the last
surviving view then unmaps it when it is collected. Close never raises and no view ever dangles.

:class:`CachingAllocator` keeps freed blocks mapped and hands them out again, as tinygrad's
``LRUAllocator`` does, because mapping fresh memory is slow. Requests are rounded up to a *size
class*: a whole number of pages up to 1 MiB, the next power of two above it. ``alloc`` reuses the
most recently freed block of the class; when live plus cached bytes would pass ``capacity`` it
unmaps cached blocks, least recently freed first, until the new one fits, and raises
:class:`OutOfMemory` when even an empty cache would not make room.

:class:`BumpAllocator` hands out kernel-argument space: a pointer that only moves forward and wraps
to the start of the region, trusting the timeline to have retired what it overwrites.

:class:`StagingRing` is the round-robin ring of host chunks (4 x 2 MiB by default) through which
copies reach a device whose memory the host can't address. Each chunk remembers the timeline value
that retires its last use; a writer must wait for that value before filling the chunk again. The
ring is small on purpose: a chunk is written by one thread and read at once by another, and a
ring that stays in the caches makes that second copy nearly free, where one as long as the copy
(32 x 2 MiB was) sends every byte through memory twice (``docs/performance.md``).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import mmap
import operator
import os
import stat
import threading
from collections.abc import Callable
from typing import Any, SupportsIndex, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from hcqa._signals.slots import memfd
from hcqa.errors import InvalidCommand, OutOfMemory

__all__ = [
    "AllocatorStatistics",
    "BumpAllocator",
    "CachingAllocator",
    "HostMemory",
    "StagingRing",
    "StagingStatistics",
    "size_class",
]

PAGE_SIZE = mmap.PAGESIZE
_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")
_HUGE = 2 << 20
_POW2_ABOVE = 1 << 20
# The staging ring's default shape: 8 MiB that stay in the caches (see the module doc).
STAGING_CHUNKS = 4
STAGING_CHUNK_SIZE = 2 << 20


def _check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; TypeError for non-ints (bool included)."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise InvalidCommand(f"{name!r} must be an int (got {type(value).__name__})")
    result = operator.index(value)
    if result < minimum:
        op = f"> {minimum - 1}" if minimum else ">= 0"
        raise InvalidCommand(f"{name!r} must be {op} (got {result})")
    return result


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _mapped(size: int, make: Callable[[], _T]) -> _T:
    """``make()``, with the kernel's refusal to map ``size`` bytes as :class:`OutOfMemory`."""
    try:
        return make()
    except (OSError, OverflowError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise OutOfMemory(
            f"out of memory: can't map 'nbytes' = {size} bytes (got: {why})"
        ) from None


def size_class(nbytes: int) -> int:
    """The size ``nbytes`` is served at: whole pages up to 1 MiB, a power of two above."""
    if nbytes <= _POW2_ABOVE:
        return _round_up(nbytes, PAGE_SIZE)
    return 1 << (nbytes - 1).bit_length()


class HostMemory:
    """One page-rounded shared mapping of at least ``nbytes`` bytes.

    Anonymous by default; ``shareable=True`` backs it with a memfd (``fd``) that
    another process can map, and ``fd=`` maps a memfd received from one (the
    block then owns that fd)."""

    def __init__(self, nbytes: int, *, shareable: bool = False, fd: int | None = None) -> None:
        self._nbytes = _check_int("nbytes", nbytes, 1)
        self._capacity = _round_up(self._nbytes, PAGE_SIZE)
        self.fd: int | None = None
        self.charged = 0  # bytes counted against a device's memory (shared allocations)
        self._mm: mmap.mmap | None = None
        if fd is None and not shareable:
            # Private, not shared: the kernel backs large private mappings with huge
            # pages (copies run ~20 % faster than over 4 KiB shared pages); memory for
            # other processes is the memfd path below.
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self._mm = _mapped(self._capacity, lambda: mmap.mmap(-1, self._capacity, flags=flags))
            if self._capacity >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
                self._mm.madvise(mmap.MADV_HUGEPAGE)
        elif fd is None:
            made = _mapped(self._capacity, lambda: memfd("hcqa-buffer", self._capacity))
            try:  # sealed (see hcqa._signals.slots); a failure closes the memfd: nothing leaks
                self._mm = _mapped(
                    self._capacity, lambda: mmap.mmap(made, self._capacity, mmap.MAP_SHARED)
                )
            except BaseException:
                os.close(made)
                raise
            self.fd = made
        else:
            self._mm = self._map_received(fd)
            self.fd = fd
        anchor = ctypes.c_char.from_buffer(self._mm)
        self._address = ctypes.addressof(anchor)
        del anchor  # release the buffer export at once, or close() could never unmap

    def _map_received(self, fd: object) -> mmap.mmap:
        """Map a memfd received from another process; refuse (leaving the fd to the
        caller) anything that is not an open, large enough regular file or memfd."""
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise InvalidCommand(f"'fd' must be an int file descriptor (got {type(fd).__name__})")
        try:
            st = os.fstat(fd)
        except (OSError, OverflowError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise InvalidCommand(f"'fd' must be an open memfd (got fd {fd}: {why})") from None
        if not stat.S_ISREG(st.st_mode):
            raise InvalidCommand(f"'fd' must be a memfd or a regular file (got fd {fd}, not one)")
        if st.st_size < self._nbytes:
            raise InvalidCommand(
                f"shared memory must hold 'nbytes' = {self._nbytes} bytes (got {st.st_size})"
            )
        self._capacity = min(self._capacity, st.st_size)
        try:
            return mmap.mmap(fd, self._capacity, mmap.MAP_SHARED)
        except OSError as exc:
            raise InvalidCommand(f"'fd' {fd} can't be mapped shared: {exc.strerror}") from None

    @property
    def nbytes(self) -> int:
        """The size that was asked for; views cover this many bytes."""
        return self._nbytes

    @property
    def capacity(self) -> int:
        """The mapped size (``nbytes`` rounded up to pages, or more for a reused block)."""
        return self._capacity

    @property
    def address(self) -> int:
        """The mapping's first byte, stable until the block is closed."""
        return self._address

    @property
    def closed(self) -> bool:
        return self._mm is None

    def _resize(self, nbytes: int) -> None:
        """Serve a new request from this mapping (the allocator reusing a cached block)."""
        assert 0 < nbytes <= self._capacity
        self._nbytes = nbytes

    def view(self, dtype: npt.DTypeLike = "uint8") -> npt.NDArray[np.generic]:
        """A writable numpy array over the first ``nbytes`` bytes (no copy)."""
        if self._mm is None:
            raise InvalidCommand(f"host memory at {self._address:#x} is closed")
        dt = np.dtype(dtype)
        if self._nbytes % dt.itemsize:
            raise InvalidCommand(
                f"'nbytes' must be a multiple of {dt.itemsize} for dtype {dt} (got {self._nbytes})"
            )
        return np.frombuffer(self._mm, dtype=dt, count=self._nbytes // dt.itemsize)

    def anchor(self, offset: int, nbytes: int) -> ctypes.Array[ctypes.c_char]:
        """A new object exporting ``nbytes`` bytes at ``offset`` (no copy).

        Arrays built on it keep the mapping alive, even past :meth:`close`, and it can
        be watched with ``weakref.finalize``: it dies with the last array over it."""
        if self._mm is None:
            raise InvalidCommand(f"host memory at {self._address:#x} is closed")
        if offset < 0 or offset + nbytes > self._capacity:
            raise InvalidCommand(
                f"'offset + nbytes' must be <= {self._capacity} (got {offset} + {nbytes})"
            )
        return (ctypes.c_char * nbytes).from_buffer(self._mm, offset)

    def close(self) -> None:
        """Unmap now, or when the last surviving view is collected. Idempotent; never raises."""
        mm, self._mm = self._mm, None
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still export it; the mmap object unmaps when the last one goes

    def __enter__(self) -> HostMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else f"at {self._address:#x}"
        return f"<HostMemory {self._nbytes} bytes {state}>"


@attrs.frozen
class AllocatorStatistics:
    capacity: int
    used: int  # size-class bytes held by live allocations
    cached: int  # size-class bytes held by freed blocks kept for reuse
    allocations: int  # live allocations
    hits: int  # allocations served from the cache
    misses: int  # allocations that mapped fresh memory


def _locked(method: _F) -> _F:
    """Run the method under the allocator's lock: a buffer collected by the garbage
    collector frees its block in whatever thread the collection happens."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class CachingAllocator:
    """Size-classed host allocator with an LRU cache of freed blocks (see the module docstring)."""

    def __init__(self, *, capacity: int, name: str) -> None:
        self._lock = threading.RLock()
        self.capacity = _check_int("capacity", capacity, 1)
        self.name = name
        self._live: dict[int, HostMemory] = {}
        self._lru: collections.OrderedDict[int, HostMemory] = collections.OrderedDict()
        self._by_class: dict[int, collections.OrderedDict[int, HostMemory]] = {}
        self._used = 0
        self._cached = 0
        self._hits = 0
        self._misses = 0
        self._closed = False

    @_locked
    def alloc(self, nbytes: int) -> HostMemory:
        nbytes = _check_int("nbytes", nbytes, 1)
        if self._closed:
            raise InvalidCommand(f"{self.name}: allocator is closed")
        size = size_class(nbytes)
        same = self._by_class.get(size)
        if same:
            _, block = same.popitem()  # most recently freed first
            del self._lru[id(block)]
            self._cached -= size
            self._hits += 1
            block._resize(nbytes)
        else:
            if self._used + size > self.capacity:
                rounded = f" ({size} rounded up)" if size != nbytes else ""
                raise OutOfMemory(
                    f"{self.name}: out of memory: 'nbytes' {nbytes} requested{rounded},"
                    f" {self.capacity - self._used} of {self.capacity} bytes free"
                    f" ({self._cached} cached)"
                )
            while self._used + self._cached + size > self.capacity:
                self._evict_oldest()
            block = HostMemory(size)
            block._resize(nbytes)
            self._misses += 1
        self._live[id(block)] = block
        self._used += size
        return block

    @_locked
    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` of memory mapped elsewhere (shared memory) as used; evicts
        cached blocks to make room, :class:`OutOfMemory` when even that does not."""
        if self._closed:
            raise InvalidCommand(f"{self.name}: allocator is closed")
        if self._used + nbytes > self.capacity:
            raise OutOfMemory(
                f"{self.name}: out of memory: 'nbytes' {nbytes} of shared memory requested,"
                f" {self.capacity - self._used} of {self.capacity} bytes free"
                f" ({self._cached} cached)"
            )
        while self._used + self._cached + nbytes > self.capacity:
            self._evict_oldest()
        self._used += nbytes

    @_locked
    def uncharge(self, nbytes: int) -> None:
        """Undo :meth:`charge` (the shared memory was unmapped)."""
        self._used -= nbytes

    @_locked
    def free(self, block: HostMemory) -> None:
        """Return ``block`` to the cache; it stays mapped for the next request of its class."""
        key = id(block)
        if self._live.get(key) is not block:
            what = "double free of" if self._lru.get(key) is block else "not allocated here:"
            raise InvalidCommand(f"{self.name}: {what} {block!r}")
        del self._live[key]
        size = block.capacity
        self._used -= size
        if self._closed:
            block.close()
            return
        self._by_class.setdefault(size, collections.OrderedDict())[key] = block
        self._lru[key] = block
        self._cached += size

    @_locked
    def retire(self, block: HostMemory) -> None:
        """Take ``block`` out of use for good: unmapped (once arrays over it are gone),
        never cached, so memory that someone still sees is never handed out again."""
        key = id(block)
        if self._live.get(key) is not block:
            raise InvalidCommand(f"{self.name}: not allocated here: {block!r}")
        del self._live[key]
        self._used -= block.capacity
        block.close()

    def _evict_oldest(self) -> None:
        key, block = self._lru.popitem(last=False)
        same = self._by_class[block.capacity]
        del same[key]
        if not same:
            del self._by_class[block.capacity]
        self._cached -= block.capacity
        block.close()

    @_locked
    def free_cache(self) -> None:
        """Unmap every cached block."""
        while self._lru:
            self._evict_oldest()

    @_locked
    def close(self) -> None:
        """Unmap everything, live blocks included. Idempotent."""
        self._closed = True
        self.free_cache()
        for block in self._live.values():
            block.close()

    @_locked
    def statistics(self) -> AllocatorStatistics:
        return AllocatorStatistics(
            capacity=self.capacity,
            used=self._used,
            cached=self._cached,
            allocations=len(self._live),
            hits=self._hits,
            misses=self._misses,
        )


class BumpAllocator:
    """Forward-only offsets in a region of ``size`` bytes starting at ``base``."""

    def __init__(self, size: int, *, base: int = 0, wrap: bool = True) -> None:
        self.size = _check_int("size", size, 1)
        self.base = _check_int("base", base, 0)
        self.wrap = wrap
        self.ptr = 0  # next free offset from base
        self.wraps = 0

    def alloc(self, nbytes: int, alignment: int = 8) -> int:
        """``base`` + an offset aligned to ``alignment`` (a power of two) with ``nbytes`` free."""
        nbytes = _check_int("nbytes", nbytes, 0)
        alignment = _check_int("alignment", alignment, 1)
        if alignment & (alignment - 1):
            raise InvalidCommand(f"'alignment' must be a power of two (got {alignment})")
        if nbytes > self.size:
            raise InvalidCommand(f"'nbytes' must be <= {self.size} (got {nbytes})")
        offset = _round_up(self.ptr, alignment)
        if offset + nbytes > self.size:
            if not self.wrap:
                raise OutOfMemory(
                    f"bump allocator out of memory: 'nbytes' {nbytes} requested,"
                    f" {max(self.size - offset, 0)} of {self.size} bytes free"
                )
            offset = 0
            self.wraps += 1
        self.ptr = offset + nbytes
        return self.base + offset

    def reset(self) -> None:
        self.ptr = 0


@attrs.frozen
class StagingStatistics:
    chunks: int
    chunk_size: int
    allocated: int  # chunks mapped so far
    uses: int  # acquire() calls
    wraps: int  # times the ring came back to chunk 0


class StagingRing:
    """Round-robin ring of host chunks for copies to and from device-only memory."""

    def __init__(
        self, *, chunks: int = STAGING_CHUNKS, chunk_size: int = STAGING_CHUNK_SIZE, name: str
    ) -> None:
        self.chunks = _check_int("chunks", chunks, 1)
        self.chunk_size = _check_int("chunk_size", chunk_size, 1)
        self.name = name
        self._blocks: list[HostMemory | None] = [None] * self.chunks
        self._reuse_after = [0] * self.chunks
        self._next = 0
        self._uses = 0
        self._wraps = 0
        self._closed = False

    def acquire(self) -> tuple[int, HostMemory, int]:
        """The next chunk: ``(index, chunk, reuse_after)``; wait for reuse_after, then write."""
        if self._closed:
            raise InvalidCommand(f"{self.name}: staging ring is closed")
        index = self._next
        self._next = (index + 1) % self.chunks
        if index == 0 and self._uses:
            self._wraps += 1
        self._uses += 1
        block = self._blocks[index]
        if block is None:
            block = self._blocks[index] = HostMemory(self.chunk_size)
        return index, block, self._reuse_after[index]

    def release(self, index: int, value: int) -> None:
        """Chunk ``index`` is in use until the timeline reaches ``value``."""
        index = _check_int("index", index, 0)
        if index >= self.chunks:
            raise InvalidCommand(f"'index' must be < {self.chunks} (got {index})")
        self._reuse_after[index] = _check_int("value", value, 0)

    def split(self, nbytes: int) -> list[tuple[int, int]]:
        """The ``(offset, size)`` pieces of a transfer of ``nbytes``, ``chunk_size`` at a time."""
        nbytes = _check_int("nbytes", nbytes, 0)
        step = self.chunk_size
        return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]

    def close(self) -> None:
        """Unmap every chunk. Idempotent."""
        self._closed = True
        for block in self._blocks:
            if block is not None:
                block.close()
        self._blocks = [None] * self.chunks

    def statistics(self) -> StagingStatistics:
        return StagingStatistics(
            chunks=self.chunks,
            chunk_size=self.chunk_size,
            allocated=sum(block is not None for block in self._blocks),
            uses=self._uses,
            wraps=self._wraps,
        )
