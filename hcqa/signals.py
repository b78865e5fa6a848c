"""Timeline signals: 64-bit counters in shared memory that waiters sleep on.

Theory of operation
-------------------
A :class:`Signal` is a 32-byte slot in a page of shared memory (a memfd mapped
``MAP_SHARED``) -- a value word and a timestamp word, both uint64 -- plus an
eventfd. Anyone who can write the memory can advance the signal: an engine
thread, a C kernel given :attr:`Signal.address`, a forked child, a device. A
producer writes the value *first* and then adds 1 to the eventfd; the eventfd
only says "look again", the value word is the truth.

Waiters park the way tasks park in trio's ``ParkingLot``: one waiter of the process
owns the eventfd and sleeps on it, the others are parked and woken by the owner
(``_signals/parking.py`` tells how; :class:`Signal` gets its waits from that mixin).

No wake-up is lost: a waiter registers itself *before* it reads the value, and
an in-process producer writes the value *before* it looks for registered
waiters (the GIL orders the two). A producer that cannot see the waiter list
(another process, native code) always writes the eventfd.

Memory-only producers: a device, a DMA engine or a C kernel may write the value
word and never touch the eventfd. So memory is also re-read on a timer that backs
off -- first after ``BACKOFF_FIRST`` seconds, then twice as long each time, never
longer than ``BACKOFF_MAX``: a thread owner by its ``poll`` timeout, a task owner
by its run's re-reader (``_signals/rereader.py``), which writes the eventfd of a signal
whose value changed. A value written only to memory is therefore seen within
``BACKOFF_MAX`` (plus scheduling) however long the wait has lasted, and an idle
wait costs about ``1 / BACKOFF_MAX`` short wake-ups a second, under 1 % of a core
(on a VM whose vCPUs wake cold, about what a bare trio timer of that period costs).
There is no spin budget at all.

Breaking: a faulted device (or :meth:`Signal.close`) *breaks* a signal with an
exception. Waiters whose target is already reached return normally; all others
raise that very exception instance.
"""

from __future__ import annotations

import ctypes
import os
import platform
import stat
import threading
import time
import weakref
from typing import Any

import attrs
import trio

from hcqa._native import lane as _lanes
from hcqa._signals.fence import Fence
from hcqa._signals.parking import ParkingLot, _check_target
from hcqa._signals.slots import PAGE, SLOT, Page, pool
from hcqa._signals.waiters import Waiter
from hcqa.errors import DeviceClosed, InvalidCommand

__all__ = ["Fence", "Signal", "SignalStatistics"]


_counter = iter(range(1, 2**62))

# Where releasing a lock is not a full memory barrier, a waiter that lowered its slot's
# wake word fences before it reads the value again (see ParkingLot._rearm).
_WEAK_ORDER = platform.machine().lower() not in {"x86_64", "amd64", "i386", "i686", "x86"}


def _full_fence() -> Any:
    """The native full barrier, or None without the native library (then no native
    producer reads the wake word: there is nothing to order)."""
    lib = _lanes.library()
    return None if lib is None else lib.full_fence


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


class Signal(ParkingLot):
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
        self._addr = addr  # the value word's address (native producers)
        # The slot's third word: the lowest target a waiter of this process is listed
        # with (see ParkingLot._rearm), which native producers read after the value. Kept
        # only for our own slots: an attached slot's word belongs to its exporter.
        self._wake_at: Any = None
        if owned:
            self._wake_at = ctypes.c_uint64.from_address(addr + 16)
            self._wake_at.value = 2**64 - 1
            if _WEAK_ORDER:
                self._fence = _full_fence()
        self._lanes: set[int] = set()  # native lanes handed a record on this slot
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
        self._soon = False  # see ParkingLot._wait_limited
        self._broken: BaseException | None = None
        # Values whose setter's work failed alone (``_fail_value``): a wait that reaches
        # exactly such a value is told (see QueueActor._lost, Fence.wait); rare, small.
        self._failed: dict[int, BaseException] = {}
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

    def _fail_value(self, value: int, exc: BaseException) -> None:
        """Record that the work which sets ``value`` failed alone with ``exc`` (the value
        is still set, the signal is not broken): fences and queue waits on exactly
        ``value`` raise it. Keeps the last 256."""
        failed = self._failed
        if len(failed) >= 256:
            del failed[next(iter(failed))]
        failed[value] = exc

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
        if self._lanes and _lanes.defer(self._release_now, self._lanes):
            return  # a native lane may still hold a record on the slot: later
        self._release_now()

    def _release_now(self) -> None:
        if not self._finalizer.alive:
            return
        try:
            trio.lowlevel.notify_closing(self._fd)
        except RuntimeError:
            pass  # not inside a trio run: nobody can be in wait_readable on it here
        self._finalizer()
