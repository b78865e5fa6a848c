"""Opening a Ray pipeline: checks, the segments' actors (or local pipelines), the close.

Theory of operation
-------------------
:func:`open_ray_pipeline` checks every argument before anything starts -- the stages
and shapes as a process pipeline would, the placement (one entry per stage), that this
process is a connected Ray driver, and, on a worker thread, the placement against the
alive nodes of the cluster. It then cuts the stages into segments and starts them: a
segment placed on the driver's own node (with ``local=True``) is a process pipeline
opened right here; every other one is a :class:`~hcqa.ray._segment.SegmentActor` --
``num_cpus=0``, pinned with ``NodeAffinitySchedulingStrategy(node, soft=False)`` or
asking for the placement's resources, never restarted -- whose ``open()`` starts its
workers. An actor that has not opened within ``start_limit`` (the cluster has no room
for it) is a ``SignalTimeout``; a stage that cannot be imported is the segment's
``DeviceFault``; either way every actor started so far is killed before the error
leaves.

Closing (whatever ends the block): a normal exit lets the items in flight finish
(within ``grace``); then every waiting call gets ``DeviceClosed`` (or the sticky fault),
each actor is asked to close its process pipeline (within ``grace``; skipped when the
pipeline faulted), is killed with ``ray.kill``, and the close waits until Ray reports
it dead -- a call on it fails with ``RayActorError``. Ray shows a dead actor's
resources free a little later (tens of ms: its raylet reports the worker's exit), so a
close whose actors held resources looks at ``ray.available_resources()`` every 20 ms
until they are back (2 s at most: another job may take them first). Local pipelines
close last, as process pipelines do.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import numpy.typing as npt
import ray
import trio
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hcqa import aio
from hcqa.errors import HcqaError, InvalidCommand, SignalTimeout
from hcqa.processes import ProcessStage, open_process_pipeline
from hcqa.processes._checks import check_arguments
from hcqa.ray._batches import Runner, kill_actors, resolve
from hcqa.ray._checks import Placement, Segment, check_cluster, check_placement, segments
from hcqa.ray._segment import SegmentActor
from hcqa.ray.pipeline import RayPipeline

__all__ = ["open_ray_pipeline"]

_REMOTE: Any = None  # ray.remote(SegmentActor), made once
_RESOURCES_BACK = 2.0  # seconds a close waits at most for Ray to show resources freed


def _actor_class() -> Any:
    global _REMOTE
    if _REMOTE is None:
        _REMOTE = ray.remote(SegmentActor)
    return _REMOTE


@aio.rehosts
@asynccontextmanager
async def open_ray_pipeline(
    stages: Sequence[ProcessStage | str],
    *,
    placement: Sequence[str | dict[str, Any]],
    in_shape: Sequence[int] | int,
    dtype: npt.DTypeLike = "float32",
    depth: int = 2,
    grace: float = 5.0,
    hang_limit: float = 30.0,
    blas_threads: int | None = 1,
    path: Sequence[str] = (),
    local: bool = True,
    start_limit: float = 60.0,
) -> AsyncIterator[RayPipeline]:
    """Open a pipeline whose stages run on Ray nodes; yields a :class:`RayPipeline`.

    ``placement``: one entry per stage, a Ray node id (hex) or ``{"resources": {...}}``;
    consecutive stages with the same entry share a segment (one process pipeline on
    that node). ``local``: run a segment placed on the driver's own node in the driver
    (two Ray hops fewer) instead of in an actor. ``depth``: items in flight per segment
    (and the most items one Ray call carries). ``hang_limit``: no item leaving any
    segment for that long while items are in flight faults the pipeline with
    ``SignalTimeout`` naming the segment and kills its actors. ``start_limit``: the most
    the actors may take to start and open their workers (a cluster without room for
    one: ``SignalTimeout``). ``grace``, ``blas_threads``, ``path``: as for
    :func:`~hcqa.processes.open_process_pipeline`, per segment."""
    specs, shape, dt = check_arguments(
        stages,
        in_shape=in_shape,
        dtype=dtype,
        depth=depth,
        grace=grace,
        hang_limit=hang_limit,
        blas_threads=blas_threads,
        path=path,
    )
    places = check_placement(placement, len(specs))
    if not isinstance(local, bool):
        raise InvalidCommand(f"'local' must be True or False (got {local!r})")
    if (
        isinstance(start_limit, bool)
        or not isinstance(start_limit, (int, float))
        or not start_limit > 0
    ):
        raise InvalidCommand(
            f"'start_limit' must be a number of seconds > 0 (inf: none) (got {start_limit!r})"
        )
    if not ray.is_initialized():
        raise InvalidCommand(
            "open_ray_pipeline needs a connected Ray driver: call ray.init(address=...) "
            "first (got ray.is_initialized() False)"
        )
    nodes = await trio.to_thread.run_sync(check_cluster, places)
    here = ray.get_runtime_context().get_node_id()
    segs = segments(specs, places, shape, dt)
    options: dict[str, Any] = {
        "depth": depth,
        "grace": grace,
        "hang_limit": hang_limit,
        "blas_threads": blas_threads,
        "path": list(path),
    }
    runners = [Runner(s) for s in segs]
    async with AsyncExitStack() as stack:
        try:
            for r in runners:
                p = r.segment.placement
                if p.node is not None:
                    r.node, r.ip = p.node, nodes.get(p.node, "")
                if local and p.node == here:
                    r.pipe = await stack.enter_async_context(_open_local(r, options))
                else:
                    # the first creation exports the class to Ray (a blocking call)
                    r.actor = await trio.to_thread.run_sync(_start_actor, r.segment, p, options)
            await _open_actors(runners, start_limit)
        except BaseException:
            with trio.CancelScope(shield=True):
                await _stop_actors(runners, graceful=False, grace=grace)
            raise
        pipe = RayPipeline(
            runners,
            stages=len(specs),
            in_shape=shape,
            dtype=dt,
            depth=depth,
            hang_limit=hang_limit,
        )
        error: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                pipe._nursery = nursery
                nursery.start_soon(pipe._watchdog, name="ray pipeline watchdog")
                try:
                    yield pipe
                    await pipe._drain(grace)
                except BaseException as exc:
                    error = exc
                pipe._close()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await _stop_actors(
                    runners, graceful=error is None and pipe.fault is None, grace=grace
                )
        if error is not None:
            raise error


@asynccontextmanager
async def _open_local(r: Runner, options: dict[str, Any]) -> AsyncIterator[Any]:
    seg = r.segment
    try:
        async with open_process_pipeline(
            seg.stages, in_shape=seg.in_shape, dtype=seg.dtype, **options
        ) as pipe:
            r.workers, r.pid = pipe.statistics().workers, os.getpid()
            yield pipe
    except HcqaError as exc:
        raise r.named(exc) from None


def _start_actor(seg: Segment, p: Placement, options: dict[str, Any]) -> Any:
    opts: dict[str, Any] = {
        "num_cpus": 0,
        "max_restarts": 0,
        "max_task_retries": 0,
        "max_concurrency": options["depth"] + 1,  # depth batches, and a close
    }
    if p.node is not None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(p.node, soft=False)
    else:
        res = dict(p.resources)
        for key, opt in (("CPU", "num_cpus"), ("GPU", "num_gpus"), ("memory", "memory")):
            if key in res:
                opts[opt] = res.pop(key)
        if res:
            opts["resources"] = res
    seg_options = dict(options, in_shape=seg.in_shape, dtype=str(seg.dtype))
    return _actor_class().options(**opts).remote(seg.first, seg.stages, seg_options)


async def _open_actors(runners: Sequence[Runner], limit: float) -> None:
    """Each actor's ``open()``: where it runs, its pids; within ``limit`` seconds."""
    remote = [r for r in runners if r.actor is not None]
    refs = [r.actor.open.remote() for r in remote]
    with trio.move_on_after(limit):
        for r, ref in zip(remote, refs, strict=True):
            try:
                info = await resolve(ref)
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, HcqaError):
                    raise exc.cause from None
                raise
            r.node, r.ip, r.pid = info["node"], info["ip"], info["pid"]
            r.workers = tuple(info["workers"])
        return
    late = [r for r in remote if not r.pid]
    raise SignalTimeout(
        f"{late[0].segment.describe()} did not start on {late[0].segment.placement.describe()} "
        f"within start_limit ({limit:g} s): the cluster has no room for its actor now "
        "(resources taken?)",
        signal=f"segment{late[0].segment.index}",
        expected=1,
        seen=0,
    )


