"""The waiting half of a :class:`~hcqa.signals.Signal`: its parking lot.

Theory of operation
-------------------
The kernel lets only one reader drain an eventfd, and trio allows one
``wait_readable`` per fd, so at any moment one waiter of the process is the signal's
*owner*: it sleeps on the eventfd (``wait_readable`` for a trio task, ``poll`` for a
thread), and every other waiter is *parked* (``wait_task_rescheduled`` for a task, a
held lock for a thread, an asyncio Future for an asyncio task through
``_signals/aio_wait.py``). Each wait loops on :meth:`ParkingLot._claim`: list myself, take
ownership if nobody has it, else park. When the eventfd fires the owner drains it
(:meth:`ParkingLot._drain`), re-reads the value and wakes the parked waiters whose
target is reached. An owner that leaves -- reached, cancelled, timed out -- hands the
eventfd to a parked waiter (:meth:`ParkingLot._unregister`), so a wake-up that lands
in between is still seen: the eventfd keeps counting until somebody drains it.

Two lean paths skip the parking set-up where the caller knows it is alone:
``_wait_sole`` (a process pipeline's caller, a trio task) and ``_wait_alone`` (a
worker's stage thread); both fall back to the full loop when someone else is there.

A trio wait on a signal whose previous trio wait was over before it slept (a native
producer that finishes while the caller is on its way to sleep: a C kernel on a native
lane) takes its checkpoint first and parks only if the value is still short; a wait that
sleeps clears that mark, so a slow producer's waiters park at once again (``_soon``).

A trio owner joins its run's re-reader (``_signals/rereader.py``) unless the signal says every
producer writes the eventfd (``_rereads``); a thread owner re-reads on its ``poll``
timeout. Hang limits are timed by the re-reader too (``_expire``).

This class only waits: the slot, the eventfd, the lock and the waiter list belong to
:class:`~hcqa.signals.Signal`, which declares them.
"""

from __future__ import annotations

import math
import os
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from hcqa._signals import aio_wait as _aio_wait
from hcqa._signals.rereader import BACKOFF_FIRST, BACKOFF_MAX, Rereader, watch
from hcqa._signals.waiters import DONE, OWN, State, Waiter
from hcqa.errors import HcqaError, InvalidCommand, SignalTimeout

__all__ = ["ParkingLot"]

_MAX = 2**64 - 1
_LOCK_MAX = threading.TIMEOUT_MAX  # a longer wait sleeps in several turns of the loop


def _check_target(value: object, what: str = "value") -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidCommand(f"{what!r} must be an int (got {type(value).__name__})")
    if not 0 <= value <= _MAX:
        raise InvalidCommand(f"{what!r} must be in [0, 2**64 - 1] (got {value})")
    return value


