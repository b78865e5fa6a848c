"""A device's lifetime: starting its queues, closing them (drain or cancel), releasing it.

Theory of operation
-------------------
``open_device`` (``opening.py``) starts both queue actors in its nursery (``_start``). On
leaving the block it closes the queues' input (``_close_input``: the actors drain what was
queued) -- or, when the block raised or was cancelled, first abandons pending work
(``_cancel``: the engines skip what they have not started). Before memory goes away it
waits, shielded and within the hang limit, for other devices' engines still reading this
device's memory (``_wait_foreign``). ``_release`` then closes the timeline, the queue
signals, the engines' doorbells and the memory -- unless an engine is stuck, when
everything it may still touch is left mapped and the device is marked hung. A device whose
construction failed part-way closes what it made at once (``_abandon_build``).

This is a mixin of :class:`~hcqa.devices.base.Device`, which sets the attributes declared
below.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import trio

from hcqa.errors import DeviceClosed, HcqaError
from hcqa.signals import Signal

if TYPE_CHECKING:
    from hcqa.actors import QueueActor
    from hcqa.devices.memory import CachingAllocator, HostMemory
    from hcqa.devices.timeline import Timeline

__all__ = ["Lifetime"]


class Lifetime:
    """Starting, closing and releasing a device (see the module doc)."""

    name: str
    hang_limit: float
    allocator: CachingAllocator
    compute: QueueActor
    copy: QueueActor
    _queues: dict[str, QueueActor]
    _timeline: Timeline
    _closed: bool
    _closing: bool
    _hung: bool
    _still_read: bool
    _shared: weakref.WeakSet[HostMemory]

    async def _start(self, nursery: trio.Nursery) -> None:
        await nursery.start(self.compute.run)
        await nursery.start(self.copy.run)

    def _cancel(self) -> None:
        """Abandon pending work: engines skip what they have not started."""
        closed = DeviceClosed(f"{self.name} was closed with work pending (cancelled)")
        closed.abandoned = True  # type: ignore[attr-defined]  # (see QueueActor._batch)
        for actor in self._queues.values():
            if actor.engine.error is None:
                actor.engine.error = closed

    async def _close_input(self) -> None:
        self._closing = True
        for actor in self._queues.values():
            await actor.close_input()

    async def _wait_foreign(self) -> None:
        """Wait (shielded, within the hang limit) until other devices' engines have
        completed every step that reads this device's memory."""
        tl = self._timeline
        if tl.foreign_done.value >= tl.foreign_reserved:
            return
        with trio.CancelScope(shield=True):
            try:
                await tl.foreign_done._wait_limited(
                    tl.foreign_reserved, self.hang_limit, f"{self.name} closing", observe=False
                )
            except HcqaError:
                self._hung = True
                self._still_read = True  # by a stuck device: keep the memory mapped

    def _release(self) -> None:
        """Close signals and memory once the actors are done (threads joined)."""
        self._closing = True
        self._closed = True
        if self._still_read or any(a.engine.alive for a in self._queues.values()):
            self._hung = True
            return  # a stuck engine may still write our memory and signals: leave them
        self._timeline.close()
        for actor in self._queues.values():
            actor.engine.join(0)  # closes its doorbell (also for a never-started engine)
            actor.signal.close()
            actor.engine.exited.close()
        self.allocator.close()
        for mem in list(self._shared):
            mem.close()

    def _abandon_build(self) -> None:
        """Close what a construction that failed part-way made: executors (never
        started), queue signals, the timeline, the memory."""
        made = vars(self)
        for thing in made.get("_made", ()):
            if isinstance(thing, Signal):
                thing.close()
            else:
                thing.join(0)
                thing.exited.close()
        if "_timeline" in made:
            self._timeline.close()
        if "allocator" in made:
            self.allocator.close()
