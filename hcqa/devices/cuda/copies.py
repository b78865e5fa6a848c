"""Copies and loads on a CUDA stream: device-to-device, and host ends through pinned memory.

Theory of operation
-------------------
Host memory is pageable, and a CUDA copy from or to pageable memory may block the calling
thread until the stream reaches it; nothing here may block the loop. So a copy between two
buffers of the device is one ``cuMemcpyDtoDAsync`` (an overlapping one goes through a bounce
block, as ``memmove`` would), and a copy with a host end goes through pinned memory:

- up to ``SMALL`` bytes, a pinned block of its own (``_block``): a copy-in's bytes are taken
  into the block at once (unless a copy-out into host memory is still pending, which may be
  writing that memory), a copy-out lands in the block and the segment's completion host
  function copies it on to the array;
- anything larger, and every ``Load`` (a mapped file), chunk by chunk through the stream's
  staging buffer, the host half of each chunk done in stream order by the C host function
  ``hcqa_cu_memcpy`` (``cuLaunchHostFunc``).

Whatever the stream may still touch (host arrays, descriptors, blocks, mappings) goes into
``keep``, which the segment holds until it completed; ``_Pinned`` and ``_Temp`` entries go
back to their pools then (``device.py``). This is a mixin of
:class:`~hcqa.devices.cuda.executor.CuExecutor`, which sets the attributes declared below.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

import numpy as np

from hcqa import commands as cmd
from hcqa.devices.buffer import Buffer
from hcqa.devices.cuda import driver as drv
from hcqa.devices.cuda.memory import CuMemory

__all__ = ["SMALL", "STAGING", "HostCopies"]

_ALIGN = mmap.ALLOCATIONGRANULARITY
STAGING = 8 << 20  # bytes of pinned staging memory per stream (allocated at the first host copy)
SMALL = 256 << 10  # a host copy up to this size goes through a pinned block of its own


class HostCopies:
    """A stream's copies and loads (see the module doc)."""

    name: str
    device: Any
    stream: Any
    handle: int
    _driver: Any
    _native: Any
    _staging: int
    _blocks: list[int]
    _all_blocks: list[int]
    _post: list[tuple[int, int, int]]
    _hostw: int

    def _copy(self, dest: Any, src: Any, n: int, keep: list[Any]) -> None:
        d, s = _device_memory(dest, self.device), _device_memory(src, self.device)
        driver, stream = self._driver, self.stream
        if d is not None and s is not None:
            if d is s and abs(dest.offset - src.offset) < n:  # overlapping: as memmove
                if dest.offset == src.offset:
                    return
                bounce = self.device.allocator.alloc(n)
                self.pending_temp(keep, bounce)
                drv.check("cuMemcpyDtoDAsync", driver.cuMemcpyDtoDAsync(
                    bounce.address, src.va_addr, n, stream))  # fmt: skip
                drv.check("cuMemcpyDtoDAsync", driver.cuMemcpyDtoDAsync(
                    dest.va_addr, bounce.address, n, stream))  # fmt: skip
                return
            drv.check("cuMemcpyDtoDAsync", driver.cuMemcpyDtoDAsync(
                dest.va_addr, src.va_addr, n, stream))  # fmt: skip
            return
        if d is not None:
            host = _host_address(src, n, keep)
            if self.device._host_writes:  # the copy-outs done by now are processed first
                self.device._tidy_all()
            if n > SMALL or self.device._host_writes:  # (a copy-out may still write it)
                self._staged(dest.va_addr, host, n, keep, to_device=True)
                return
            block = self._block(keep)  # copied now: the stream reads the block, not the array
            ctypes.memmove(block, host, n)
            drv.check("cuMemcpyHtoDAsync", driver.cuMemcpyHtoDAsync(
                dest.va_addr, block, n, stream))  # fmt: skip
        elif s is not None:
            host = _host_address(dest, n, keep)
            self.device._host_writes += 1  # host memory written in stream order, not yet done
            self._hostw += 1
            if n > SMALL:
                self._staged(host, src.va_addr, n, keep, to_device=False)
                return
            block = self._block(keep)  # the segment's host function copies it to the array
            drv.check("cuMemcpyDtoHAsync", driver.cuMemcpyDtoHAsync(
                block, src.va_addr, n, stream))  # fmt: skip
            self._post.append((host, block, n))
        else:
            raise TypeError(f"{self.name}: a copy between two host ends belongs to a cpu device")

    def _block(self, keep: list[Any]) -> int:
        """A pinned block of SMALL bytes, back in the pool once its segment completed."""
        if not self._blocks:
            block = int(drv.check("cuMemHostAlloc", self._driver.cuMemHostAlloc(SMALL, 0)))
            self._all_blocks.append(block)
            self._blocks.append(block)
        block = self._blocks.pop()
        keep.append(_Pinned(self, block))
        return block

    def pending_temp(self, keep: list[Any], block: CuMemory) -> None:
        keep.append(_Temp(block))

    def _staged(self, dest: int, src: int, n: int, keep: list[Any], *, to_device: bool) -> None:
        """Copy ``n`` bytes between host memory and the device through the staging buffer,
        each chunk's host half done by ``hcqa_cu_memcpy`` in stream order."""
        if not self._staging:
            self._staging = int(
                drv.check("cuMemHostAlloc", self._driver.cuMemHostAlloc(STAGING, 0))
            )
        driver, stream, staging = self._driver, self.stream, self._staging
        host_func, memcpy = self._native.host_func, self._native.memcpy
        done = 0
        while done < n:
            k = min(STAGING, n - done)
            desc = (ctypes.c_uint64 * 3)()
            keep.append(desc)
            if to_device:
                desc[0], desc[1], desc[2] = staging, src + done, k
                host_func(self.handle, memcpy, ctypes.addressof(desc))
                drv.check("cuMemcpyHtoDAsync", driver.cuMemcpyHtoDAsync(
                    dest + done, staging, k, stream))  # fmt: skip
            else:
                drv.check("cuMemcpyDtoHAsync", driver.cuMemcpyDtoHAsync(
                    staging, src + done, k, stream))  # fmt: skip
                desc[0], desc[1], desc[2] = dest + done, staging, k
                host_func(self.handle, memcpy, ctypes.addressof(desc))
            done += k

    def _load(self, c: Any, keep: list[Any]) -> None:
        start = c.offset - c.offset % _ALIGN
        skip = c.offset - start
        fd = os.open(c.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < c.offset + c.nbytes:
                raise EOFError(f"{c.path!r} holds fewer than {c.offset + c.nbytes} bytes now")
            mapping = mmap.mmap(fd, skip + c.nbytes, prot=mmap.PROT_READ, offset=start)
        finally:
            os.close(fd)
        host = np.frombuffer(mapping, dtype=np.uint8, count=c.nbytes, offset=skip)
        keep.extend((mapping, host))
        self._staged(c.dest.va_addr, host.ctypes.data, c.nbytes, keep, to_device=True)

    def free_staging(self) -> None:
        """Free the pinned staging memory and blocks (the stream is idle: the device is
        closing)."""
        drv.current(self.device.cu_context)
        blocks, self._all_blocks, self._blocks = self._all_blocks, [], []
        if self._staging:
            blocks.append(self._staging)
            self._staging = 0
        for block in blocks:
            self._driver.cuMemFreeHost(block)  # (a broken context's error: ignored)


class _Pinned:
    """A pinned block a segment uses: back to its executor's pool once the segment completed."""

    __slots__ = ("block", "executor")

    def __init__(self, executor: HostCopies, block: int) -> None:
        self.executor = executor
        self.block = block


class _Temp:
    """A device block a segment borrowed (a bounce): back to the allocator when dropped."""

    __slots__ = ("block",)

    def __init__(self, block: CuMemory) -> None:
        self.block = block


def _device_memory(end: Any, device: Any) -> Any:
    """``end``'s memory when the stream can address it: a buffer of a CUDA device."""
    if isinstance(end, Buffer) and isinstance(end._mem, CuMemory):
        return end._mem
    return None


def _host_address(end: Any, n: int, keep: list[Any]) -> int:
    """The host address of a copy's other end: a host array, or a host-memory buffer."""
    if isinstance(end, cmd.HostMemoryRef):
        keep.append(end)
        return int(end.va_addr)
    if isinstance(end, Buffer):
        if not end.device.host_memory:
            raise TypeError(
                f"{end.device.name}'s memory is driver memory a CUDA stream can't address: "
                "copy through a host array (copyout, then copyin)"
            )
        keep.append(end)
        return int(end.va_addr)
    raise TypeError(f"a copy end must be a Buffer or host memory (got {type(end).__name__})")
