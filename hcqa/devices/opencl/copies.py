"""Copies and loads as OpenCL driver commands: buffer copies, writes and reads.

Theory of operation
-------------------
A ``Copy`` or ``Load`` becomes one driver command on the queue's in-order
``cl.CommandQueue``, through PyOpenCL's native entry points (``pyopencl.enqueue_copy``
would dispatch on its arguments' types in Python first). Between two device buffers it is a
buffer copy (an overlapping copy within one allocation goes through a bounce buffer, as
``memmove`` would); with a host end it is a non-blocking write or read of the host array (or
of a cpu device's buffer, whose memory is host memory); a ``Load`` maps the file and writes
from the mapping, so the driver's thread takes the page faults. Whatever the driver may still
touch -- the host array, PyOpenCL's ``NannyEvent``, the mapping -- goes into ``keep``, which
the segment holds until it completed.

This is a mixin of :class:`~hcqa.devices.opencl.executor.ClExecutor`, which sets the
attributes declared below.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

import numpy as np

from hcqa import commands as cmd
from hcqa.devices.buffer import Buffer
from hcqa.devices.opencl import runtime
from hcqa.devices.opencl.memory import ClMemory

__all__ = ["DriverCopies"]

_COPY = cmd.Copy
_ADDRESS_ALIGN = mmap.ALLOCATIONGRANULARITY


class DriverCopies:
    """A queue's copies and loads as driver commands (see the module doc)."""

    name: str
    device: runtime.ClHost
    queue: Any
    _cl: Any
    _low: Any

    def _enqueue(self, c: Any, keep: list[Any], wait_for: list[Any] | None) -> Any:
        """A copy or a load, after the events ``wait_for``: its driver command's event
        (``keep`` gets what it touches)."""
        kind = type(c)
        if kind is _COPY:
            return self._copy(c.dest, c.src, c.nbytes, keep, wait_for)
        return self._load(c, keep, wait_for)

    def _copy(
        self, dest: Any, src: Any, n: int, keep: list[Any], wait_for: list[Any] | None
    ) -> Any:
        """The driver's own entry points, not ``pyopencl.enqueue_copy`` (which dispatches on
        its arguments' types in Python first): a host end is a non-blocking write or read."""
        low = self._low
        d_mem, s_mem = _device_memory(dest), _device_memory(src)
        if d_mem is not None and s_mem is not None:
            if d_mem is s_mem and abs(dest.offset - src.offset) < n:  # overlapping: as memmove
                if dest.offset == src.offset:  # a copy onto itself: nothing to move
                    return low._enqueue_marker_with_wait_list(self.queue, wait_for)
                bounce = self._cl.Buffer(self.device.context, self._cl.mem_flags.READ_WRITE, n)
                keep.append(bounce)
                keep.append(
                    low._enqueue_copy_buffer(
                        self.queue, s_mem.clbuf, bounce, n, src.offset, 0, wait_for
                    )
                )
                return low._enqueue_copy_buffer(
                    self.queue, bounce, d_mem.clbuf, n, 0, dest.offset, None
                )
            return low._enqueue_copy_buffer(
                self.queue, s_mem.clbuf, d_mem.clbuf, n, src.offset, dest.offset, wait_for
            )
        if d_mem is not None:
            host = _host_array(src, n)
            nanny = low._enqueue_write_buffer(
                self.queue, d_mem.clbuf, host, dest.offset, wait_for, False
            )
        elif s_mem is not None:
            host = _host_array(dest, n)
            nanny = low._enqueue_read_buffer(
                self.queue, s_mem.clbuf, host, src.offset, wait_for, False
            )
        else:
            raise TypeError(f"{self.name}: a copy between two host ends belongs to a cpu device")
        keep.append(host)
        keep.append(nanny)  # dropped only once completed (its destructor would block)
        return nanny

    def _load(self, c: Any, keep: list[Any], wait_for: list[Any] | None) -> Any:
        mem = _device_memory(c.dest)
        assert mem is not None
        start = c.offset - c.offset % _ADDRESS_ALIGN
        skip = c.offset - start
        fd = os.open(c.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < c.offset + c.nbytes:
                raise EOFError(f"{c.path!r} holds fewer than {c.offset + c.nbytes} bytes now")
            mapping = mmap.mmap(fd, skip + c.nbytes, prot=mmap.PROT_READ, offset=start)
        finally:
            os.close(fd)
        host = np.frombuffer(mapping, dtype=np.uint8, count=c.nbytes, offset=skip)
        nanny = self._low._enqueue_write_buffer(
            self.queue, mem.clbuf, host, c.dest.offset, wait_for, False
        )
        keep.extend((nanny, host, mapping))  # the nanny goes first, the mapping last
        return nanny


def _device_memory(end: Any) -> ClMemory | None:
    if isinstance(end, Buffer) and isinstance(end._mem, ClMemory):
        return end._mem
    return None


def _host_array(end: Any, n: int) -> Any:
    """The host memory of a copy's other end, ``n`` bytes: a host array (copyin, copyout),
    or a buffer of a device whose memory is host memory (a cpu device)."""
    if isinstance(end, cmd.HostMemoryRef):
        arr = end.keep[1]  # the contiguous array host_ref checked
        if arr.nbytes == n:
            return arr
    elif isinstance(end, Buffer):
        return end._mem.view()[end.offset : end.offset + n]
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(end.va_addr))
