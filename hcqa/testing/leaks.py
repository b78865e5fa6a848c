"""Leak checks: this process's open fds, threads and memory, and waiters still parked.

Theory of operation
-------------------
``Resources.now()`` reads ``/proc/self``: the open file descriptors, the live threads and the
resident memory. A test takes one before and one after, and ``leaked_since`` reports the fds
and threads gained (RSS only for the record: the allocator keeps memory cached).
``parked_waiters`` counts the tasks and threads parked on signals -- given ones, or every
signal of given devices -- which is 0 once nobody waits: a cancelled wait that left its
waiter behind shows here.
"""

from __future__ import annotations

import os
import threading

import attrs

from hcqa.devices.base import Device
from hcqa.errors import InvalidCommand
from hcqa.signals import Signal

__all__ = ["Resources", "parked_waiters"]


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # the listing's own fd


def _rss_kib() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@attrs.frozen
class Resources:
    """Open fds, live threads and resident memory (KiB) of this process (Linux ``/proc``)."""

    fds: int
    threads: int
    rss_kib: int

    @classmethod
    def now(cls) -> Resources:
        return cls(fds=_fd_count(), threads=threading.active_count(), rss_kib=_rss_kib())

    def leaked_since(self, before: Resources) -> dict[str, int]:
        """The fds and threads gained since ``before`` (empty when none); RSS is not compared."""
        out = {}
        if self.fds > before.fds:
            out["fds"] = self.fds - before.fds
        if self.threads > before.threads:
            out["threads"] = self.threads - before.threads
        return out


def parked_waiters(*objects: Device | Signal) -> int:
    """Waiters (tasks and threads) parked on the given signals and on every signal of the given
    devices (timeline, shadow, queue signals)."""
    total = 0
    for obj in objects:
        if isinstance(obj, Signal):
            signals: tuple[Signal, ...] = (obj,)
        elif isinstance(obj, Device):
            signals = (*obj._timeline.signals, obj.compute.signal, obj.copy.signal)
        else:
            raise InvalidCommand(
                f"parked_waiters needs devices or signals (got {type(obj).__name__})"
            )
        total += sum(s.statistics().waiters for s in signals)
    return total
