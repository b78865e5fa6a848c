"""The slot pool of a process pipeline: who may write which shared slot, and when.

Theory of operation
-------------------
A pipeline has ``depth`` slots (each a column of shared buffers: the input of every
stage) and ``loans`` spare output slots. An item takes a slot (and maybe a loan) in
:meth:`SlotPool.take` and gives them back with :meth:`SlotPool.release`, telling
whether the item has *left every stage* (the last stage's ``done`` signal reached its
number). The one rule: **a slot or loan goes back to the free lists only once its item
has left every stage.** An item that has not (its caller was cancelled, left an
``item()`` block early, or the pipeline faulted) is *retired* instead: it waits in a heap
ordered by item number, and :meth:`reclaim` frees every retired item whose number the
last stage has reached. The pipeline calls ``reclaim`` after each completed item and
from its reaper task, which sleeps on the last stage's signal while anything is retired.

Why no interleaving can hand a slot out twice: every path that ends an item --
completion, cancellation at any await, an abandoned block, a fault -- goes through one
``release`` (a ``finally``), and ``release`` only ever frees what the last stage has
finished with (the signal only grows, so "finished" can't become false again); all of
this runs on the trio thread without an await between the check and the free. Lent
loans come back from a finalizer (any thread): they were finished before they were lent,
and ``list.append`` is atomic. A slot freed while tasks wait is handed straight to the
first of them (FIFO), so a newcomer can't overtake it; a cancelled waiter leaves the
queue without a slot, so nothing is lost. :meth:`close` wakes every waiter with the
closing error (``DeviceClosed`` or the pipeline's fault).

The slot table has ``depth`` rows and item ``k`` uses row ``k % depth``: the row is
rewritten by item ``k + depth``, which can only be taken once ``depth`` items have been
freed, and items leave the last stage in order -- so item ``k`` has left every stage.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import trio

__all__ = ["SlotPool"]


class SlotPool:
    """Free slots (LIFO: the warmest goes next), free loans, retired items, waiters."""

    def __init__(self, depth: int, loans: int) -> None:
        self.depth = depth
        self.loans = loans
        self.free = list(range(depth))
        self.free_loans = list(range(depth, depth + loans))
        self.retired: list[tuple[int, int, int]] = []  # heap of (item, slot, output slot)
        self.next = 0  # the last item number handed out
        self._lot = trio.lowlevel.ParkingLot()
        self._handed: dict[trio.lowlevel.Task, int] = {}
        self._error: Callable[[], BaseException] | None = None
        self.retired_event = trio.Event()  # set while something is retired

    def in_flight(self) -> int:
        return self.depth - len(self.free)

    async def take(self, *, fast: bool, loan: bool) -> tuple[int, int, int]:
        """The next item number, a slot and an output slot (a loan if ``loan`` and one is
        free, else the slot itself); waits for a slot while all are taken.

        ``fast``: when a slot is free, take it without a schedule point (for callers sure
        to reach one later)."""
        if self._error is not None:
            raise self._error()
        if self.free:
            if not fast:
                await trio.lowlevel.checkpoint_if_cancelled()
                if self._error is not None:
                    raise self._error()
            if self.free:
                slot = self.free.pop()
                if not fast:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return self._number(slot, loan)
        await self._lot.park()
        task = trio.lowlevel.current_task()
        if self._error is not None:
            self._handed.pop(task, None)
            raise self._error()
        return self._number(self._handed.pop(task), loan)

    def take_nowait(self, *, loan: bool) -> tuple[int, int, int] | None:
        """:meth:`take` with ``fast=True`` when a slot is free (no schedule point: for
        callers sure to reach one later, and cheaper than an ``await``); None when the
        caller must wait for one (or the pool is closed: :meth:`take` raises)."""
        if self.free and self._error is None:
            return self._number(self.free.pop(), loan)
        return None

    def _number(self, slot: int, loan: bool) -> tuple[int, int, int]:
        self.next += 1
        oslot = self.free_loans.pop() if loan and self.free_loans else slot
        return self.next, slot, oslot

    def release(self, k: int, slot: int, oslot: int, *, left: bool, lent: bool = False) -> None:
        """Item ``k`` is over for its caller. ``left``: it has left every stage (its slots
        can be reused now); else it is retired until :meth:`reclaim` sees it leave.
        ``lent``: its loan was handed to the caller (it comes back by :meth:`give_loan`)."""
        if not left:
            heapq.heappush(self.retired, (k, slot, -1 if lent else oslot))
            self.retired_event.set()
            return
        self._put(slot)
        if oslot != slot and not lent:
            self.free_loans.append(oslot)

    def reclaim(self, finished: int) -> None:
        """Free every retired item numbered ``finished`` or less (the last stage's value)."""
        retired = self.retired
        while retired and retired[0][0] <= finished:
            _, slot, oslot = heapq.heappop(retired)
            self._put(slot)
            if oslot not in (slot, -1):
                self.free_loans.append(oslot)
        if not retired and self.retired_event.is_set():
            self.retired_event = trio.Event()

    def give_loan(self, oslot: int) -> None:
        """A lent result and every view of it are gone (any thread)."""
        self.free_loans.append(oslot)

    def _put(self, slot: int) -> None:
        if self._error is None and self._lot:
            (task,) = self._lot.unpark(count=1)
            self._handed[task] = slot  # straight to the first waiter: no overtaking
        else:
            self.free.append(slot)

    def close(self, error: Callable[[], BaseException]) -> None:
        """Refuse every later take and wake every waiter with ``error()``."""
        if self._error is None:
            self._error = error
        self._lot.unpark_all()
