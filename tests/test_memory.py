"""Host memory, the caching allocator, the bump allocator and the staging ring."""

from __future__ import annotations

import ctypes
import gc
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hcqa.devices.memory import (
    PAGE_SIZE,
    AllocatorStatistics,
    BumpAllocator,
    CachingAllocator,
    HostMemory,
    StagingRing,
    StagingStatistics,
    size_class,
)
from hcqa.errors import InvalidCommand, OutOfMemory

KIB = 1 << 10
MIB = 1 << 20


def _maps_lines() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _mapped_at(address: int) -> bool:
    """Whether ``address`` lies in a mapping (private anonymous ones may merge with a
    neighbour, so the block's start need not start a line of /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
            if lo <= address < hi:
                return True
    return False


# HostMemory


def test_host_memory_sizes_and_address() -> None:
    with HostMemory(100) as block:
        assert block.nbytes == 100
        assert block.capacity == PAGE_SIZE
        assert block.address % PAGE_SIZE == 0
        assert _mapped_at(block.address)
        assert block.view().shape == (100,)
    assert block.closed


def test_view_sees_memmove_to_address() -> None:
    with HostMemory(4 * KIB) as block:
        data = np.arange(1024, dtype=np.float32)
        ctypes.memmove(block.address, data.ctypes.data, data.nbytes)
        assert np.array_equal(block.view(np.float32), data)
        view = block.view()
        view[:4] = [1, 2, 3, 4]
        out = (ctypes.c_uint8 * 4).from_address(block.address)
        assert list(out) == [1, 2, 3, 4]
        del view, out


def test_view_rejects_ragged_dtype_and_closed_block() -> None:
    block = HostMemory(6)
    with pytest.raises(InvalidCommand, match="multiple of 4"):
        block.view("float32")
    block.close()
    with pytest.raises(InvalidCommand, match="closed"):
        block.view()


def test_close_unmaps_when_no_view_survives() -> None:
    block = HostMemory(64 * KIB)
    block.view()[:] = 7  # a temporary view, gone before close
    address = block.address
    block.close()
    block.close()  # idempotent
    assert not _mapped_at(address)


def test_close_with_surviving_view_defers_unmap() -> None:
    block = HostMemory(64 * KIB)
    view = block.view()
    block.close()  # BufferError must not escape
    assert block.closed
    view[:] = 3  # still mapped: the view keeps it alive, nothing dangles
    assert int(view.sum()) == 3 * 64 * KIB
    assert _mapped_at(block.address)
    del view
    gc.collect()
    assert not _mapped_at(block.address)


@pytest.mark.parametrize("bad", [0, -1])
def test_host_memory_bad_size(bad: int) -> None:
    with pytest.raises(InvalidCommand, match=rf"'nbytes' must be > 0 \(got {bad}\)"):
        HostMemory(bad)


def test_no_mmap_leak() -> None:
    before = _maps_lines()
    for _ in range(10_000):
        HostMemory(PAGE_SIZE).close()
    allocator = CachingAllocator(capacity=64 * MIB, name="cpu:0")
    for _ in range(1_000):
        allocator.free(allocator.alloc(PAGE_SIZE))
        allocator.free_cache()
    blocks = [allocator.alloc(PAGE_SIZE) for _ in range(100)]
    allocator.close()
    assert all(b.closed for b in blocks)
    assert _maps_lines() - before < 50  # shared mappings don't merge: a leak would add thousands


# CachingAllocator


def test_size_class() -> None:
    assert size_class(1) == PAGE_SIZE
    assert size_class(PAGE_SIZE + 1) == 2 * PAGE_SIZE
    assert size_class(MIB) == MIB
    assert size_class(MIB + 1) == 2 * MIB
    assert size_class(3 * MIB) == 4 * MIB


def test_reuse_returns_same_block() -> None:
    allocator = CachingAllocator(capacity=64 * KIB, name="cpu:0")
    block = allocator.alloc(100)
    address = block.address
    allocator.free(block)
    again = allocator.alloc(PAGE_SIZE)  # same size class
    assert again is block and again.address == address
    assert again.nbytes == PAGE_SIZE
    stats = allocator.statistics()
    assert (stats.hits, stats.misses) == (1, 1)
    allocator.close()


def test_most_recently_freed_reused_first() -> None:
    allocator = CachingAllocator(capacity=64 * KIB, name="cpu:0")
    a, b = allocator.alloc(PAGE_SIZE), allocator.alloc(PAGE_SIZE)
    allocator.free(a)
    allocator.free(b)
    assert allocator.alloc(PAGE_SIZE) is b
    assert allocator.alloc(PAGE_SIZE) is a
    allocator.close()


def test_least_recently_used_evicted_first() -> None:
    capacity = 16 * PAGE_SIZE
    allocator = CachingAllocator(capacity=capacity, name="cpu:0")
    first = allocator.alloc(4 * PAGE_SIZE)
    second = allocator.alloc(4 * PAGE_SIZE)
    third = allocator.alloc(8 * PAGE_SIZE)
    allocator.free(first)
    allocator.free(third)
    allocator.free(second)  # LRU order: first, third, second
    # 12 pages of a new class: evicting `first` (4) is not enough, `third` (8) goes too
    big = allocator.alloc(12 * PAGE_SIZE)
    assert first.closed and third.closed and not second.closed
    assert allocator.statistics() == AllocatorStatistics(
        capacity=capacity,
        used=12 * PAGE_SIZE,
        cached=4 * PAGE_SIZE,
        allocations=1,
        hits=0,
        misses=4,
    )
    assert allocator.alloc(4 * PAGE_SIZE) is second
    allocator.free(big)
    allocator.close()


def test_out_of_memory_message_and_cache_kept() -> None:
    allocator = CachingAllocator(capacity=64 * KIB, name="cpu:0")
    held = allocator.alloc(32 * KIB)
    cached = allocator.alloc(PAGE_SIZE)
    allocator.free(cached)
    free = 64 * KIB - 32 * KIB
    with pytest.raises(OutOfMemory) as info:
        allocator.alloc(48 * KIB)
    message = str(info.value)
    assert message == (
        f"cpu:0: out of memory: 'nbytes' {48 * KIB} requested,"
        f" {free} of {64 * KIB} bytes free ({PAGE_SIZE} cached)"
    )
    assert not cached.closed  # a hopeless request evicts nothing
    with pytest.raises(OutOfMemory, match=r"'nbytes' 8589934592 requested, 32768 of 65536"):
        allocator.alloc(8 << 30)  # already a power of two: no rounding note
    rounded = rf"'nbytes' {MIB + 1} requested \({2 * MIB} rounded up\)"
    with pytest.raises(OutOfMemory, match=rounded):
        allocator.alloc(MIB + 1)
    assert isinstance(info.value, MemoryError)
    allocator.free(held)
    allocator.close()


@pytest.mark.parametrize("bad", [0, -5])
def test_bad_nbytes_values(bad: int) -> None:
    allocator = CachingAllocator(capacity=64 * KIB, name="cpu:0")
    with pytest.raises(InvalidCommand, match=re.escape(f"'nbytes' must be > 0 (got {bad})")):
        allocator.alloc(bad)


@pytest.mark.parametrize("bad", [True, 1.0, "8", None])
def test_bad_nbytes_types(bad: object) -> None:
    allocator = CachingAllocator(capacity=64 * KIB, name="cpu:0")
    with pytest.raises(TypeError, match="'nbytes' must be an int"):
        allocator.alloc(bad)  # type: ignore[arg-type]


def test_numpy_integer_accepted() -> None:
    allocator = CachingAllocator(capacity=64 * KIB, name="cpu:0")
    assert allocator.alloc(np.int64(10)).nbytes == 10  # type: ignore[arg-type]
    allocator.close()


def test_double_free_and_foreign_block() -> None:
    allocator = CachingAllocator(capacity=64 * KIB, name="cpu:0")
    block = allocator.alloc(10)
    allocator.free(block)
    with pytest.raises(InvalidCommand, match="double free"):
        allocator.free(block)
    with HostMemory(10) as foreign, pytest.raises(InvalidCommand, match="not allocated here"):
        allocator.free(foreign)
    assert allocator.statistics().cached == PAGE_SIZE
    allocator.close()


def test_statistics_counts() -> None:
    allocator = CachingAllocator(capacity=64 * KIB, name="cpu:0")
    blocks = [allocator.alloc(PAGE_SIZE) for _ in range(3)]
    allocator.free(blocks[0])
    stats = allocator.statistics()
    assert stats == AllocatorStatistics(
        capacity=64 * KIB, used=2 * PAGE_SIZE, cached=PAGE_SIZE, allocations=2, hits=0, misses=3
    )
    allocator.alloc(1)
    allocator.free_cache()
    assert allocator.statistics() == AllocatorStatistics(
        capacity=64 * KIB, used=3 * PAGE_SIZE, cached=0, allocations=3, hits=1, misses=3
    )
    with pytest.raises(AttributeError):
        stats.used = 0  # type: ignore[misc]
    allocator.close()


def test_close_unmaps_everything() -> None:
    allocator = CachingAllocator(capacity=64 * KIB, name="cpu:0")
    live, cached = allocator.alloc(10), allocator.alloc(10)
    addresses = (live.address, cached.address)
    allocator.free(cached)
    allocator.close()
    assert live.closed and cached.closed
    assert not any(_mapped_at(a) for a in addresses)
    with pytest.raises(InvalidCommand, match="closed"):
        allocator.alloc(10)
    allocator.free(live)  # returning a block after close is harmless
    assert allocator.statistics().used == 0
    allocator.close()


# BumpAllocator


def test_bump_alignment_and_base() -> None:
    bump = BumpAllocator(256, base=0x1000)
    assert bump.alloc(3) == 0x1000
    assert bump.alloc(4) == 0x1008
    assert bump.alloc(1, alignment=64) == 0x1040
    assert bump.alloc(0, alignment=1) == 0x1041
    with pytest.raises(InvalidCommand, match="power of two"):
        bump.alloc(8, alignment=12)
    with pytest.raises(InvalidCommand, match=r"'alignment' must be > 0 \(got 0\)"):
        bump.alloc(8, alignment=0)


def test_bump_wraps() -> None:
    bump = BumpAllocator(64)
    assert [bump.alloc(24) for _ in range(2)] == [0, 24]
    assert bump.wraps == 0
    assert bump.alloc(24) == 0  # 48 + 24 > 64: back to the start
    assert bump.wraps == 1
    assert bump.alloc(40) == 24  # exactly fills the region
    assert bump.alloc(1) == 0
    assert bump.wraps == 2


def test_bump_no_wrap_out_of_memory() -> None:
    bump = BumpAllocator(64, wrap=False)
    bump.alloc(60)
    with pytest.raises(OutOfMemory, match="'nbytes' 8 requested, 0 of 64 bytes free"):
        bump.alloc(8)
    assert bump.alloc(4, alignment=4) == 60  # the failed request changed nothing
    bump.reset()
    assert bump.alloc(64) == 0


def test_bump_request_larger_than_region() -> None:
    bump = BumpAllocator(64)
    with pytest.raises(InvalidCommand, match=r"'nbytes' must be <= 64 \(got 65\)"):
        bump.alloc(65)
    with pytest.raises(TypeError):
        bump.alloc(True)


# StagingRing


def test_staging_round_robin_and_reuse_after() -> None:
    ring = StagingRing(chunks=3, chunk_size=PAGE_SIZE, name="cpu:0")
    assert ring.statistics() == StagingStatistics(
        chunks=3, chunk_size=PAGE_SIZE, allocated=0, uses=0, wraps=0
    )
    seen = []
    for value in (10, 11, 12):
        index, chunk, reuse_after = ring.acquire()
        assert reuse_after == 0
        assert chunk.nbytes == PAGE_SIZE
        ring.release(index, value)
        seen.append((index, chunk))
    assert [i for i, _ in seen] == [0, 1, 2]
    assert ring.statistics().allocated == 3
    for expected_index, value in ((0, 10), (1, 11)):
        index, chunk, reuse_after = ring.acquire()
        assert index == expected_index
        assert chunk is seen[index][1]
        assert reuse_after == value
    assert ring.statistics() == StagingStatistics(
        chunks=3, chunk_size=PAGE_SIZE, allocated=3, uses=5, wraps=1
    )
    ring.close()
    assert all(chunk.closed for _, chunk in seen)
    with pytest.raises(InvalidCommand, match="closed"):
        ring.acquire()


def test_staging_lazy_allocation_and_release_checks() -> None:
    ring = StagingRing(chunks=4, chunk_size=PAGE_SIZE, name="cpu:0")
    ring.acquire()
    assert ring.statistics().allocated == 1
    with pytest.raises(InvalidCommand, match=r"'index' must be < 4 \(got 4\)"):
        ring.release(4, 1)
    with pytest.raises(InvalidCommand, match=r"'value' must be >= 0 \(got -1\)"):
        ring.release(0, -1)
    ring.close()
    ring.close()


def test_staging_split_examples() -> None:
    ring = StagingRing(chunk_size=2 * MIB, name="cpu:0")
    assert ring.split(0) == []
    assert ring.split(1) == [(0, 1)]
    assert ring.split(2 * MIB) == [(0, 2 * MIB)]
    assert ring.split(5 * MIB) == [(0, 2 * MIB), (2 * MIB, 2 * MIB), (4 * MIB, MIB)]
    assert ring.statistics().allocated == 0  # splitting maps nothing


@given(nbytes=st.integers(0, 1 << 40), chunk_size=st.integers(1, 1 << 30))
def test_staging_split_covers_exactly(nbytes: int, chunk_size: int) -> None:
    if nbytes // chunk_size > 10_000:
        nbytes = chunk_size * 10_000 + nbytes % chunk_size
    pieces = StagingRing(chunk_size=chunk_size, name="cpu:0").split(nbytes)
    position = 0
    for offset, size in pieces:
        assert offset == position
        assert 0 < size <= chunk_size
        position += size
    assert position == nbytes
    assert all(size == chunk_size for _, size in pieces[:-1])
