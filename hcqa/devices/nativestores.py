"""Completion slots: what a driver backend's native completion does without Python.

Theory of operation
-------------------
A driver backend (OpenCL's event callback, CUDA's host function) completes a segment of a
queue's work through a *slot* of ``WORDS`` uint64 words that its C completion function reads
on the driver's thread (``hcqa/devices/opencl/callback.c``, ``hcqa/devices/cuda/hostfn.c``
share this layout): up to ``MAX_STORES`` signal stores (address, value, eventfd), a call
completing a step of this device's C timeline (``TL_*``), and one completing a transfer's last
step on the other device's C timeline (``TL2_*``). Whatever the slot does, its waiters wake
straight from the driver's thread; the rest is left to the device's pump on the loop.

:class:`NativeStores`, a mixin of each backend's executor, fills a segment's slot from its
bookkeeping: while nothing before it needs Python (a timestamp, say), this queue's own signal,
and this device's timeline step -- through the device's C timeline (``hcqa/_native/lane.py``),
which keeps the completed prefix, the wrap and the wake-ups whatever order steps complete in;
or, without one, directly when every earlier step is done or enqueued before it on this queue
(the pump then does the Python timeline's bookkeeping).

A store writes its signal's eventfd only when a waiter of this process needs the value (the
slot's wake word, ``hcqa_signal_complete`` in ``hcqa/_native/signal_store.h``), as the native
lane's stores do: a completion nobody waits for costs no syscall. Once the process has forked
every store writes it (:func:`watch_forks` tells the compiled completion).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from hcqa import signals as _signals
from hcqa.devices.timeline import WRAP, _value
from hcqa.signals import Signal

__all__ = [
    "MAX_STORES", "WORDS", "NativeStores", "SlotTable", "Words", "keep_forever", "watch_forks",
]  # fmt: skip

WORDS = 20  # uint64 words per slot
FIRED, STATUS, FD, NSTORES, STORES = 0, 1, 2, 3, 4
TL_FN, TL_ARG, TL_SEQ, HOST_NS, WAKE = 10, 11, 12, 13, 14
TL2_FN, TL2_ARG, TL2_SEQ, PRE, DONE = 15, 16, 17, 18, 19  # PRE: CUDA's stores done first
MAX_STORES = 2

Words = ctypes.Array[ctypes.c_uint64]  # one slot's words (ctypes: cheap item access)
_SLOT = ctypes.c_uint64 * WORDS
_lock = threading.Lock()
_abandoned: list[Any] = []  # slot pages a late completion may still write: kept for good
_dead_fd = -1  # the eventfd abandoned slots point at (opened once, never closed)


def _dead() -> int:
    global _dead_fd
    with _lock:
        if _dead_fd < 0:
            _dead_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        return _dead_fd


def watch_forks(lib: ctypes.CDLL) -> None:
    """Have the signal stores of ``lib`` (a compiled completion that includes
    ``signal_store.h``) write every eventfd once the process forks, or at once if it has."""
    note = lib.hcqa_store_note_fork
    note.argtypes = []
    note.restype = None
    os.register_at_fork(before=note)  # first: a fork after the check below is still seen
    if _signals._forked:
        note()


def keep_forever(obj: Any) -> None:
    """Keep ``obj`` (a segment the driver may still complete) for the life of the process."""
    _abandoned.append(obj)


class SlotTable:
    """The completion slots of one device, in pages that live as long as the device (or, once
    a slot is abandoned, as long as the process). Loop-thread bookkeeping only."""

    PAGE = 256

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pages: list[ctypes.Array[ctypes.c_uint64]] = []
        self._free: list[tuple[Words, int]] = []
        self.in_use = 0

    def take(self) -> tuple[Words, int]:
        """A clean slot: (its words, its address)."""
        if not self._free:
            page = (ctypes.c_uint64 * (WORDS * self.PAGE))()
            self._pages.append(page)
            base = ctypes.addressof(page)
            size = WORDS * 8
            self._free.extend(
                (_SLOT.from_buffer(page, i * size), base + i * size) for i in range(self.PAGE)
            )
        words, address = self._free.pop()
        words[FIRED] = words[DONE] = words[NSTORES] = words[STATUS] = words[HOST_NS] = 0
        words[TL_FN] = words[TL2_FN] = words[PRE] = 0
        words[WAKE] = 1
        words[FD] = self.fd
        self.in_use += 1
        return words, address

    def give(self, words: Words, address: int) -> None:
        """Return a slot whose ``done`` word is set."""
        self._free.append((words, address))
        self.in_use -= 1

    def abandon(self, words: Words) -> None:
        """A slot whose completion may come at any time, even after the device is gone."""
        words[FD] = _dead()
        words[NSTORES] = words[TL_FN] = words[TL2_FN] = words[PRE] = 0
        _abandoned.append(self._pages)  # the pages stay mapped for the process's life
        self.in_use -= 1


class NativeStores:
    """Fills a segment's slot with what the native completion can do itself (see the
    module doc). The executor sets the attributes declared below; ``_stores_in_callback``
    is False where the completion runs Python anyway (a ctypes fallback)."""

    device: Any
    kind: str
    timeline: Any
    _native: Any
    _ordered: int

    @property
    def _stores_in_callback(self) -> bool:
        return True

    def _native_stores(self, seg: Any, books: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Write into ``seg.words`` what the native completion does itself, while nothing
        before it needs Python; returns the books left to the pump."""
        words = seg.words
        own = self.device._queues[self.kind].signal
        timeline = self.timeline
        c_timeline = timeline.c_address if self._native.tl_complete else None
        left: list[tuple[Any, ...]] = []
        n = 0
        native = self._stores_in_callback
        for book in books:
            if native and book[0] == "signal" and book[1] is own and n < MAX_STORES:
                self._store(words, n, own, book[2])
                n += 1
                continue
            if native and book[0] == "step" and book[1] is timeline:
                seq = book[2]
                if c_timeline is not None:
                    words[TL_FN] = self._native.tl_complete
                    words[TL_ARG] = c_timeline
                    words[TL_SEQ] = seq
                    native = False  # what follows waits for the pump
                    last = len(books) > 1 and book is books[-2]  # only a step follows
                    foreign = self._foreign_step(books[-1], words) if last else None
                    if foreign is not None:  # a transfer's step on the other device
                        seg.foreign = foreign
                        words[NSTORES] = n
                        return left
                    continue
                in_order = seq - 1 <= timeline.done or seq - 1 == self._ordered
                if in_order and seq % WRAP != 1 and n < MAX_STORES:
                    self._store(words, n, timeline.signals[(seq - 1) // WRAP % 2], _value(seq))
                    n += 1
                    self._ordered = seq
            else:
                native = False
            left.append(book)
        words[NSTORES] = n
        return left

    def _foreign_step(self, book: tuple[Any, ...], words: Any) -> tuple[Any, int] | None:
        """Hand the completion a transfer's last step, on the other device's C timeline (a
        driver device's, or a cpu device's that this copy writes to): (timeline, seq), or
        None to leave it to the pump. The completion finishes the step under that timeline's
        mutex, and its owner takes the mutex before it closes anything the completion
        touches (``Timeline.close``)."""
        if book[0] != "step":
            return None
        tl, seq = book[1], book[2]
        if tl.c_address is None or not tl.take_foreign(seq):
            return None
        words[TL2_FN] = self._native.tl_complete
        words[TL2_ARG] = tl.c_address
        words[TL2_SEQ] = seq
        return tl, seq

    @staticmethod
    def _store(words: Any, i: int, signal: Signal, value: int) -> None:
        base = STORES + 3 * i
        words[base] = signal.address
        words[base + 1] = value
        words[base + 2] = signal.fd
