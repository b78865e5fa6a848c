"""The pieces a Ray pipeline's driver moves: runners, items, batches, legs, and its wait
for Ray.

Theory of operation
-------------------
A :class:`Runner` is a segment at run time: a Ray actor, or a process pipeline in the
driver. Each caller's item is an :class:`Item` (its input, the event its caller parks
on, its result or error); the items ready at one moment travel as a :class:`Batch`,
which remembers where it is (the local segment it is in, its Ray calls so far) for the
watchdog and for faults that must name a segment.

Legs and big batches: consecutive remote segments form a :class:`Leg` -- Ray carries a
batch through them as one chain of calls, from the driver back to the driver. A batch
over ``INLINE`` bytes crosses Ray through its object store, and there concurrent
transfers collapse on a small host (one 4 MiB echo at a time: 30 items/s; ten at once:
3/s; ten 4 MiB items in one call: 63/s -- ``bench --primitives tput``). So a big batch
holds its leg until its value is back in the driver; big batches arriving meanwhile
queue at the leg and go on as one merged batch (up to ``depth`` items) when it frees.
Small batches (one bytes object each) never wait for a leg.

Waiting for Ray from trio (:func:`resolve`): ``ref.future()`` gives a
``concurrent.futures.Future`` that Ray completes on one of its own threads (it fetches
and deserializes the value there). Its done-callback hands one ``Event.set`` to the trio
loop with ``TrioToken.run_sync_soon`` -- which works the same in a plain trio run and in
hcqa's trio guest run on an asyncio loop -- so a waiting task sleeps until Ray says the
object is there: no polling, no thread of ours. A cancelled waiter just stops waiting;
the late callback sets an event nobody waits on (or, after the run ended, is dropped).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import attrs
import numpy.typing as npt
import ray
import trio

from hcqa.errors import HcqaError
from hcqa.processes import ProcessPipeline
from hcqa.ray._checks import Segment
from hcqa.ray._segment import name_fault

__all__ = [
    "Batch",
    "Item",
    "Leg",
    "RayPipelineStatistics",
    "Runner",
    "kill_actors",
    "ready_refs",
    "resolve",
]


async def resolve(ref: Any) -> Any:
    """The value of the ObjectRef ``ref`` (Ray's error for it is raised as it is)."""
    token = trio.lowlevel.current_trio_token()
    event = trio.Event()
    future: concurrent.futures.Future[Any] = ref.future()

    def done(_: concurrent.futures.Future[Any]) -> None:
        try:
            token.run_sync_soon(event.set)
        except trio.RunFinishedError:
            pass

    future.add_done_callback(done)
    await event.wait()
    return future.result()


@attrs.frozen(kw_only=True)
class RayPipelineStatistics:
    """What :meth:`RayPipeline.statistics` reports."""

    stages: int
    depth: int
    segments: tuple[str, ...]  # the node id each segment runs on
    local: tuple[bool, ...]  # which segments run in the driver
    hosts: tuple[int, ...]  # the pid of the process hosting each segment (actor or driver)
    workers: tuple[tuple[int, ...], ...]  # each segment's worker processes (pids, per stage)
    in_flight: int  # items taken and not yet out of the last segment
    batches: int  # batches taken in so far (one Ray call per remote segment each)
    coalesced: int  # of those, batches that joined others queued for a Ray leg (big items)
    completed: int  # items that left the last segment
    faulted: bool


@attrs.define(eq=False)
class Runner:
    """A segment at run time: a Ray actor, or a process pipeline in the driver."""

    segment: Segment
    node: str = ""
    ip: str = ""
    actor: Any = None  # a Ray ActorHandle of SegmentActor
    pipe: ProcessPipeline | None = None
    pid: int = 0
    workers: tuple[int, ...] = ()

    def describe(self) -> str:
        where = f"Ray node {self.node} ({self.ip})" if self.ip else f"Ray node {self.node}"
        if self.pipe is not None:
            where += ", in the driver"
        return f"{self.segment.describe()} on {where}"

    def named(self, exc: HcqaError) -> HcqaError:
        return name_fault(exc, self.segment.first, self.segment.stages, self.node, self.ip)


@attrs.define(eq=False)
class Item:
    x: npt.NDArray[Any]
    event: trio.Event = attrs.Factory(trio.Event)
    value: npt.NDArray[Any] | None = None
    error: BaseException | None = None

    def finish(self, value: npt.NDArray[Any] | None, error: BaseException | None) -> None:
        if not self.event.is_set():
            self.value, self.error = value, error
            self.event.set()


@attrs.define(eq=False)
class Batch:
    items: list[Item]
    at: Runner | None = None  # the local segment it is in, if any
    hops: list[tuple[Runner, Any]] = attrs.Factory(list)  # remote calls: (runner, ObjectRef)
    ready: int = 0  # hops the watchdog has seen finished (a prefix)
    queued: Leg | None = None  # the Ray leg it waits for (its task has ended)


@attrs.define(eq=False)
class Leg:
    """Consecutive remote segments from ``runners[start]``: Ray carries a batch through
    them in one chain of calls. A big batch (one that crosses Ray as arrays, not bytes)
    holds the leg until its last call's value is back; big batches arriving meanwhile
    queue here, and are merged (up to ``depth`` items) when it frees."""

    start: int
    busy: bool = False
    queue: list[tuple[Batch, list[npt.NDArray[Any]]]] = attrs.Factory(list)


def ready_refs(refs: list[Any]) -> tuple[list[Any], list[Any]]:
    ready, rest = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    return list(ready), list(rest)


def kill_actors(actors: Sequence[Any]) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already gone, or Ray is shutting down
            pass
