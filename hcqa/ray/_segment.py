"""A segment of a Ray pipeline: a process pipeline hosted by a Ray actor (or the driver).

Theory of operation
-------------------
:class:`SegmentActor` is a Ray *async* actor: Ray runs its methods on an asyncio loop in
the actor's process, and hcqa hosts itself on that loop (``hcqa.aio``: a trio guest
run), so the actor opens an ordinary :func:`~hcqa.processes.open_process_pipeline` of
its stages -- worker processes on the actor's node, items between them in shared
memory. ``run(items)`` takes a *list* of items (one Ray call carries every item the
driver had ready for this hop: see the package's theory) and runs them through the
pipeline concurrently in one trio task, so a batch costs one asyncio/trio crossing.

Errors leave the actor named: :func:`name_fault` rewrites the process pipeline's fault
(which knows its worker's index inside the segment) into one that names the stage by
its index in the whole pipeline, its function, and the Ray node (id and address) --
the driver raises it as it comes. The same function names faults of a segment run in
the driver.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from hcqa import aio
from hcqa.errors import DeviceClosed, DeviceFault, HcqaError, SignalTimeout
from hcqa.processes import ProcessPipeline, ProcessStage, open_process_pipeline

__all__ = ["SegmentActor", "name_fault", "run_items"]

_WORKER = re.compile(r"^worker(\d+)$")


def name_fault(
    exc: HcqaError, first: int, stages: Sequence[ProcessStage], node: str, ip: str
) -> HcqaError:
    """``exc`` (from a segment's process pipeline) as an error naming stage and node."""
    m = _WORKER.match(getattr(exc, "device", "") or "")
    where = f"on Ray node {node} ({ip})" if ip else f"on Ray node {node}"
    if m is not None and int(m.group(1)) < len(stages):
        i = int(m.group(1))
        who = f"stage {first + i} ({stages[i].fn!r}) {where}"
    else:
        names = ", ".join(repr(s.fn) for s in stages)
        span = f"stage {first}" if len(stages) == 1 else f"stages {first}-{first + len(stages) - 1}"
        who = f"{span} ({names}) {where}"
    message = f"{who}: {exc}"
    new: HcqaError
    if isinstance(exc, SignalTimeout):
        new = SignalTimeout(
            message, signal=exc.signal, expected=exc.expected, seen=exc.seen, device=node
        )
    elif isinstance(exc, DeviceClosed):
        new = DeviceClosed(message)
    else:
        new = DeviceFault(message, device=node)
    return new


async def run_items(
    pipe: ProcessPipeline, items: Sequence[npt.NDArray[Any]]
) -> list[npt.NDArray[Any]]:
    """Run ``items`` through ``pipe`` concurrently (trio); the outputs, in order. The
    first error is raised as it is (the others are the same sticky fault)."""
    out: list[npt.NDArray[Any] | None] = [None] * len(items)
    errors: list[BaseException] = []

    async def one(i: int, x: npt.NDArray[Any]) -> None:
        try:
            out[i] = await pipe(x)
        except HcqaError as exc:
            errors.append(exc)

    if len(items) == 1:
        await one(0, items[0])
    else:
        async with trio.open_nursery() as nursery:
            for i, x in enumerate(items):
                nursery.start_soon(one, i, x)
    if errors:
        raise errors[0]
    return [np.asarray(o) for o in out]


class SegmentActor:
    """Stages ``first ..`` in a process pipeline on this actor's node (a Ray async actor)."""

    def __init__(self, first: int, stages: Sequence[ProcessStage], options: dict[str, Any]) -> None:
        import ray

        self.first = first
        self.stages = tuple(stages)
        self.options = options
        self.node = ray.get_runtime_context().get_node_id()
        node_ip: Callable[[], str] = ray.util.get_node_ip_address
        self.ip = node_ip()
        self.stack = contextlib.AsyncExitStack()
        self.pipe: ProcessPipeline | None = None

    def _named(self, exc: HcqaError) -> HcqaError:
        return name_fault(exc, self.first, self.stages, self.node, self.ip)

    async def open(self) -> dict[str, Any]:
        """Start the segment's workers; where it runs: node id, address, pids."""
        try:
            self.pipe = await self.stack.enter_async_context(
                open_process_pipeline(self.stages, **self.options)
            )
        except HcqaError as exc:
            raise self._named(exc) from None
        return {
            "node": self.node,
            "ip": self.ip,
            "pid": os.getpid(),
            "workers": self.pipe.statistics().workers,
        }

    async def run(self, items: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        """The items through the segment's stages."""
        if self.pipe is None:
            raise self._named(DeviceClosed("the segment's process pipeline is closed"))
        try:
            return await aio.call(run_items, self.pipe, items)
        except HcqaError as exc:
            raise self._named(exc) from None

    async def close(self) -> None:
        """Drain and stop the segment's process pipeline (within its ``grace``)."""
        self.pipe = None
        try:
            await self.stack.aclose()
        except HcqaError as exc:
            raise self._named(exc) from None

    def where(self) -> tuple[str, int]:
        """This actor's node id and pid."""
        return self.node, os.getpid()
