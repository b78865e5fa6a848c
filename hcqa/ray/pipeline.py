"""The driver's side of a Ray pipeline: ``RayPipeline`` (items, faults, the watchdog).

Theory of operation: see the package (``hcqa.ray``); ``opening`` starts and stops the
segments' actors. This module holds the item path -- callers park on an event, the
ready items are cut into batches and each batch walks the segments (a Ray call per
remote segment, chained by ObjectRef; a local process pipeline in the driver) -- and
turns every way a batch can end into each of its callers' result or one sticky fault.

The batches, legs and the wait for Ray (``resolve``) are in ``_batches``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import ray
import trio

from hcqa import aio
from hcqa.errors import DeviceClosed, DeviceFault, HcqaError, SignalTimeout
from hcqa.pipeline import check_input
from hcqa.ray._batches import (
    Batch,
    Item,
    Leg,
    RayPipelineStatistics,
    Runner,
    kill_actors,
    ready_refs,
    resolve,
)
from hcqa.ray._segment import pack, run_items, unpack

__all__ = ["BACKSTOP", "RayPipeline", "RayPipelineStatistics"]

BACKSTOP = 1.5  # the driver's watchdog waits this many hang limits (see _watchdog)


class RayPipeline:
    """Items through stages placed on Ray nodes: ``await pipe(x)``."""

    def __init__(
        self,
        runners: Sequence[Runner],
        *,
        stages: int,
        in_shape: tuple[int, ...],
        dtype: np.dtype[Any],
        depth: int,
        hang_limit: float,
    ) -> None:
        self.runners = tuple(runners)
        self.stages = stages
        self.in_shape = in_shape
        self.dtype = dtype
        self.depth = depth
        self.hang_limit = float(hang_limit)
        self.capacity = depth * len(self.runners)  # items in flight at most
        self.fault: HcqaError | None = None
        self.completed = 0
        self.batches = 0
        self.coalesced = 0
        self._legs = {
            i: Leg(i)
            for i, r in enumerate(self.runners)
            if r.pipe is None and (i == 0 or self.runners[i - 1].pipe is not None)
        }
        self._taken = 0
        self._slot_waiters: deque[trio.Event] = deque()
        self._pending: list[Item] = []
        self._flush_scheduled = False
        self._in_flight: list[Batch] = []  # oldest first
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._draining = False  # the block is ending: no more places are handed out
        self._progress = 0.0  # when a batch last moved (or the pipeline went busy)
        self._idle: trio.Event | None = None  # the watchdog sleeps on it while idle
        self._empty: trio.Event | None = None  # a drain waits on it

    def statistics(self) -> RayPipelineStatistics:
        """A frozen snapshot: where the segments run, items in flight, batches sent."""
        return RayPipelineStatistics(
            stages=self.stages,
            depth=self.depth,
            segments=tuple(r.node for r in self.runners),
            local=tuple(r.pipe is not None for r in self.runners),
            hosts=tuple(r.pid for r in self.runners),
            workers=tuple(r.workers for r in self.runners),
            in_flight=self._taken,
            batches=self.batches,
            coalesced=self.coalesced,
            completed=self.completed,
            faulted=self.fault is not None,
        )

    def __repr__(self) -> str:
        return f"<RayPipeline {self.stages} stages in {len(self.runners)} segments>"

    # -- items ------------------------------------------------------------------------------

    async def __call__(self, x: npt.ArrayLike) -> npt.NDArray[Any]:
        """Run one item through every stage; returns the last stage's output (up to 64
        KiB a writable array; larger, when the last segment is remote, a read-only view
        of the buffer Ray deserialized)."""
        if aio.asyncio_caller():
            return await aio.call(self.__call__, x)
        arr = check_input(x, self.in_shape, self.dtype)
        await self._take()
        item = Item(arr)
        self._pending.append(item)
        if not self._flush_scheduled:
            assert self._nursery is not None
            self._flush_scheduled = True
            self._nursery.start_soon(self._flush, name="ray pipeline batch")
        # A cancelled caller leaves its item to finish (and be dropped); its slot comes
        # back when the item's batch ends, never earlier.
        await item.event.wait()
        if item.error is not None:
            raise item.error
        assert item.value is not None
        return item.value

    def _refusal(self) -> HcqaError:
        if self.fault is not None:
            return self.fault
        if not self._closing:
            return DeviceClosed("the Ray pipeline is closing (its block is ending)")
        return DeviceClosed("the Ray pipeline is closed")

    async def _take(self) -> None:
        """One of ``capacity`` places in flight (FIFO while all are taken)."""
        await trio.lowlevel.checkpoint()  # a cancellation point before anything is taken
        if self._draining or self.fault is not None:
            raise self._refusal()
        if self._taken < self.capacity and not self._slot_waiters:
            self._taken += 1
            return
        event = trio.Event()
        self._slot_waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            if event in self._slot_waiters:
                self._slot_waiters.remove(event)
            elif not (self._draining or self.fault is not None):
                self._give(1)  # handed a place just as it was cancelled: pass it on
            raise
        if self._draining or self.fault is not None:
            raise self._refusal()

    def _give(self, n: int) -> None:
        """``n`` places come back: straight to the first waiters."""
        self._taken -= n
        while self._slot_waiters and self._taken < self.capacity and not self._draining:
            self._taken += 1
            self._slot_waiters.popleft().set()

    async def _flush(self) -> None:
        """Every item ready now, in batches of at most ``depth``: one Ray call per remote
        segment per batch."""
        self._flush_scheduled = False
        items, self._pending = self._pending, []
        batches = [Batch(items[i : i + self.depth]) for i in range(0, len(items), self.depth)]
        if not self._in_flight:
            self._progress = trio.current_time()
            if self._idle is not None:
                self._idle.set()
                self._idle = None
        self._in_flight.extend(batches)
        assert self._nursery is not None
        for b in batches[1:]:
            self._nursery.start_soon(self._run, b, name="ray pipeline batch")
        if batches:
            await self._run(batches[0])

    async def _run(
        self,
        batch: Batch,
        start: int = 0,
        value: Any = None,
        held: Leg | None = None,
    ) -> None:
        """``batch`` through the segments from ``runners[start]`` (a merged batch resumes
        at its leg, ``held`` for it, with its items' ``value``)."""
        if held is None:
            self.batches += 1
            value = [it.x for it in batch.items]
        n = len(batch.items)
        leg: Leg | None = None
        outcome: BaseException | list[npt.NDArray[Any]] | None = None
        try:
            for i in range(start, len(self.runners)):
                r = self.runners[i]
                if r.pipe is not None:
                    if isinstance(value, ray.ObjectRef):
                        seg = r.segment
                        value = unpack(await resolve(value), n, seg.in_shape, seg.dtype)
                        self._moved()
                        self._leave(leg)
                        leg = None
                    batch.at = r
                    try:
                        value = await run_items(r.pipe, value)
                    except HcqaError as exc:
                        raise r.named(exc) from None
                    batch.at = None
                    self._moved()
                else:
                    if isinstance(value, list):
                        value = pack(value)
                    if isinstance(value, list):  # big: one batch in Ray's hands per leg
                        if held is not None:
                            leg, held = held, None
                        else:
                            leg = self._legs[i]
                            if leg.busy:
                                leg.queue.append((batch, value))
                                batch.queued = leg
                                return
                            leg.busy = True
                        # .remote() copies large arguments into Ray's object store on
                        # the calling thread: not on the loop
                        value = await trio.to_thread.run_sync(r.actor.run.remote, value)
                    else:
                        value = r.actor.run.remote(value)
                    batch.hops.append((r, value))
            if isinstance(value, ray.ObjectRef):
                last = self.runners[-1].segment
                value = await resolve(value)
                self._leave(leg)
                leg = None
                value = unpack(value, n, last.out_shape, last.out_dtype, writable=True)
            outcome = value
        except ray.exceptions.RayError as exc:  # before HcqaError: Ray's may subclass both
            outcome = self._ray_fault(exc, batch)
        except HcqaError as exc:
            outcome = exc
        except BaseException as exc:  # cancelled at close, or a bug: never handed over raw
            if self._closing or not isinstance(exc, Exception):
                outcome = DeviceClosed("the Ray pipeline is closed")
            else:
                outcome = DeviceFault(f"the Ray pipeline failed a batch: {exc!r}")
                outcome.__cause__ = exc
            if not isinstance(exc, Exception):
                raise
        finally:
            if batch.queued is None:
                self._end(batch, outcome)
                self._leave(leg)

    def _leave(self, leg: Leg | None) -> None:
        """A batch is out of ``leg``: the big batches queued for it go on, merged into
        one of at most ``depth`` items (the oldest first)."""
        if leg is None:
            return
        leg.busy = False
        if not leg.queue or self.fault is not None or self._closing:
            return
        taken = [leg.queue.pop(0)]
        room = self.depth - len(taken[0][0].items)
        while leg.queue and len(leg.queue[0][0].items) <= room:
            room -= len(leg.queue[0][0].items)
            taken.append(leg.queue.pop(0))
        if len(taken) == 1:
            batch, value = taken[0]
            batch.queued = None
        else:
            batch = Batch([it for b, _ in taken for it in b.items])
            value = [v for _, vs in taken for v in vs]
            for b, _ in taken:
                self._in_flight.remove(b)
            self._in_flight.append(batch)
            self.coalesced += len(taken) - 1
        leg.busy = True
        assert self._nursery is not None
        self._nursery.start_soon(self._run, batch, leg.start, value, leg, name="ray pipeline batch")

    def _end(self, batch: Batch, outcome: BaseException | list[npt.NDArray[Any]] | None) -> None:
        if batch in self._in_flight:
            self._in_flight.remove(batch)
        if isinstance(outcome, list):
            for it, v in zip(batch.items, outcome, strict=True):
                it.finish(v, None)
            self.completed += len(batch.items)
            self._moved()
        else:
            error = outcome if outcome is not None else self._refusal()
            if isinstance(error, HcqaError) and not self._closing:
                self._fault(error)
            for it in batch.items:
                it.finish(None, self.fault or error)
        self._give(len(batch.items))
        if not self._in_flight and self._empty is not None:
            self._empty.set()

    def _moved(self) -> None:
        self._progress = trio.current_time()

    # -- faults ----------------------------------------------------------------------------

    def _runner_of(self, exc: BaseException, batch: Batch) -> Runner | None:
        actor_id = getattr(exc, "actor_id", None)
        if actor_id:
            for r in self.runners:
                if r.actor is not None and r.actor._actor_id.hex() == actor_id:
                    return r
        return batch.hops[-1][0] if batch.hops else None

    def _ray_fault(self, exc: BaseException, batch: Batch) -> HcqaError:
        """Ray's error for a batch as an hcqa error naming the segment and its node."""
        cause = getattr(exc, "cause", None)
        if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, HcqaError):
            return cause  # raised by a SegmentActor: names its stage and node already
        r = self._runner_of(exc, batch)
        who = r.describe() if r is not None else "a segment of the Ray pipeline"
        if isinstance(exc, ray.exceptions.RayActorError):
            what = "its Ray actor died or is unreachable"
        else:
            what = "Ray failed it"
        first = str(exc).strip().splitlines()
        detail = first[0] if first else ""
        fault = DeviceFault(
            f"{who}: {what} ({type(exc).__name__}: {detail})", device=r.node if r else ""
        )
        fault.__cause__ = exc
        return fault

    def _fault(self, fault: HcqaError) -> None:
        """Sticky: every waiting call, and every later one, raises ``fault``; the actors
        are killed."""
        if self.fault is not None:
            return
        self.fault = fault
        self._end_every_call(fault)
        if self._nursery is not None:
            self._nursery.start_soon(self._kill, name="ray pipeline kill")

    async def _kill(self) -> None:
        actors = [r.actor for r in self.runners if r.actor is not None]
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(kill_actors, actors)

    async def _watchdog(self) -> None:
        """No batch moved for ``BACKSTOP * hang_limit`` while items are in flight: the
        pipeline hangs.

        Each segment's own process pipeline watches its stages with ``hang_limit`` and
        names the stalled stage and worker; its fault reaches us through the Ray call.
        This watchdog is the backstop for what can't report -- a node cut off, an actor
        Ray has not yet declared dead -- so it waits two ticks longer. Sleeps while idle;
        else wakes every quarter limit. A batch moves when it leaves a segment: a local
        one (seen directly) or a remote one (its ObjectRef is ready: asked of Ray with a
        zero timeout, off the loop, only on these ticks)."""
        limit = self.hang_limit
        if math.isinf(limit):
            return
        while self.fault is None and not self._closing:
            if not self._in_flight:
                self._idle = trio.Event()
                await self._idle.wait()
                continue
            await trio.sleep(limit / 4)
            if self.fault is not None or self._closing:
                return
            refs = [ref for b in self._in_flight for _, ref in b.hops[b.ready :]]
            if refs:
                ready, _ = await trio.to_thread.run_sync(ready_refs, refs)
                done = set(ready)
                for b in self._in_flight:
                    while b.ready < len(b.hops) and b.hops[b.ready][1] in done:
                        b.ready += 1
                        self._moved()
            if self._in_flight and trio.current_time() - self._progress >= limit * BACKSTOP:
                self._hang(self._in_flight[0])
                return

    def _hang(self, batch: Batch) -> None:
        if batch.at is not None:
            r = batch.at
        elif batch.queued is not None:
            r = self.runners[batch.queued.start]
        elif batch.ready < len(batch.hops):
            r = batch.hops[batch.ready][0]
        else:
            r = self.runners[-1]
        self._fault(
            SignalTimeout(
                f"{r.describe()} made no progress for {self.hang_limit * BACKSTOP:g} s "
                f"(hang_limit {self.hang_limit:g} s): a batch of "
                f"{len(batch.items)} items entered it and did not leave; the pipeline is "
                "faulted and its actors killed",
                signal=f"segment{r.segment.index}",
                expected=1,
                seen=0,
                device=r.node,
            )
        )

    # -- closing ---------------------------------------------------------------------------

    async def _drain(self, grace: float) -> None:
        """A normal exit: let the items in flight finish (within ``grace``); callers still
        waiting for a place get none (``_close`` refuses them)."""
        self._draining = True
        with trio.move_on_after(grace):
            while (self._in_flight or self._pending) and self.fault is None:
                self._empty = trio.Event()
                await self._empty.wait()

    def _close(self) -> None:
        """Every waiting call raises DeviceClosed (or the fault); every later one too."""
        self._closing = self._draining = True
        self._end_every_call(self._refusal())

    def _end_every_call(self, error: HcqaError) -> None:
        """Every call in flight or pending raises ``error``; callers waiting for a place
        wake (and find the refusal); the watchdog wakes to see it."""
        for b in self._in_flight:
            for it in b.items:
                it.finish(None, error)
        for it in self._pending:
            it.finish(None, error)
        while self._slot_waiters:
            self._slot_waiters.popleft().set()
        if self._idle is not None:
            self._idle.set()