class ParkingLot:
    """Waiting on a signal from trio tasks, asyncio tasks and threads (see the module doc).

    A mixin of :class:`~hcqa.signals.Signal`, which sets every attribute below."""

    name: str
    _fd: int
    _value: Any  # ctypes.c_uint64 over the shared slot
    _lock: threading.Lock
    _waiters: dict[Waiter, None]
    _owner: Waiter | None
    _poller: Any
    _alone: bool
    _wake_at: Any  # ctypes.c_uint64 over the slot's wake word (None: not ours to keep)
    # A full memory barrier, called after a waiter lowered the wake word and before it reads
    # the value again; None where the lock's release already is one (x86). See _rearm.
    _fence: Any = None
    _rereads: bool
    _soon: bool  # the last trio wait was over before it slept (see _wait_limited)
    _broken: BaseException | None
    _closed: bool

    if TYPE_CHECKING:

        @property
        def value(self) -> int: ...

        def _finalize(self) -> None: ...

    # -- the parking lot ----------------------------------------------------------------

    def _raise_broken(self, observe: bool = True) -> None:
        exc = self._broken
        assert exc is not None
        if observe and isinstance(exc, HcqaError):
            exc.observed = True
        raise exc

    def _outcome(self, target: int) -> bool:
        """True when a wait for ``target`` is over (reached or broken)."""
        return self.value >= target or self._broken is not None

    def _claim(self, waiter: Waiter) -> bool:
        """At the top of every wait loop: am I the owner? (taking ownership if nobody
        has it). A non-owner is (re)listed as parked, so the owner will wake it."""
        with self._lock:
            self._waiters[waiter] = None  # listed, so producers write the eventfd
            self._lower_wake_at(waiter.target)
            if self._owner is None:
                self._owner = waiter
            if self._owner is waiter:
                return True
            waiter.park_lock()
            waiter.state = State.PARKED
            return False

    def _unregister(self, waiter: Waiter) -> None:
        heir = None
        with self._lock:
            waiter.state = State.ABORTED
            self._waiters.pop(waiter, None)
            self._rearm()
            if self._owner is waiter:
                self._owner = None
                for candidate in self._waiters:
                    if candidate.state is State.PARKED:
                        heir = candidate
                        heir.state, heir.msg = State.WOKEN, OWN
                        self._owner = heir
                        break
            last = self._closed and self._owner is None and not self._waiters
        if heir is not None:
            heir.deliver()
        if last:
            self._finalize()

    def _lower_wake_at(self, target: int) -> None:
        """Under the lock, as a waiter lists itself: lower the wake word to ``target`` if it
        is higher (native producers look here, see :meth:`_rearm`), then fence where a
        lock's release is no full barrier, before the waiter reads the value."""
        wake_at = self._wake_at
        if wake_at is not None and target < wake_at.value:
            wake_at.value = target
            if self._fence is not None:
                self._fence()

    def _rearm(self) -> None:
        """Under the lock, after a waiter left the list: the slot's wake word says the
        lowest target still listed (0 while a thread waits alone: every write; 2**64-1
        for nobody). Native producers (C lanes, driver callbacks) store the value, then
        read this word, and write the eventfd only when the value reaches it -- the rule
        :meth:`Signal._set_from_engine` applies with the waiter list.

        Both sides store, then load the other's word (Dekker's pattern): the producer's
        store and load are sequentially consistent in C; a waiter lowers the word under
        the lock and reads the value after releasing it, which on x86 is a locked
        instruction, a full barrier. Elsewhere (ARM, POWER: a release is not one) the
        waiter calls ``_fence``, a C ``atomic_thread_fence(seq_cst)``, in between."""
        wake_at = self._wake_at
        if wake_at is not None:
            if self._alone:
                wake_at.value = 0
            elif not self._waiters:
                wake_at.value = _MAX
            else:
                wake_at.value = min([w.target for w in self._waiters])

    def _drain(self) -> None:
        """Owner only: consume the eventfd and wake the parked waiters that are done."""
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            pass
        if len(self._waiters) <= 1:
            return  # only the owner is listed: nobody to wake (one who lists itself
            # now reads the value after listing, so it sees whatever made us drain)
        value = self.value
        broken = self._broken is not None
        with self._lock:
            done = [
                w
                for w in self._waiters
                if w is not self._owner
                and w.state is State.PARKED
                and (broken or w.target <= value)
            ]
            for w in done:
                w.state, w.msg = State.WOKEN, DONE
                del self._waiters[w]
            self._rearm()
        for w in done:
            w.deliver()

    # -- waiting from trio ------------------------------------------------------------------

    async def wait(self, value: int) -> None:
        """Return once ``self.value >= value``; raise the break error if broken first.

        A checkpoint; cancel it with trio cancel scopes (``trio.fail_after``).
        """
        await self._wait_limited(_check_target(value), None, "")

    async def _wait_limited(
        self, target: int, hang_limit: float | None, context: str, *, observe: bool = True
    ) -> None:
        """Wait, raising :class:`SignalTimeout` when the value makes no progress for
        ``hang_limit`` seconds (None or inf: no limit; it is checked by the run's
        re-reader, see ``_signals/rereader.py``, so the error comes between one and 1.25 limits
        after the last progress)."""
        if not trio.lowlevel.in_trio_task():  # an asyncio caller: park a Future, no trio hop
            return await _aio_wait.wait_limited(self, target, hang_limit, context, observe)
        if self.value >= target:
            await trio.lowlevel.checkpoint()
            return
        if self._soon:  # the last wait was over before it slept: the checkpoint first
            await trio.lowlevel.checkpoint()
            if self.value >= target:
                return
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        if hang_limit is None or math.isinf(hang_limit):
            await self._park(target, observe)
        elif not await self._park(target, observe, hang_limit):
            raise self._no_progress(target, self.value, hang_limit, context)

    def _no_progress(
        self, target: int, now: int, hang_limit: float | None, context: str
    ) -> SignalTimeout:
        """The timeout of a wait that saw no progress for a whole hang limit (trio and
        asyncio waits raise the same one)."""
        where = f"{context}: " if context else ""
        return SignalTimeout(
            f"{where}signal {self.name!r} did not reach {target} within the hang "
            f"limit of {hang_limit:g} s (value {now}, no progress)",
            signal=self.name,
            expected=target,
            seen=now,
        )

    async def _park(
        self, target: int, observe: bool = True, hang_limit: float | None = None
    ) -> bool:
        """Park until ``target`` is reached (True); raise the break error otherwise.
        Internal waits (a queue waiting for another queue) pass ``observe=False``:
        raising the error to them is not raising it to a user. With a ``hang_limit``,
        False when it passed with no progress (the run's re-reader times the wait)."""
        if self._closed:
            await trio.lowlevel.cancel_shielded_checkpoint()
            self._raise_broken(observe)
        rereader = watch()
        waiter = Waiter(target, task=trio.lowlevel.current_task(), token=rereader.token)
        yielded = timed = False
        try:
            while True:
                owner = self._claim(waiter)  # listed before the value is read
                if self._outcome(target) or waiter.expired:
                    break
                if hang_limit is not None and not timed:  # timed from its first sleep
                    rereader.time(waiter, self, hang_limit)
                    timed = True
                yielded = True
                if owner:  # an owner stays one until it leaves: drain until done
                    await self._own(target, waiter, rereader if self._rereads else None)
                    break
                waiter.parked = True
                try:
                    await trio.lowlevel.wait_task_rescheduled(self._aborter(waiter))
                finally:
                    waiter.parked = False
        finally:
            if timed:
                rereader.untime(waiter)
            self._unregister(waiter)
        self._soon = not yielded
        if not yielded:  # reached between the caller's check and ours: still schedule
            await trio.lowlevel.cancel_shielded_checkpoint()
        if self.value >= target:
            return True
        if self._broken is not None or not waiter.expired:
            self._raise_broken(observe)
        return False

    async def _wait_sole(self, target: int) -> None:
        """:meth:`wait` for a trio task that is most often the signal's only waiter (a
        process pipeline's caller, after it fed its item): when nobody owns the eventfd
        it takes it and sleeps on it with none of the parking lot's set-up (no abort
        callback, no re-claim loop, no re-reader unless the signal needs one), and leaves
        through the owner's usual exit -- ``_unregister`` hands the eventfd to a waiter
        that parked meanwhile, so none is lost. Else (an owner is there, the signal is
        closed, or the caller is an asyncio task) it is :meth:`wait`."""
        if self._owner is not None or self._closed or not trio.lowlevel.in_trio_task():
            await self._wait_limited(target, None, "")
            return
        if self.value >= target:
            await trio.lowlevel.checkpoint()
            return
        waiter = Waiter(target, trio_task=True)
        with self._lock:
            owner = self._owner is None and not self._closed
            if owner:
                self._waiters[waiter] = None  # listed before the value is read again
                self._owner = waiter
                self._lower_wake_at(target)
        if not owner:  # a thread took it in between
            await self._wait_limited(target, None, "")
            return
        yielded = False
        try:
            if not self._outcome(target):  # listed first, then the value read again
                yielded = True
                await self._own(target, waiter, watch() if self._rereads else None)
        finally:
            self._unregister(waiter)
        if not yielded:  # reached (or broken) before any sleep: still schedule
            await trio.lowlevel.cancel_shielded_checkpoint()
        if self.value < target:
            self._raise_broken()

    async def _own(self, target: int, waiter: Waiter, rereader: Rereader | None) -> None:
        """The owner's sleep, shared by :meth:`_park` and :meth:`_wait_sole`: the caller
        owns the eventfd and found the wait not over; sleep on the eventfd and drain it
        until the wait is reached, broken or expired. With ``rereader``, memory-only
        writes reach the eventfd through it (``_rereads``)."""
        if rereader is not None:
            rereader.add(self)
        try:
            while True:
                await trio.lowlevel.wait_readable(self._fd)  # a checkpoint: cancels land here
                self._drain()
                if self._outcome(target) or waiter.expired:
                    return
        finally:
            if rereader is not None:
                rereader.remove(self)

    def _aborter(self, waiter: Waiter) -> Callable[[Any], trio.lowlevel.Abort]:
        """The abort callback of a parked trio waiter (made only when one parks: the
        owner, the common case, sleeps in ``wait_readable`` and needs none)."""

        def abort(_: Any) -> trio.lowlevel.Abort:
            with self._lock:
                if waiter.state is not State.PARKED:
                    return trio.lowlevel.Abort.FAILED  # a wake-up is on its way
                waiter.state = State.ABORTED
                waiter.parked = False
                self._waiters.pop(waiter, None)
                self._rearm()
            return trio.lowlevel.Abort.SUCCEEDED

        return abort

    def _expire(self, waiter: Waiter) -> None:
        """The re-reader found ``waiter``'s hang limit passed with no progress: wake it
        (in the trio thread) so that its wait ends with a timeout."""
        waiter.expired = True
        with self._lock:
            if self._owner is waiter:
                if not self._closed:
                    os.eventfd_write(self._fd, 1)  # the owner drains, then sees it
                return
            if waiter.state is not State.PARKED:
                return  # already woken (reached, or made the owner): it looks again
            waiter.state, waiter.msg = State.WOKEN, DONE
            self._waiters.pop(waiter, None)
            self._rearm()
        waiter.deliver()

    # -- waiting from threads ------------------------------------------------------------

    def wait_sync(self, value: int, timeout: float | None = None) -> None:
        """Block this (non-trio) thread until ``self.value >= value``; sleeps, never spins.

        Raises :class:`SignalTimeout` after ``timeout`` seconds (``None``: forever).
        """
        target = _check_target(value)
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise InvalidCommand(
                    f"'timeout' must be a number of seconds or None (got {type(timeout).__name__})"
                )
            if not timeout >= 0:
                raise InvalidCommand(f"'timeout' must be >= 0 or None (got {timeout})")
            if math.isinf(timeout):
                timeout = None
        if self.value >= target:
            return
        if self._closed:
            self._raise_broken()
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = Waiter(target, trio_task=False)
        delay = BACKOFF_FIRST
        try:
            owner = False
            while True:
                if not owner:
                    owner = self._claim(waiter)  # listed before the value is read
                if self._outcome(target):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    now = self.value
                    raise SignalTimeout(
                        f"signal {self.name!r} did not reach {target} within {timeout:g} s "
                        f"(value {now})",
                        signal=self.name,
                        expected=target,
                        seen=now,
                    )
                if owner:  # an owner stays one until it leaves
                    # the eventfd, or memory re-read on the backoff timer (see the module doc)
                    wait = delay if remaining is None else min(delay, remaining)
                    self._poll(max(1, math.ceil(wait * 1000)))
                    delay = min(2 * delay, BACKOFF_MAX)
                    self._drain()
                    continue
                assert waiter.lock is not None
                waiter.lock.acquire(timeout=-1 if remaining is None else min(_LOCK_MAX, remaining))
        finally:
            self._unregister(waiter)
        if self.value < target:
            self._raise_broken()

    def _wait_alone(self, target: int) -> None:
        """``wait_sync`` for a thread that is this signal's only waiter in its process
        (a worker's stage thread): it drains the eventfd itself, with none of the
        parking lot's bookkeeping. Marked ``_alone``, the signal has producers in this
        process write the eventfd too (as for a listed waiter, the mark comes before the
        value is read); :meth:`_break` ends the wait with its error."""
        with self._lock:  # the lock's release orders the mark before the value's read
            self._alone = True
            self._rearm()
        value = self._value
        delay = BACKOFF_FIRST
        while value.value < target:
            if self._broken is not None:
                self._raise_broken()
            self._poll(math.ceil(delay * 1000))  # memory re-read on the backoff timer too
            delay = min(2 * delay, BACKOFF_MAX)
            self._drain()

    def _poll(self, ms: int) -> bool:
        """A thread that owns the eventfd sleeps on it, up to ``ms`` milliseconds; True
        when it fired. Only the owner polls, so one poll object serves every thread in
        turn."""
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(ms))
