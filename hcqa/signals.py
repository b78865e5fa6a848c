"""Timeline signals: 64-bit counters in shared memory that waiters sleep on.

Theory of operation
-------------------
A :class:`Signal` is a 32-byte slot in a page of shared memory (a memfd mapped
``MAP_SHARED``) -- a value word and a timestamp word, both uint64 -- plus an
eventfd. Anyone who can write the memory can advance the signal: an engine
thread, a C kernel given :attr:`Signal.address`, a forked child, a device. A
producer writes the value *first* and then adds 1 to the eventfd; the eventfd
only says "look again", the value word is the truth.

Waiters park the way tasks park in trio's ``ParkingLot``, with one twist: the
kernel lets only one reader drain an eventfd, and trio allows one
``wait_readable`` per fd. So at any moment one waiter of the process is the
signal's *owner*. The owner sleeps on the eventfd (``wait_readable`` for a trio
task, ``poll`` for a thread in :meth:`Signal.wait_sync`); every other waiter is
parked (``wait_task_rescheduled`` for a task, a held lock for a thread). When
the eventfd fires the owner drains it, re-reads the value and wakes every
parked waiter whose target is reached. When the owner leaves -- reached,
cancelled, timed out -- it hands ownership to a parked waiter, so a wake-up
that lands in between is still seen: the eventfd keeps counting until somebody
drains it.

No wake-up is lost: a waiter registers itself *before* it reads the value, and
an in-process producer writes the value *before* it looks for registered
waiters (the GIL orders the two). A producer that cannot see the waiter list
(another process, native code) always writes the eventfd.

Memory-only producers: a device, a DMA engine or a C kernel may write the value
word and never touch the eventfd. So memory is also re-read on a timer that backs
off -- first after ``BACKOFF_FIRST`` seconds, then twice as long each time, never
longer than ``BACKOFF_MAX``: a thread owner by its ``poll`` timeout, a task owner
by its run's re-reader (``_rereader.py``), which writes the eventfd of a signal
whose value changed. A value written only to memory is therefore seen within
``BACKOFF_MAX`` (plus scheduling) however long the wait has lasted, and an idle
wait costs about ``1 / BACKOFF_MAX`` short wake-ups a second, well below 1 % of a
core. There is no spin budget at all.

Breaking: a faulted device (or :meth:`Signal.close`) *breaks* a signal with an
exception. Waiters whose target is already reached return normally; all others
raise that very exception instance.
"""

from __future__ import annotations

import ctypes
import math
import os
import select
import stat
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import trio

from hcqa import _aio_wait
from hcqa._rereader import BACKOFF_FIRST, BACKOFF_MAX, watch
from hcqa._slots import PAGE, SLOT, Page, pool
from hcqa._waiters import DONE, OWN, State, Waiter
from hcqa.errors import DeviceClosed, HcqaError, InvalidCommand, SignalTimeout
from hcqa.fence import Fence

__all__ = ["Fence", "Signal", "SignalStatistics"]

_MAX = 2**64 - 1
_LOCK_MAX = threading.TIMEOUT_MAX  # a longer wait sleeps in several turns of the loop


_counter = iter(range(1, 2**62))

# Once the process has forked, waiters may live in another process that this one
# cannot see: from then on every write of a value also writes the eventfd. The
# child starts with empty parking lots: the parent's waiters are not its own.
_forked = False
_live: weakref.WeakSet[Signal] = weakref.WeakSet()


def _note_fork() -> None:
    global _forked
    _forked = True


def _after_fork_in_child() -> None:
    _note_fork()
    for sig in list(_live):
        sig._lock = threading.Lock()
        sig._waiters = {}
        sig._owner = None
        sig._poller = None  # it may have been mid-poll in a parent thread


os.register_at_fork(before=_note_fork, after_in_child=_after_fork_in_child)


@attrs.frozen(kw_only=True)
class SignalStatistics:
    """What :meth:`Signal.statistics` reports."""

    name: str
    value: int
    waiters: int
    owner: str  # "none", "task" or "thread"
    broken: bool
    closed: bool


def _check_target(value: object, what: str = "value") -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidCommand(f"{what!r} must be an int (got {type(value).__name__})")
    if not 0 <= value <= _MAX:
        raise InvalidCommand(f"{what!r} must be in [0, 2**64 - 1] (got {value})")
    return value


