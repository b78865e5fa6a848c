"""Waiting on a signal from an asyncio task, with no trio hop.

Theory of operation
-------------------
An asyncio task waits in the signal's parking lot like a trio task does (see
``signals.py``), with an asyncio Future where a trio task has
``wait_task_rescheduled``. The waiter's Future is made before the waiter is
listed, so a wake-up delivered from any thread finds it (``Waiter.deliver`` sets it
directly in the loop's thread, else through ``loop.call_soon_threadsafe``).

The *owner* of the signal's eventfd, when it is an asyncio task, sleeps on it with
``loop.add_reader``: the callback drains the eventfd (waking the parked waiters,
trio tasks and threads included) and completes the owner's Future once its target
is reached. The reader stays registered between waits (``aio_readers.py``); the owner
unhooks its callback before it leaves, and leaving hands ownership on exactly as a trio
owner does, so a cancelled asyncio waiter never loses a wake-up.

Cancellation is asyncio's: ``CancelledError`` at the await. The hang limit of a
device's fence is a ``loop.call_later`` timer that ends the park, after which the
value is checked for progress like the trio path does.

Memory-only producers: the owner also re-reads memory on the backoff timer of
``_signals/rereader.py`` (a ``loop.call_later`` chain: 1 ms doubling to 75 ms), exactly as if
the eventfd had fired -- unless the signal says every producer writes the eventfd
(``_rereads`` False: a device's timeline), as a trio owner skips its re-reader.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Protocol

from hcqa._signals import aio_readers as _readers
from hcqa._signals.rereader import BACKOFF_FIRST, BACKOFF_MAX
from hcqa._signals.waiters import Waiter

if TYPE_CHECKING:
    from hcqa.errors import SignalTimeout

__all__ = ["wait_limited"]


class ParkingLot(Protocol):
    """What an asyncio wait uses of its signal: the parking lot's own steps (``parking.py``,
    whose ``ParkingLot`` mixin imports this module and satisfies this)."""

    _fd: int
    _closed: bool
    _rereads: bool

    @property
    def value(self) -> int: ...

    def _claim(self, waiter: Waiter) -> bool: ...

    def _unregister(self, waiter: Waiter) -> None: ...

    def _drain(self) -> None: ...

    def _outcome(self, target: int) -> bool: ...

    def _raise_broken(self, observe: bool = True) -> None: ...

    def _no_progress(
        self, target: int, now: int, hang_limit: float | None, context: str
    ) -> SignalTimeout: ...


async def wait_limited(
    sig: ParkingLot, target: int, hang_limit: float | None, context: str, observe: bool
) -> None:
    """``Signal._wait_limited`` for an asyncio caller."""
    if sig.value >= target:
        await asyncio.sleep(0)
        return
    limit = None if hang_limit is None or math.isinf(hang_limit) else hang_limit
    seen = sig.value
    while not await _park(sig, target, observe, limit):
        now = sig.value
        if now == seen:
            raise sig._no_progress(target, now, hang_limit, context)
        seen = now


async def _park(sig: ParkingLot, target: int, observe: bool, limit: float | None) -> bool:
    """Park until ``target`` is reached (True) or ``limit`` seconds pass (False); raise
    the signal's break error if it broke first."""
    if sig._closed:
        await asyncio.sleep(0)
        sig._raise_broken(observe)
    loop = asyncio.get_running_loop()
    waiter = Waiter(target, trio_task=False)
    waiter.loop = loop
    kept: _readers.Reader | None = None
    expired = False
    timer: asyncio.TimerHandle | None = None  # the memory re-read backoff (owner only)
    hang: asyncio.TimerHandle | None = None
    if limit is not None:  # a plain timer, not asyncio.timeout: a third of the cost

        def expire() -> None:
            nonlocal expired
            expired = True
            fut = waiter.future
            if fut is not None and not fut.done():
                fut.set_result(None)

        hang = loop.call_later(limit, expire)
    try:
        while not expired:
            fut = waiter.future = loop.create_future()
            owner = sig._claim(waiter)  # listed before the value is read
            if sig._outcome(target):
                break
            if owner:  # an owner stays one until it leaves: drain until done

                def readable(fut: asyncio.Future[None] = fut) -> None:
                    sig._drain()
                    if sig._outcome(target) and not fut.done():
                        fut.set_result(None)

                def reread(delay: float) -> None:  # memory-only producers (signals.py)
                    nonlocal timer
                    readable()
                    nxt = min(2 * delay, BACKOFF_MAX)
                    timer = loop.call_later(nxt, reread, nxt)

                kept = _readers.reader(loop, sig)  # (registered once, see aio_readers.py)
                kept.current = readable
                if sig._rereads:  # (else every producer writes the eventfd: no timer)
                    timer = loop.call_later(BACKOFF_FIRST, reread, BACKOFF_FIRST)
                await fut
                break
            await fut  # woken: the target is reached, or we now own the eventfd
    finally:
        if hang is not None:
            hang.cancel()
        if kept is not None:
            kept.current = None
            if sig._closed:
                kept.drop()
        if timer is not None:
            timer.cancel()
        sig._unregister(waiter)
    if sig._outcome(target):
        if sig.value < target:
            sig._raise_broken(observe)
        return True
    return False
