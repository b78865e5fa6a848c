"""Kept readers: a signal's eventfd stays registered with an asyncio loop between waits.

Theory of operation
-------------------
An asyncio owner of a signal's eventfd sleeps on it with ``loop.add_reader``
(``aio_wait.py``). Registering and removing the reader at every wait costs two
``epoll_ctl`` calls and the selector's bookkeeping -- ~6 µs a wait on a quiet vCPU, and
each ``epoll_ctl`` lets the GIL go to a freshly woken engine thread in the middle of the
park -- and a caller that waits on the same signals again and again (a device's timeline,
call after call: a lone asyncio ``Pipeline`` call waits twice) pays it every time.

So the reader stays: a :class:`Reader` registers a *duplicate* of the signal's eventfd
(``os.dup``: the same counter, a descriptor of our own, so its number can't be reused by
anyone while it is registered, whatever happens to the signal's) and calls its
``current`` callback -- the owner's -- when the eventfd is readable. Between waits
``current`` is None: a wake-up then is another owner's (a thread or a trio task that
took the eventfd meanwhile), so the reader leaves the counter alone for it and drops
itself (one spurious loop wake-up at most); the next asyncio wait registers again.

Dropped too: a reader whose signal is closed or gone (looked for whenever a loop
registers a new one, and the signal's garbage collection schedules it), all of a loop's
when its hcqa host ends (:func:`forget`, called by ``hcqa.aio``), and the rest when the
loop itself is collected (a finalizer closes the descriptors). A loop keeps at most
``KEEP`` idle readers. Everything here runs on the loop's thread, except the finalizer.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Callable
from typing import Protocol

__all__ = ["KEEP", "Reader", "forget", "reader"]

KEEP = 32  # idle readers a loop keeps registered


class Watched(Protocol):
    """What a kept reader uses of its signal."""

    _fd: int
    _closed: bool


class _Table:
    """A loop's readers, by signal id, and the descriptors its finalizer closes."""

    __slots__ = ("__weakref__", "fds", "readers")

    def __init__(self) -> None:
        self.readers: dict[int, Reader] = {}
        self.fds: set[int] = set()


_tables: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Table] = weakref.WeakKeyDictionary()


def _close_all(fds: set[int]) -> None:
    """A collected loop's finalizer: its selector is gone; close what was registered."""
    while fds:
        os.close(fds.pop())


class Reader:
    """A duplicate of one signal's eventfd registered with one loop (see the module doc)."""

    __slots__ = ("current", "fd", "key", "loop", "sig", "table")

    def __init__(self, loop: asyncio.AbstractEventLoop, sig: Watched, table: _Table) -> None:
        self.current: Callable[[], None] | None = None  # the owner's callback, while it waits
        self.key = id(sig)
        self.loop = weakref.ref(loop)  # (the table is the loop's: no strong way back)
        self.table = table
        self.fd = os.dup(sig._fd)
        try:
            loop.add_reader(self.fd, self._fire)
        except BaseException:
            os.close(self.fd)
            raise
        table.fds.add(self.fd)
        self.sig = weakref.ref(sig, self._gone)

    def _fire(self) -> None:
        current = self.current
        if current is not None:
            current()
        else:  # another owner's wake-up: the counter is theirs
            self.drop()

    def drop(self) -> None:
        """Unregister and close (on the loop's thread; a second call does nothing)."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        if self.table.readers.get(self.key) is self:
            del self.table.readers[self.key]
        loop = self.loop()
        if loop is not None and not loop.is_closed():
            loop.remove_reader(fd)
        self.table.fds.discard(fd)
        os.close(fd)

    def _gone(self, _: object) -> None:  # the signal was collected (on any thread)
        loop = self.loop()
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self.drop)
            except RuntimeError:
                pass  # closed: the loop's finalizer closes the descriptor


def reader(loop: asyncio.AbstractEventLoop, sig: Watched) -> Reader:
    """The loop's kept reader of ``sig``'s eventfd, registered now if need be."""
    table = _tables.get(loop)
    if table is None:
        table = _tables[loop] = _Table()
        weakref.finalize(loop, _close_all, table.fds)
    r = table.readers.get(id(sig))
    if r is not None and r.sig() is sig:
        return r
    if r is not None:
        r.drop()  # (another signal's, collected, whose id was reused)
    _sweep(table)
    r = table.readers[id(sig)] = Reader(loop, sig, table)
    return r


def _sweep(table: _Table) -> None:
    """Drop the readers of closed or collected signals, and idle ones beyond ``KEEP``."""
    idle = 0
    for r in list(table.readers.values()):
        if r.current is not None:
            continue  # in use: its owner drops it as it leaves, if need be
        sig = r.sig()
        idle += 1
        if sig is None or sig._closed or idle > KEEP:
            r.drop()


def forget(loop: asyncio.AbstractEventLoop) -> None:
    """Drop the idle readers kept on ``loop`` (its hcqa host ended; on its thread)."""
    table = _tables.get(loop)
    if table is not None:
        for r in list(table.readers.values()):
            if r.current is None:  # (one in use is dropped by its owner, or swept later)
                r.drop()