def _check_page_fd(fd: object) -> None:
    """Refuse (before taking it) what can't be a signal page: not an open memfd or file
    of at least one page."""
    if isinstance(fd, bool) or not isinstance(fd, int):
        raise InvalidCommand(f"'page_fd' must be an int fd (got {type(fd).__name__})")
    try:
        st = os.fstat(fd)
    except (OSError, OverflowError):
        raise InvalidCommand(f"'page_fd' must be an open memfd (got fd {fd}, not open)") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size < PAGE:
        raise InvalidCommand(
            f"'page_fd' must be a memfd of at least {PAGE} bytes "
            f"(got fd {fd} of {st.st_size} bytes, mode {stat.filemode(st.st_mode)})"
        )


def _release(fd: int, page: Page, index: int, peers: list[int], owned: bool) -> None:
    os.close(fd)
    for peer in peers:
        os.close(peer)
    peers.clear()
    if owned:
        pool.give(page, index)
    else:
        page.close()


class Signal:
    """A 64-bit timeline value in shared memory that tasks and threads can wait on.

    ``await sig.wait(v)`` returns once ``sig.value >= v``; ``sig.value = v`` wakes
    every waiter whose target is reached.
    """

    def __init__(self, value: int = 0, *, name: str | None = None) -> None:
        value = _check_target(value)
        if name is not None and not isinstance(name, str):
            raise InvalidCommand(f"'name' must be a str (got {type(name).__name__})")
        page, index = pool.take()
        self._setup(page, index, name, owned=True)
        self._value.value = value

    @classmethod
    def attach(cls, page_fd: int, index: int, *, name: str | None = None) -> Signal:
        """A signal over slot ``index`` of a signal page received from another process.

        Takes ownership of ``page_fd``. Add the exporting side's eventfd with
        :meth:`add_peer` so that values set here wake its waiters too."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise InvalidCommand(f"'index' must be an int (got {type(index).__name__})")
        if not 0 <= index < PAGE // SLOT:
            raise InvalidCommand(f"'index' must be in [0, {PAGE // SLOT}) (got {index})")
        _check_page_fd(page_fd)
        sig = cls.__new__(cls)
        sig._setup(Page(page_fd), index, name, owned=False)
        return sig

    def _setup(self, page: Page, index: int, name: str | None, *, owned: bool) -> None:
        self.name = name if name is not None else f"signal#{next(_counter)}"
        self._page, self._index = page, index
        addr = self._page.base + self._index * SLOT
        self._value = ctypes.c_uint64.from_address(addr)
        self._stamp = ctypes.c_uint64.from_address(addr + 8)
        self._fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._peers: list[int] = []
        self._lock = threading.Lock()
        self._waiters: dict[Waiter, None] = {}
        self._owner: Waiter | None = None
        self._poller: Any = None  # the owning thread's select.poll, kept across waits
        self._alone = False  # a thread waits with _wait_alone: always write the eventfd
        # Whether a producer may write the value without the eventfd (a device, a C
        # kernel): then a trio owner of the eventfd joins the run's re-reader. An owner
        # that knows every producer writes the eventfd after the value (another hcqa
        # process through ``add_peer``, say) clears it and waits with no timer at all.
        self._rereads = True
        self._broken: BaseException | None = None
        self._closed = False
        # Engine writes hold the lock close() takes (see _set_from_engine). A device
        # clears this for its own signals, which it closes only after joining every
        # thread that writes them: they skip the lock.
        self._guarded = True
        self._final = 0
        self._finalizer = weakref.finalize(
            self, _release, self._fd, self._page, self._index, self._peers, owned
        )
        _live.add(self)

    # -- reading and writing -------------------------------------------------------------

    @property
    def value(self) -> int:
        """The current value (read from the shared slot)."""
        return self._final if self._closed else self._value.value

    @value.setter
    def value(self, value: int) -> None:
        value = _check_target(value)
        if self._closed:
            raise DeviceClosed(f"signal {self.name!r} is closed")
        self._set_from_engine(value)

    def _set_from_engine(self, value: int) -> None:
        """Write the value, then wake: this process's waiters (through the eventfd, if
        any may be parked) and every peer process. The engines' fast path: no argument
        checks; a closed signal is left alone. The check and the writes hold the lock
        that :meth:`close` takes to mark the signal closed, so a write queued before a
        close can never land in the slot (or the fds) after they were recycled."""
        if self._guarded:
            with self._lock:
                if self._closed:
                    return
                self._value.value = value
                for peer in self._peers:  # first: another process's sleeper wakes sooner
                    os.eventfd_write(peer, 1)
                if (self._waiters and self._wakes(value)) or _forked or self._alone:
                    os.eventfd_write(self._fd, 1)
            return
        # unguarded: a device's own signal, closed only after every writer was joined
        if self._closed:
            return
        self._value.value = value
        for peer in self._peers:
            os.eventfd_write(peer, 1)
        if (self._waiters and self._wakes(value)) or _forked or self._alone:
            os.eventfd_write(self._fd, 1)

    def _wakes(self, value: int) -> bool:
        """Whether a write of ``value`` must wake this process's waiters: one of them
        reached its target. A write that reaches nobody's target (a timeline stepping
        towards the awaited batch) then costs the event loop no wake-up -- and the
        engine no fight for the GIL with a loop that would only go back to sleep. No
        wake-up is lost: a waiter is listed (with its target) before it reads the value,
        and the value is written before this looks. The snapshot is taken in one C call
        (no lock on the unguarded path)."""
        return any(w.target <= value for w in tuple(self._waiters))

    # -- sharing with other processes ------------------------------------------------------

    def export(self) -> tuple[int, int, int]:
        """(page fd, slot index, eventfd): what another process needs to attach.

        Send the fds with SCM_RIGHTS (see ``hcqa.processes.ipc``); this signal keeps owning them."""
        return self._page.fd, self._index, self._fd

    def add_peer(self, eventfd: int) -> None:
        """Also wake ``eventfd`` (another process's waiters) on every value written here.

        ``eventfd`` must be an open eventfd (checked here, so a bad one can't fault the
        device that writes this signal later). Takes ownership of the fd."""
        if isinstance(eventfd, bool) or not isinstance(eventfd, int):
            raise InvalidCommand(f"'eventfd' must be an int fd (got {type(eventfd).__name__})")
        if eventfd < 0:
            raise InvalidCommand(f"'eventfd' must be an open fd >= 0 (got {eventfd})")
        try:
            kind = os.readlink(f"/proc/self/fd/{eventfd}")
        except OSError:
            raise InvalidCommand(
                f"'eventfd' must be an open fd (got {eventfd}, not open)"
            ) from None
        if kind != "anon_inode:[eventfd]":
            raise InvalidCommand(f"'eventfd' must be an eventfd (got fd {eventfd}: {kind})")
        with self._lock:
            if self._closed:
                raise DeviceClosed(f"signal {self.name!r} is closed")
            self._peers.append(eventfd)

    @property
    def timestamp(self) -> float:
        """The timestamp slot in microseconds of ``time.monotonic_ns()``'s clock."""
        return self._stamp.value / 1000.0

    def write_timestamp(self, ns: int | None = None) -> None:
        """Store ``ns`` (default: now, from ``time.monotonic_ns``) in the timestamp slot."""
        if ns is not None:
            ns = _check_target(ns, "ns")
        if self._closed:
            raise DeviceClosed(f"signal {self.name!r} is closed")
        self._stamp_from_engine(time.monotonic_ns() if ns is None else ns)

    def _stamp_from_engine(self, ns: int) -> None:
        """The engines' timestamp write: dropped once the signal is closed (its slot may
        be another signal's by then), under the lock :meth:`close` takes."""
        if not self._guarded:
            self._stamp.value = ns
            return
        with self._lock:
            if not self._closed:
                self._stamp.value = ns

    def _check_queueable(self, verb: str) -> None:
        """Refuse, before anything is queued, a command on this signal that could only
        fail later: any command on a closed signal, or a wait on a signal broken by bad
        input (the signal of a fence handed out during a capture)."""
        if self._closed:
            raise DeviceClosed(f"{verb}: signal {self.name!r} is closed")
        if verb == "wait" and isinstance(self._broken, InvalidCommand):
            raise InvalidCommand(f"wait: signal {self.name!r} can't be waited on ({self._broken})")

    @property
    def address(self) -> int:
        """Address of the uint64 value slot, for native producers (then write :attr:`fd`)."""
        return ctypes.addressof(self._value)

    @property
    def timestamp_address(self) -> int:
        """Address of the uint64 timestamp slot (nanoseconds)."""
        return ctypes.addressof(self._stamp)

    @property
    def fd(self) -> int:
        """The eventfd a producer outside this process's Python must write after the value."""
        return self._fd

    def statistics(self) -> SignalStatistics:
        """A frozen snapshot: value, parked waiters, owner kind, broken/closed."""
        owner = self._owner
        kind = "none" if owner is None else ("task" if owner.task is not None else "thread")
        return SignalStatistics(
            name=self.name,
            value=self.value,
            waiters=len(self._waiters),
            owner=kind,
            broken=self._broken is not None,
            closed=self._closed,
        )

    def __repr__(self) -> str:
        return f"<Signal {self.name} value={self.value}>"

    # -- breaking and closing ------------------------------------------------------------

    def _break(self, exc: BaseException) -> None:
        """Make every unreached wait raise ``exc`` (the first break wins)."""
        with self._lock:
            if self._broken is None:
                self._broken = exc
            if not self._closed:
                os.eventfd_write(self._fd, 1)

    def close(self) -> None:
        """Release the slot and the eventfd; unreached waiters raise :class:`DeviceClosed`."""
        if self._closed:
            return
        self._break(DeviceClosed(f"signal {self.name!r} was closed"))
        with self._lock:  # engines write under this lock: none writes after this
            self._final = self._value.value
            self._closed = True
            busy = bool(self._waiters) or self._owner is not None
        if not busy:
            self._finalize()

    def _finalize(self) -> None:
        if not self._finalizer.alive:
            return
        try:
            trio.lowlevel.notify_closing(self._fd)
        except RuntimeError:
            pass  # not inside a trio run: nobody can be in wait_readable on it here
        self._finalizer()

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
        re-reader, see ``_rereader.py``, so the error comes between one and 1.25 limits
        after the last progress)."""
        if not trio.lowlevel.in_trio_task():  # an asyncio caller: park a Future, no trio hop
            return await _aio_wait.wait_limited(self, target, hang_limit, context, observe)
        if self.value >= target:
            await trio.lowlevel.checkpoint()
            return
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
        yielded = False
        if hang_limit is not None:
            rereader.time(waiter, self, hang_limit)
        try:
            while True:
                owner = self._claim(waiter)  # listed before the value is read
                if self._outcome(target) or waiter.expired:
                    break
                yielded = True
                if owner:  # an owner stays one until it leaves: drain until done
                    rereads = self._rereads
                    if rereads:
                        rereader.add(self)  # memory-only writes reach the eventfd through it
                    try:
                        while True:
                            await trio.lowlevel.wait_readable(self._fd)
                            self._drain()
                            if self._outcome(target) or waiter.expired:
                                break
                    finally:
                        if rereads:
                            rereader.remove(self)
                    break
                waiter.parked = True
                try:
                    await trio.lowlevel.wait_task_rescheduled(self._aborter(waiter))
                finally:
                    waiter.parked = False
        finally:
            if hang_limit is not None:
                rereader.untime(waiter)
            self._unregister(waiter)
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
        if not owner:  # a thread took it in between
            await self._wait_limited(target, None, "")
            return
        rereader = None
        if self._rereads:
            rereader = watch()
            rereader.add(self)  # memory-only writes reach the eventfd through it
        yielded = False
        try:
            fd, value = self._fd, self._value  # the slot stays ours while we are listed
            while value.value < target and self._broken is None:
                yielded = True
                await trio.lowlevel.wait_readable(fd)  # a checkpoint: cancels land here
                self._drain()
        finally:
            if rereader is not None:
                rereader.remove(self)
            self._unregister(waiter)
        if not yielded:  # reached (or broken) before any sleep: still schedule
            await trio.lowlevel.cancel_shielded_checkpoint()
        if self.value < target:
            self._raise_broken()

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
        self._alone = True
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
