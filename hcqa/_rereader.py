"""Seeing values that producers write to a signal's memory only (no eventfd).

Theory of operation
-------------------
A device, a DMA engine or a C kernel may write a signal's value word and never
touch its eventfd. A trio task that owns the eventfd would sleep through that. So
each trio run has one *re-reader*: a system task that, while any task of the run
owns a signal's eventfd, re-reads those signals' values on a timer that backs off
-- first after ``BACKOFF_FIRST`` seconds, twice as long each time, never longer
than ``BACKOFF_MAX`` -- and writes the eventfd of each signal whose value changed
since it last looked. The owner then wakes the ordinary way: it drains, re-reads
and wakes every parked waiter that is done. With nothing to watch the re-reader
parks and costs nothing.

One timer per run rather than one per owner keeps the owner's path to sleep as it
was (a dict entry, no cancel scope), so an eventfd wake costs what it did. Threads
in ``Signal.wait_sync`` need none of this: their ``poll`` takes the same backoff
as its timeout.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from hcqa.signals import Signal

__all__ = ["BACKOFF_FIRST", "BACKOFF_MAX", "Rereader", "watch"]

BACKOFF_FIRST = 0.001
BACKOFF_MAX = 0.064  # a memory-only write is seen within this (plus scheduling): < 100 ms

_RUN: trio.lowlevel.RunVar[Rereader] = trio.lowlevel.RunVar("hcqa_rereader")


class Rereader:
    """The re-reader of one trio run (see the module doc)."""

    def __init__(self) -> None:
        self.watched: dict[Signal, int] = {}  # owned signal -> value last seen
        self.ticks = 0
        self._idle: trio.Event | None = None
        trio.lowlevel.spawn_system_task(self._run, name="hcqa signal re-reader")

    def add(self, sig: Signal) -> None:
        self.watched[sig] = sig._value.value
        idle = self._idle
        if idle is not None:
            self._idle = None
            idle.set()

    def remove(self, sig: Signal) -> None:
        self.watched.pop(sig, None)

    async def _run(self) -> None:
        while True:
            if not self.watched:
                self._idle = idle = trio.Event()
                await idle.wait()
            delay = BACKOFF_FIRST
            while self.watched:
                await trio.sleep(delay)
                delay = min(2 * delay, BACKOFF_MAX)
                self.ticks += 1
                for sig, seen in list(self.watched.items()):
                    now = sig._value.value
                    if now != seen:
                        self.watched[sig] = now
                        os.eventfd_write(sig._fd, 1)


def watch() -> Rereader:
    """This run's re-reader (started on first use)."""
    try:
        return _RUN.get()
    except LookupError:
        rereader = Rereader()
        _RUN.set(rereader)
        return rereader
