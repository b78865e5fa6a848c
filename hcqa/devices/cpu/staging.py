"""Staged copies with their chunks in flight: the fill of one chunk beside the drain of another.

Theory of operation
-------------------
A cpu device opened with ``host_visible=False`` stands for a device whose memory the host can't
address: a host copy goes through the staging ring (``memory.StagingRing``) a chunk at a time,
the host side filling a chunk, the "device" side copying it on. Done one after the other on the
copy engine, every byte is copied twice in turn and the copy runs at half the host's bandwidth.
:class:`Drain` is the device's side, as a DMA engine would be: a thread of the device's own
that copies filled chunks to their destination (``memmove`` releases the GIL), so the copy
engine fills chunk *i + 1* while chunk *i* drains, up to the ring's depth in flight.

The copy engine waits for every drain of a copy before the copy's command completes (its
signal, its timeline step), so completion means what it meant. A chunk is filled again only
after its last drain finished. The thread is started at the first staged copy and joined when
the device releases its memory (``CpuDevice._release``); it never touches trio.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from collections.abc import Callable

from hcqa.devices.memory import StagingRing

__all__ = ["Drain"]

_memmove = ctypes.memmove


class Drain:
    """The device side of staged copies: a thread that copies filled chunks on."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: collections.deque[tuple[int, int, int] | None] = collections.deque()
        self._cond = threading.Condition()
        self._done = 0  # chunks drained so far
        self._queued = 0
        self._thread: threading.Thread | None = None

    def copy(
        self,
        ring: StagingRing,
        dest: int,
        nbytes: int,
        fill: Callable[[int, int, int], object],
        reserved: int,
    ) -> None:
        """Move ``nbytes`` to ``dest`` through ``ring``: ``fill(chunk, offset, size)`` writes
        each chunk on this (the copy engine's) thread while earlier chunks drain; returns
        once every chunk reached ``dest`` (also when ``fill`` raises)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"hcqa {self.name} drain", daemon=True
            )
            self._thread.start()
        marks: collections.deque[int] = collections.deque()  # each chunk's drain number
        try:
            for offset, size in ring.split(nbytes):
                if len(marks) >= ring.chunks:  # the chunk about to be reused: drained first
                    self._wait(marks.popleft())
                index, chunk, _ = ring.acquire()
                fill(chunk.address, offset, size)
                with self._cond:
                    self._jobs.append((dest + offset, chunk.address, size))
                    self._queued += 1
                    marks.append(self._queued)
                    self._cond.notify()
                ring.release(index, reserved)
        finally:
            if marks:
                self._wait(marks[-1])

    def _wait(self, mark: int) -> None:
        with self._cond:
            while self._done < mark:
                self._cond.wait()

    def _run(self) -> None:
        cond, jobs = self._cond, self._jobs
        while True:
            with cond:
                while not jobs:
                    cond.wait()
                job = jobs.popleft()
            if job is None:
                return
            _memmove(*job)
            with cond:
                self._done += 1
                cond.notify_all()

    def close(self) -> None:
        """Stop and join the thread (no copy is in flight: the engines were joined)."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._jobs.append(None)
            self._cond.notify_all()
        thread.join()
        self._thread = None
