"""The device timeline: one value per enqueue, reached in order, with HCQ's wrap.

Theory of operation
-------------------
Every enqueue on a device reserves the next *step* ``seq`` (a Python int that
only grows) and ends its batch with a ``Step(seq)`` command. Queues of one device
run in parallel and finish out of order, so the timeline advances over the
*completed prefix*: the timeline signal shows ``seq`` only once every step up to
``seq`` is done. ``await fence`` on a step therefore also means "everything the
device was given before it is done" -- what ``synchronize`` needs -- while the
cross-queue ordering of individual commands uses the queues' own signals.

The signal value is ``seq`` folded into epochs of ``WRAP`` = 2**31 steps, as
HCQ does for its 32-bit hardware counters: epoch ``e`` counts 1..WRAP on signal
``e % 2``; the first step of a new epoch resets the other (shadow) signal to 0
and continues there. A fence keeps its own signal, so fences of the previous
epoch stay reached.

Where the native library is there (``hcqa/_native/lane.py``) the completion state lives
in C (``hcqa_tl_*``): a native lane completes steps without Python, a Python engine
through one short call, both under the same mutex. Foreign steps are known here (a
Python set); whoever completes or encodes a step takes it out of the set.

Timeline values are unsigned 64-bit: ``timeline_start`` is at most 2**64 - 1, and ``seq``
counts on past 2**64 here, while C takes it modulo 2**64 (2**64 is a multiple of ``WRAP``,
so a step's epoch parity and value are unchanged; its pending steps are ordered by how far
they are ahead of the completed prefix, which holds across the boundary).
"""

from __future__ import annotations

import threading
from typing import Any

from hcqa import commands as cmd
from hcqa._native import lane as _lanes
from hcqa._native.lane import library
from hcqa.signals import Fence, Signal

__all__ = ["WRAP", "Timeline"]

WRAP = 1 << 31
_fence = cmd.maker(Fence)  # (signal, value, hang_limit, context, device)


def _epoch(seq: int) -> int:
    return (seq - 1) // WRAP if seq > 0 else 0


def _value(seq: int) -> int:
    return (seq - 1) % WRAP + 1 if seq > 0 else 0


class Timeline:
    """Steps reserved on the caller's task, completed by engine threads."""

    def __init__(self, name: str, *, hang_limit: float, owner: Any, start: int = 0) -> None:
        self.name = name
        made: list[Signal] = []
        try:
            for what in ("timeline", "timeline shadow", "foreign steps"):
                made.append(Signal(name=f"{name} {what}"))
        except BaseException:  # (no fd left, say): none of them waits for the GC
            for s in made:
                s.close()
            raise
        self.signals = (made[0], made[1])
        self.reserved = start
        self.done = start
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._hang_limit = hang_limit
        self._owner = owner
        self._context = f"{name} timeline"
        # Steps another device's engine completes (a transfer reading our memory): the
        # device may only release its memory once all of them are done.
        self._foreign: set[int] = set()
        self.foreign_reserved = 0
        self.foreign_done = made[2]
        for s in (*self.signals, self.foreign_done):
            s._guarded = False  # closed by the device only once every writer is done
            # Written only through _set_from_engine / ``value``, which write the eventfd
            # after the value whenever a waiter is listed: a trio wait on them needs no
            # re-reader (no timer while a fence is awaited; hang limits are still timed).
            s._rereads = False
        if start:
            self.signals[_epoch(start) % 2].value = _value(start)
        self._native = library()
        self._lanes: set[int] = set()  # native lanes handed a step of this timeline
        self._closed = False
        self.c_address: int | None = None  # the C timeline's address, where there is one
        if self._native is not None:
            s0, s1, fd = self.signals[0], self.signals[1], self.foreign_done
            self.c_address = self._native.tl_new(
                start, s0.address, s0.fd, s1.address, s1.fd, fd.address, fd.fd
            )

    def take_foreign(self, seq: int) -> bool:
        """Whether step ``seq`` is another device's (and forget it: it completes once)."""
        if not self._foreign:  # (reserved on the caller's thread, before it is encoded)
            return False
        with self._lock:
            if seq in self._foreign:
                self._foreign.discard(seq)
                return True
            return False

    @property
    def signal(self) -> Signal:
        """The signal of the current epoch."""
        return self.signals[_epoch(self.reserved) % 2]

    def reserve(self) -> int:
        seq = self.reserved + 1
        if seq > WRAP and _value(seq) == 1:
            shadow = self.signals[_epoch(seq) % 2]
            shadow.value = 0
            shadow._failed.clear()
        self.reserved = seq
        return seq

    def reserve_foreign(self) -> int:
        """Reserve a step that another device's engine will complete."""
        seq = self.reserve()
        with self._lock:
            self._foreign.add(seq)
        self.foreign_reserved += 1
        return seq

    def fence(self, seq: int) -> Fence:
        if 0 < seq <= WRAP:  # the first epoch (every launch path asks: keep it lean)
            signal, value = self.signals[0], seq
        else:
            signal, value = self.signals[_epoch(seq) % 2], _value(seq)
        return _fence(signal, value, self._hang_limit, self._context, self._owner)

    def fail(self, seq: int, exc: BaseException) -> None:
        """Step ``seq``'s batch failed alone (its work was not run): its fence raises
        ``exc`` once reached; the step still completes (the timeline goes on)."""
        self.signals[_epoch(seq) % 2]._fail_value(_value(seq), exc)

    def give_back_foreign(self, seq: int) -> None:
        """Undo :meth:`take_foreign` (a record that was never queued)."""
        with self._lock:
            self._foreign.add(seq)

    def complete(self, seq: int) -> None:
        """Engine threads: step ``seq`` is done."""
        if self.c_address is not None:
            assert self._native is not None
            if self._native.tl_complete(self.c_address, seq, self.take_foreign(seq)):
                raise MemoryError(f"{self.name} timeline: no memory for step {seq}")
            return
        with self._lock:
            self._advance(seq)
            if seq in self._foreign:  # last: the owner may release everything after this
                self._foreign.discard(seq)
                self.foreign_done._set_from_engine(self.foreign_done.value + 1)

    def _advance(self, seq: int) -> None:
        old = self.done
        if seq != old + 1:
            self._pending.add(seq)
            return
        new, pending = seq, self._pending
        while new + 1 in pending:
            new += 1
            pending.discard(new)
        self.done = new
        if _epoch(old) != _epoch(new) and old > 0:
            self.signals[_epoch(old) % 2]._set_from_engine(WRAP)
        self.signals[_epoch(new) % 2]._set_from_engine(_value(new))

    def close(self) -> None:
        """Close the signals and free the C timeline -- both only once every native lane
        handed one of our steps has run past it: a lane completing another device's step
        stores the foreign count (which lets the owner close) before it lets go of the C
        timeline and writes the eventfd."""
        self._closed = True
        if self.c_address is not None:
            # The mutex first: an OpenCL driver's callback completing our last foreign step
            # (a transfer it ran) stores the foreign count and writes every eventfd while it
            # holds the mutex, so once the mutex is ours it has left, before our signals
            # close. tl_free takes it; tl_done too, where the lanes defer the free.
            assert self._native is not None
            free, address = self._native.tl_free, self.c_address
            self.c_address = None
            if self._lanes:
                self._native.tl_done(address)  # (before defer: a sweep may free it at once)
            if not (self._lanes and _lanes.defer(lambda: free(address), self._lanes)):
                free(address)
        for s in (*self.signals, self.foreign_done):
            s._lanes |= self._lanes  # their slots' release waits for those lanes too
            s.close()