async def _stop_actors(runners: Sequence[Runner], *, graceful: bool, grace: float) -> None:
    """Close (if ``graceful``), kill, and wait until Ray reports every actor dead."""
    actors = [r.actor for r in runners if r.actor is not None]
    if not actors:
        return
    if graceful:
        refs = [a.close.remote(grace + 1.0) for a in actors]
        with trio.move_on_after(grace):
            for ref in refs:
                try:
                    await resolve(ref)
                except Exception:  # a fault already reported, or the actor is gone
                    continue
    held: dict[str, float] = {}
    for r in runners:
        if r.actor is not None:
            for k, v in r.segment.placement.resources:
                held[k] = held.get(k, 0.0) + v
    before = await trio.to_thread.run_sync(ray.available_resources) if held else {}
    await trio.to_thread.run_sync(kill_actors, actors)
    with trio.move_on_after(max(grace, 10.0)):
        for a in actors:
            # A call sent after the kill may still be served if it overtook the kill;
            # the first one that fails says the actor is dead.
            while True:
                try:
                    await resolve(a.where.remote())
                except ray.exceptions.RayActorError:
                    break
    for r in runners:
        r.actor = None
    if held:
        # Ray frees a dead actor's resources a little later (its raylet reports the
        # worker's exit): wait for them to show, a bounded while (others may take them).
        total = await trio.to_thread.run_sync(ray.cluster_resources)
        want = {k: min(before.get(k, 0.0) + v, total.get(k, 0.0)) for k, v in held.items()}
        with trio.move_on_after(_RESOURCES_BACK):
            while True:
                now = await trio.to_thread.run_sync(ray.available_resources)
                if all(now.get(k, 0.0) >= v for k, v in want.items()):
                    break
                await trio.sleep(0.02)
