"""Slot pools: ``depth`` sets of per-call buffers, handed to calls in the order they were made.

Theory of operation
-------------------
A pipeline (:class:`hcqa.Pipeline`, ``hcqa.models.pipeline``) owns ``depth`` *slots*, each a
set of buffers and a captured graph; a call runs on one. A :class:`SlotPool` hands them out.

* **Order.** A call joins the pool's *line* (:meth:`SlotPool.join`: at once, from a trio or an
  asyncio task, when the call is made) and keeps its :class:`Turn` until it has queued its
  work (:meth:`Lease.queued`). Only the call at the head of the line takes a slot, so calls
  reach the devices in the order they were made, and a stage with state (``s = x - s``, a KV
  cache, a graph on shared scratch) sees them in that order -- though trio runs the tasks it
  wakes in one round (two waiters for free slots, two asyncio calls handed to the trio host)
  in either order. A call that leaves the line early (cancelled, failed) lets the next go.
  The line is a deque, not a ``trio.Lock``: an asyncio task may hold a place in it.
* **Backpressure.** A ``trio.Semaphore`` of ``depth`` counts the free slots; the head of the
  line waits on it for one.
* **Reclaim.** A slot goes back when its call ends (the :class:`Lease` is left), except when
  the call was cancelled with work still queued on the slot (``Lease.fence`` not reached):
  its buffers are in use until that work is done, so a system task waits for the fence,
  shielded, and then frees it. Cancelled calls can't pile work on the devices beyond
  ``depth``, and the next call on the slot is correct.

:meth:`SlotPool.map` runs a pipeline's ``map``: each item is started once the one before it
has queued its work (or failed), so the items keep their order too.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Generic, TypeVar

import trio

from hcqa.signals import Fence

__all__ = ["Lease", "SlotPool", "Turn"]

S = TypeVar("S")
T = TypeVar("T")


class Turn:
    """A call's place in its pool's line, from the call until it has queued its work."""

    __slots__ = ("_line", "_woken", "left", "on_leave")

    def __init__(self, line: deque[Turn]) -> None:
        self._line = line
        self._woken: trio.Event | None = None  # set once at the head, if it waits for that
        self.left = False
        self.on_leave: Callable[[], None] | None = None

    def leave(self) -> None:
        """Give up the place (idempotent); the next call in line may take a slot."""
        if self.left:
            return
        self.left = True
        line = self._line
        if line[0] is self:
            line.popleft()
            if line and (woken := line[0]._woken) is not None:
                woken.set()
        else:
            line.remove(self)
        if self.on_leave is not None:
            self.on_leave()


class Lease(Generic[S]):
    """One call's slot. ``with lease:`` gives it back at the end (see the module doc); set
    ``fence`` to the last work queued on the slot as it is queued."""

    __slots__ = ("_pool", "fence", "slot", "turn")

    def __init__(self, pool: SlotPool[S], turn: Turn, slot: S) -> None:
        self._pool = pool
        self.turn = turn
        self.slot = slot
        self.fence: Fence | None = None

    def queued(self) -> None:
        """The call's work is queued: the next call in line may go."""
        self.turn.leave()

    def behind(self) -> bool:
        """Whether another call waits in line behind this one."""
        return len(self.turn._line) > 1 and not self.turn.left

    def __enter__(self) -> Lease[S]:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.turn.leave()
        pool, fence = self._pool, self.fence
        if fence is not None and isinstance(exc, (trio.Cancelled, asyncio.CancelledError)):
            pool.cancelled += 1
            if not fence.reached:  # the slot's buffers are in use until it is
                trio.lowlevel.spawn_system_task(pool._reclaim, self.slot, fence)
                return
        pool._give(self.slot)


class SlotPool(Generic[S]):
    """``depth`` slots (given by :meth:`fill`), taken in call order; see the module doc."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.slots: list[S] = []
        self._free: list[S] = []
        self._limit = trio.Semaphore(depth)
        self._line: deque[Turn] = deque()
        self.cancelled = 0  # calls cancelled after they queued work

    def fill(self, slots: Sequence[S]) -> None:
        """The pool's slots, all free (``slots[-1]`` is taken first)."""
        self.slots, self._free = list(slots), list(slots)

    @property
    def in_flight(self) -> int:
        return len(self.slots) - len(self._free)

    def join(self) -> Turn:
        """A place at the end of the line: call it when the call is made, and ``leave()`` it
        in a ``finally`` (a lease leaves it too, once its work is queued)."""
        turn = Turn(self._line)
        self._line.append(turn)
        return turn

    async def take(self, turn: Turn) -> Lease[S]:
        """Wait for ``turn`` to head the line, then for a free slot (when it heads the line
        and a slot is free: at once, in this step -- a batch filled by a request is queued
        without a round of the event loop)."""
        try:
            if self._line[0] is not turn:
                turn._woken = trio.Event()
                await turn._woken.wait()
            try:
                self._limit.acquire_nowait()
            except trio.WouldBlock:
                await self._limit.acquire()
        except BaseException:
            turn.leave()
            raise
        return Lease(self, turn, self._free.pop())

    def take_now(self, ready: Callable[[S], bool]) -> Lease[S] | None:
        """A slot at once, without waiting: if no call is in line, a slot is free and
        ``ready(slot)``; else None."""
        if self._line or self._limit.value < 1 or not ready(self._free[-1]):
            return None
        self._limit.acquire_nowait()
        return Lease(self, self.join(), self._free.pop())

    def _give(self, slot: S) -> None:
        self._free.append(slot)
        self._limit.release()

    async def _reclaim(self, slot: S, fence: Fence) -> None:
        try:
            with trio.CancelScope(shield=True):
                await fence
        except BaseException:  # (its caller is gone: nobody to tell)
            pass
        finally:
            self._give(slot)

    async def map(
        self, count: int, run: Callable[[int, Turn], Awaitable[T]], *, name: str, failed: str
    ) -> list[T]:
        """``[await run(i, turn) for i in range(count)]`` with up to ``depth`` in flight: item
        ``i`` joins the line once item ``i - 1`` has left it. The first failure cancels the
        rest and is raised (an ExceptionGroup ``failed`` only for several different errors)."""
        results: list[Any] = [None] * count
        errors: list[BaseException] = []

        async def one(i: int, scope: trio.CancelScope, task_status: trio.TaskStatus[None]) -> None:
            turn = self.join()
            turn.on_leave = task_status.started
            try:
                results[i] = await run(i, turn)
            except Exception as exc:
                if all(exc is not e for e in errors):
                    errors.append(exc)
                scope.cancel()
            finally:
                turn.leave()

        async with trio.open_nursery() as nursery:
            for i in range(count):  # each queued before the next starts: in order
                await nursery.start(one, i, nursery.cancel_scope, name=f"{name} item {i}")
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup(failed, errors)  # type: ignore[type-var]
        return results
