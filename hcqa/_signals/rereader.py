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

Hang limits ride on the same timer. A trio waiter with a hang limit (a device's
fence, a queue waiting on another queue) is *timed* here instead of opening a cancel
scope of its own -- a deadline per wait costs more than the rest of the wait. Each
tick looks at the timed waiters whose limit has passed: one whose signal moved since
it was last seen gets a fresh limit; one whose signal did not is *expired* and woken
(the owner through its eventfd, a parked waiter as ``_drain`` wakes it), and its wait
raises :class:`~hcqa.errors.SignalTimeout`. While anything is timed the tick is at
most a quarter of the shortest limit, so the error comes between one limit and
1.25 limits (plus scheduling) after the last progress -- within two, as before.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Protocol

import trio

if TYPE_CHECKING:
    from hcqa._signals.waiters import Waiter

__all__ = ["BACKOFF_FIRST", "BACKOFF_MAX", "Rereader", "watch"]

BACKOFF_FIRST = 0.001
BACKOFF_MAX = 0.075  # a memory-only write is seen within this (plus scheduling): < 100 ms;
# 1/BACKOFF_MAX idle wake-ups a second: ~13, each ~0.5 ms of CPU where a vCPU wakes cold


class Watched(Protocol):
    """What the re-reader needs of a signal (a ``ParkingLot``, ``parking.py``, which imports
    this module): its eventfd and value slot to re-read, and how to expire a timed waiter."""

    _fd: int
    _value: Any  # ctypes.c_uint64 over the shared slot

    def _expire(self, waiter: Waiter) -> None: ...


_RUN: trio.lowlevel.RunVar[Rereader] = trio.lowlevel.RunVar("hcqa_rereader")


class Rereader:
    """The re-reader of one trio run (see the module doc)."""

    def __init__(self) -> None:
        self.watched: dict[Watched, int] = {}  # owned signal -> value last seen
        self.timed: dict[Waiter, _Limit] = {}  # waiters with a hang limit
        self.ticks = 0
        # What every trio wait of the run needs, looked up once: its waiter's wake-up
        # token, and the clock hang limits are timed by.
        self.token = trio.lowlevel.current_trio_token()
        self._clock = trio.lowlevel.current_clock()
        self._idle: trio.Event | None = None
        self._sleep: trio.CancelScope | None = None  # the tick being waited for
        trio.lowlevel.spawn_system_task(self._run, name="hcqa signal re-reader")

    def add(self, sig: Watched) -> None:
        self.watched[sig] = sig._value.value
        idle = self._idle
        if idle is not None:
            self._idle = None
            idle.set()

    def remove(self, sig: Watched) -> None:
        self.watched.pop(sig, None)

    def time(self, waiter: Waiter, sig: Watched, limit: float) -> None:
        """Time ``waiter`` (parked on ``sig``) against the hang ``limit`` from now."""
        now = self._clock.current_time()
        self.timed[waiter] = _Limit(sig, sig._value.value, now + limit, limit)
        idle = self._idle
        if idle is not None:
            self._idle = None
            idle.set()
        elif limit < 4 * BACKOFF_MAX:  # a short limit: tick soon enough for it
            sleep = self._sleep
            if sleep is not None and sleep.deadline > now + limit / 4:
                sleep.deadline = now + limit / 4

    def untime(self, waiter: Waiter) -> None:
        self.timed.pop(waiter, None)

    async def _run(self) -> None:
        while True:
            if not self.watched and not self.timed:
                self._idle = idle = trio.Event()
                await idle.wait()
            delay = BACKOFF_FIRST
            shortest = math.inf
            while self.watched or self.timed:
                tick = min(delay, shortest / 4) if self.timed else delay
                with trio.CancelScope(deadline=trio.current_time() + tick) as self._sleep:
                    await trio.sleep_forever()
                self._sleep = None
                delay = min(2 * delay, BACKOFF_MAX)
                self.ticks += 1
                for sig, seen in list(self.watched.items()):
                    now = sig._value.value
                    if now != seen:
                        self.watched[sig] = now
                        os.eventfd_write(sig._fd, 1)
                shortest = self._expire() if self.timed else math.inf

    def _expire(self) -> float:
        """Renew or expire the timed waiters whose limit has passed; the shortest limit."""
        now = trio.current_time()
        shortest = math.inf
        for waiter, t in list(self.timed.items()):
            shortest = min(shortest, t.limit)
            if t.deadline > now:
                continue
            value = t.signal._value.value
            if value != t.seen:  # progress: a fresh limit from now
                t.seen, t.deadline = value, now + t.limit
                continue
            del self.timed[waiter]
            t.signal._expire(waiter)
        return shortest


class _Limit:
    """A timed waiter's signal, the value it last saw and when its limit passes."""

    __slots__ = ("deadline", "limit", "seen", "signal")

    def __init__(self, signal: Watched, seen: int, deadline: float, limit: float) -> None:
        self.signal, self.seen, self.deadline, self.limit = signal, seen, deadline, limit


def watch() -> Rereader:
    """This run's re-reader (started on first use)."""
    try:
        return _RUN.get()
    except LookupError:
        rereader = Rereader()
        _RUN.set(rereader)
        return rereader
