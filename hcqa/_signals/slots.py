"""Signal slots: 32-byte cells (value, timestamp, two spare words) in memfd pages.

Theory of operation
-------------------
Signals need their value where *anyone* can write it: an engine thread, a C kernel,
another process. So slots live in pages of a memfd mapped ``MAP_SHARED``: a forked
child shares them, and the page's fd can be handed to another process
(``hcqa.processes.ipc``) which maps the same memory. A process keeps its pages for its whole
life and recycles slots through a free list (zeroed on return); a page attached from
another process (:class:`Page` with an ``fd``) is unmapped when its signal closes.

Every memfd hcqa creates (these pages, shared buffers) is sealed against shrinking
(:func:`seal`) before it is shared: a process it is handed to can't truncate it under
our mappings, which would kill us with SIGBUS at the next touch.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading

__all__ = ["PAGE", "SLOT", "Page", "SlotPool", "memfd", "pool", "seal"]

SLOT = 32
PAGE = mmap.PAGESIZE


def seal(fd: int) -> None:
    """Forbid shrinking the memfd ``fd`` (and adding or removing seals) for good."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)


def memfd(name: str, size: int) -> int:
    """A new memfd of ``size`` bytes, sealed against shrinking (closed on failure)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Page:
    """A memfd page of signal slots; kept open so it can be shared later."""

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            fd = memfd("hcqa-signals", PAGE)
        self.fd = fd
        self.mm = mmap.mmap(self.fd, PAGE, mmap.MAP_SHARED)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.free = list(range(PAGE // SLOT - 1, -1, -1))

    def close(self) -> None:
        """Unmap and close (only for pages attached from another process)."""
        os.close(self.fd)
        try:
            self.mm.close()
        except BufferError:  # a ctypes view still alive: the mapping goes with it
            pass


class SlotPool:
    """Hands out 32-byte slots; pages are never unmapped while the process lives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: list[Page] = []

    def take(self) -> tuple[Page, int]:
        with self._lock:
            for page in self._pages:
                if page.free:
                    return page, page.free.pop()
            page = Page()
            self._pages.append(page)
            return page, page.free.pop()

    def give(self, page: Page, index: int) -> None:
        with self._lock:
            ctypes.memset(page.base + index * SLOT, 0, SLOT)
            page.free.append(index)


pool = SlotPool()
