"""Pipelines: microbatches through stages on several devices, transfers overlapping compute.

Theory of operation
-------------------
A :class:`Pipeline` is a list of :class:`Stage` s, each a program on one
device or a captured :class:`~hcqa.graph.Graph` (with the buffer it reads its input from
and the one it writes its output to). It owns ``depth`` *slots*; a slot is one set of
buffers (each stage's input and output) and one captured :class:`~hcqa.graph.Graph` that runs every
stage on its slot and moves each stage's output to the next stage's device
with ``hcqa.transfer``. Graphs of different slots share no buffers, so while
slot ``k`` runs stage 2 on ``cpu:1``, slot ``k + 1`` runs stage 1 on ``cpu:0``,
and the transfers between them run on the copy engines (or right behind the kernels, in
legs: below): the devices overlap.

``await pipe(x)`` takes a free slot (a ``trio.Semaphore`` of ``depth`` bounds
the microbatches in flight: that is the backpressure), enqueues the microbatch's work and
awaits its copy-out into a fresh array. Its parts are ordered by the buffers' hazards, not
by awaiting in between. Calls reach the devices in the order they were made, so a stage with
state (``s = x - s``, a Graph stage on shared scratch) sees them in that order: each keeps
its place in the slot pool's line (:mod:`hcqa._slots`) from the call until its work is queued.

Where every stage is a plain launch on a device whose memory is host memory and whose
compute queue takes host copies (``Device._copies_on_compute``: cpu devices with
host-visible memory), the work is one batch per device, a *leg* (``_pipelegs.py``): the
copy-in, the device's launches and the transfer to the next device, right behind the kernel
that wrote its source; on the last device, its launches and the copy-out. The legs go at
once, and the host gates the wait between two of them (the cpu backend keeps no device-side
waits): one hand-off per device boundary, where the copy-in and a transfer on the copy
queues take three (copy engine -> kernel -> copy engine -> next kernel, each through the
event loop and an engine's wake-up). Measured on a 2-vCPU host: a lone call of a 2-stage
pipeline on 16x16 arrays 0.6x the latency (p50 200-220 us against 345-366 us), ``map`` 1.5x
the items per second; a compute-bound one (``bench/bench_pipeline.py``, 12 ms stages) the
same either way, its copies now on the engines that compute.

Elsewhere (a Graph stage, OpenCL, a staged device) the call enqueues ``copyin(x)``, the
slot's graph replay and the copy-out. The copy-out runs on the last stage's *compute*
queue, right behind its kernel, where the device allows it (``_copies_on_compute``: OpenCL
too). On the copy queue it would sit behind the transfer that brings the next microbatch to
that stage, and that transfer behind it: every microbatch's output would wait for a round
of copy-engine and event-loop wake-ups before the last stage could start the next one
(measured: a 1.3-1.5 ms gap per microbatch in the last stage of a 2-stage MLP with 13 ms
stages, against 0.65 ms this way).

From an asyncio task (see ``hcqa.aio``) a call that finds a free slot and no call in
line before it runs on that task. When it is the only one in flight it runs *step by
step*: it enqueues its legs (without legs: the copy-in, transfers, programs and copy-out)
one at a time, each once the one before is reached (awaited on the asyncio loop, unless
already reached), so each enqueue finds its hazards done and goes straight to an idle
engine: no trio task is woken (under asyncio that costs a hand-off through trio's guest I/O
thread). It keeps its place in line until its last leg (or step) is queued; a call that
joins the line behind it makes it queue its remaining steps at once (legs keep their
waits). With other calls in flight it goes as under trio (legs at once, or the graph's
replay), so the queue actors chain the stages without a busy asyncio loop between them. A
call that must wait runs in the trio host, its place in line taken before it goes there.

A Graph stage is recorded into each slot's graph (``g.submit(buffers=...)`` in a capture)
on the slot's own input and output buffers; what else it uses (weights, scratch) the slots
share, in order by the buffers' hazards.

Cancellation: cancelling a caller stops its wait at once. The work already
queued on its slot completes on the devices; the slot (and its unit of
``depth``) goes back to the pool only when that work is done, so cancelled
callers can't pile up work beyond ``depth``. Failures in ``map`` raise the
one ``DeviceFault`` (an ExceptionGroup only for several different errors).

``await pipe.map(xs)`` returns the results in order, with up to ``depth`` in flight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import attrs
import numpy as np
import numpy.typing as npt

from hcqa import _pipecheck, aio
from hcqa._pipelegs import Leg, plan_legs, reached
from hcqa._slots import Lease, SlotPool, Turn
from hcqa.devices.base import Device
from hcqa.devices.buffer import Buffer
from hcqa.devices.opening import transfer
from hcqa.devices.program import Program
from hcqa.devices.sizes import check_int, check_plain_dtype, check_sample, check_shape
from hcqa.errors import InvalidCommand
from hcqa.graph import Graph, capture
from hcqa.signals import Fence

__all__ = ["Pipeline", "PipelineStatistics", "Stage"]


@attrs.frozen(kw_only=True)
class Stage:
    """One pipeline stage: ``program(out, inp, *params, vals=vals, global_size=global_size,
    local_size=local_size)`` on ``device``.

    ``program`` may be a :class:`~hcqa.Program` or a Python callable (made into a
    program on ``device``). ``out_shape`` / ``out_dtype`` default to the input's.
    ``vals`` and the launch geometry are passed as given to every launch (an OpenCL kernel
    needs its NDRange; a C kernel its sizes); the program checks them when the pipeline is
    built. Or a captured :class:`~hcqa.Graph`, with the typed buffers it captured that it
    reads its input from (``in_buffer``, on ``device``) and writes its output to
    (``out_buffer``): each microbatch gets its own in their place.
    """

    device: Device
    program: Program | Graph | Callable[..., Any]
    out_shape: Sequence[int] | int | None = None
    out_dtype: Any = None
    params: tuple[Buffer, ...] = ()
    name: str = ""
    vals: tuple[int, ...] = ()
    global_size: tuple[int, int, int] = (1, 1, 1)
    local_size: tuple[int, int, int] = (1, 1, 1)
    in_buffer: Buffer | None = None
    out_buffer: Buffer | None = None


@attrs.frozen(kw_only=True)
class PipelineStatistics:
    """What :meth:`Pipeline.statistics` reports."""

    stages: int
    depth: int
    in_flight: int
    completed: int
    cancelled: int


@attrs.define(eq=False)
class _Slot:
    graph: Graph
    inp: Buffer
    out: Buffer
    # the graph's enqueues one by one (transfers and programs), for asyncio callers
    steps: list[Callable[[], Fence]] = attrs.field(factory=list)
    # batches one microbatch sends per queue (copy in, the graph's parts, copy out)
    need: dict[Any, int] = attrs.field(factory=dict)
    legs: list[Leg] | None = None  # the steps as one batch per device, where possible


class Pipeline:
    """Microbatches through ``stages``; ``await pipe(x)`` returns the last stage's output.

    Building it dry-runs each Python stage once, on this thread, on zeros of the shapes
    and dtypes it will get (``in_shape``, each stage's ``out_shape`` / ``out_dtype``): a
    missing or wrong ``out_shape``, or a stage that returns its result instead of writing
    ``out``, is an ``InvalidCommand`` here. ``check=False`` skips that, for a stage that
    must not run outside the pipeline (one that waits for an event, or counts its calls).
    """

    def __init__(
        self,
        stages: Sequence[Stage | tuple[Device, Any]],
        *,
        in_shape: Sequence[int] | int,
        dtype: npt.DTypeLike = "float32",
        depth: int = 2,
        check: bool = True,
    ) -> None:
        check_int("depth", depth, minimum=1)
        if not isinstance(check, bool):
            raise InvalidCommand(f"'check' must be a bool (got {type(check).__name__})")
        if not stages:
            raise InvalidCommand("a Pipeline needs at least one stage (got none)")
        self.stages = tuple(_stage(s, i) for i, s in enumerate(stages))
        self.in_shape = check_shape(in_shape, "'in_shape'")
        self.dtype = _dtype(dtype)
        self.depth = depth
        self._programs = [self._program(s, i) for i, s in enumerate(self.stages)]
        self._pool: SlotPool[_Slot] = SlotPool(depth)
        self._pool.fill([self._build_slot(dry_run=check and i == 0) for i in range(depth)])
        for actor, k in self._pool.slots[0].need.items():  # a call waits for room for all k
            if k > actor.capacity:
                raise InvalidCommand(
                    f"a Pipeline call queues {k} batches on the {actor.name} queue at once, "
                    f"so the device's 'queue_depth' must be >= {k} (got {actor.capacity})"
                )
        self._completed = 0
        last = self.stages[-1]
        self.out_shape = _out_shape(last) or self._shape_after(len(self.stages) - 1)
        self.out_dtype = self._pool.slots[0].out.dtype

    # -- building --------------------------------------------------------------------

    def _program(self, stage: Stage, index: int) -> Program | None:
        if isinstance(stage.program, Graph):
            g_in = cast("Buffer", stage.in_buffer)  # (checked by _stage)
            want = (self._shape_after(index - 1) if index else self.in_shape, self._dtype_at(index))
            if (g_in.shape, g_in.dtype) != want:
                raise InvalidCommand(
                    f"stage {index}: the graph's in_buffer must be {want[1]}{list(want[0])}, "
                    f"what the stage receives (got {g_in.dtype}{list(g_in.shape or ())})"
                )
            return None
        if isinstance(stage.program, Program):
            if stage.program.device is not stage.device:
                raise InvalidCommand(
                    f"stage {index}: program {stage.program.name!r} must be on "
                    f"{stage.device.name} (got one on {stage.program.device.name})"
                )
            return stage.program
        if not callable(stage.program):
            raise InvalidCommand(
                f"stage {index}: program must be a hcqa.Program or a callable "
                f"(got {type(stage.program).__name__})"
            )
        return stage.device.program(stage.name or f"stage{index}", stage.program)

    def _dtype_at(self, index: int) -> np.dtype[Any]:
        """The dtype stage ``index`` receives."""
        dtype = self.dtype
        for s in self.stages[:index]:
            dtype = np.dtype(s.out_dtype) if s.out_dtype is not None else dtype
        return dtype

    def _shape_after(self, index: int) -> tuple[int, ...]:
        shape = self.in_shape
        for s in self.stages[: index + 1]:
            shape = _out_shape(s) or shape
        return shape

    def _build_slot(self, *, dry_run: bool = False) -> _Slot:
        shape, dtype = self.in_shape, self.dtype
        first = self.stages[0].device.alloc(shape=shape, dtype=dtype)
        inp = first
        steps: list[Callable[[], Fence]] = []
        with capture() as graph:
            for index, (stage, prog) in enumerate(zip(self.stages, self._programs, strict=True)):
                if inp.device is not stage.device:
                    moved = stage.device.alloc(shape=shape, dtype=dtype)
                    steps.append(functools.partial(transfer, moved, inp))
                    steps[-1]()
                    inp = moved
                shape = _out_shape(stage) or shape
                dtype = np.dtype(stage.out_dtype) if stage.out_dtype is not None else dtype
                if prog is None:  # a Graph stage, on this slot's buffers
                    out = _graph_step(index, stage, inp, steps)
                    inp = out
                    continue
                out = stage.device.alloc(shape=shape, dtype=dtype)
                if dry_run:
                    _pipecheck.dry_run(index, stage, prog, out, inp)
                steps.append(
                    functools.partial(
                        prog,
                        out,
                        inp,
                        *stage.params,
                        vals=stage.vals,
                        global_size=stage.global_size,
                        local_size=stage.local_size,
                    )
                )
                steps[-1]()
                inp = out
        slot = _Slot(graph=graph, inp=first, out=inp, steps=steps)
        slot.legs = plan_legs(steps, first, inp)
        if slot.legs is not None:  # every call sends one batch per leg (see _run)
            queues = [leg.device.compute for leg in slot.legs]
        else:  # the copy-in, the graph's parts, the copy-out
            out_queue = inp.device._copyout_queue(on_compute=True)  # as _run's copy-out
            queues = [first.device.copy, *(p.actor for p in graph._plan.parts), out_queue]
        for a in queues:
            slot.need[a] = slot.need.get(a, 0) + 1
        return slot

    # -- running ---------------------------------------------------------------------

    async def __call__(self, x: npt.ArrayLike) -> npt.NDArray[Any]:
        """Run one microbatch through every stage; returns the output array."""
        arr = self._check_input(x)
        if not aio.asyncio_caller():
            return await self._call(arr)
        idle = self._pool.in_flight == 0  # from asyncio: run here when nothing needs waiting for
        lease = self._pool.take_now(self._has_room)
        if lease is not None:
            return await self._run(lease, arr, stepwise=idle)
        turn = self._pool.join()  # in line now: the call's order is made here, not in the host
        try:
            return await aio.call(self._call, arr, turn)
        finally:
            turn.leave()

    @staticmethod
    def _has_room(slot: _Slot) -> bool:
        """The slot's queues have room: ``_run`` would not wait before its fence."""
        return all(a.room >= k for a, k in slot.need.items())

    def _check_input(self, x: npt.ArrayLike) -> npt.NDArray[Any]:
        return check_input(x, self.in_shape, self.dtype)

    async def _call(self, arr: npt.NDArray[Any], turn: Turn | None = None) -> npt.NDArray[Any]:
        """A call in the trio host: its turn in line (joined now if not given), a slot."""
        lease = await self._pool.take(turn or self._pool.join())
        return await self._run(lease, arr)

    async def _run(
        self, lease: Lease[_Slot], arr: npt.NDArray[Any], *, stepwise: bool = False
    ) -> npt.NDArray[Any]:
        """One microbatch on ``lease``'s slot; leaves its turn once all of it is queued.

        The slot's legs, where it has them, go at once: one batch per device, the host
        gating the waits between them. ``stepwise`` (an asyncio caller, see the module doc):
        enqueue the legs (or the graph's steps) one by one, each once the last one is
        reached, instead -- steps, not legs, go at once when a call waits in line behind
        it."""
        with lease:
            slot = lease.slot
            while short := [a for a, k in slot.need.items() if a.room < k]:
                await short[0].wait_for_space()
            result = np.empty(self.out_shape, self.out_dtype)
            legs = slot.legs
            fence = legs[0].submit(arr, result) if legs else slot.inp.copyin(arr)
            lease.fence = fence
            if legs:  # (the first leg copies arr in, the last one copies out)
                for leg in legs[1:]:
                    if stepwise and not reached(fence):
                        await fence
                    fence = lease.fence = leg.submit(arr, result)
            else:
                if stepwise:
                    for step in slot.steps:
                        if not (lease.behind() or reached(fence)):
                            await fence
                        fence = lease.fence = step()
                    if not (lease.behind() or reached(fence)):
                        await fence
                else:
                    slot.graph.submit()
                fence = lease.fence = slot.out.device._copyout(slot.out, result, on_compute=True)
            lease.queued()
            await fence
        self._completed += 1
        return result

    async def map(self, xs: Iterable[npt.ArrayLike]) -> list[npt.NDArray[Any]]:
        """``[await self(x) for x in xs]``, but with up to ``depth`` microbatches in flight."""
        if aio.asyncio_caller():
            return await aio.call(self.map, xs)
        arrays = [self._check_input(x) for x in xs]

        async def run(i: int, turn: Turn) -> npt.NDArray[Any]:
            return await self._call(arrays[i], turn)

        failed = "pipeline microbatches failed"
        return await self._pool.map(len(arrays), run, name="Pipeline.map", failed=failed)

    def statistics(self) -> PipelineStatistics:
        """A frozen snapshot: stages, depth, microbatches in flight, completed, cancelled."""
        return PipelineStatistics(
            stages=len(self.stages),
            depth=self.depth,
            in_flight=self._pool.in_flight,
            completed=self._completed,
            cancelled=self._pool.cancelled,
        )

    def __repr__(self) -> str:
        names = " -> ".join(s.device.name for s in self.stages)
        return f"<Pipeline {names} depth={self.depth}>"


def check_input(x: npt.ArrayLike, shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """``x`` as an array, if it is a pipeline input of ``shape`` and ``dtype``."""
    return check_sample("pipeline input", x, shape, dtype)


def _dtype(dtype: npt.DTypeLike) -> np.dtype[Any]:
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise InvalidCommand(f"'dtype' must be a numpy dtype (got {dtype!r})") from exc
    check_plain_dtype("'dtype'", dt)
    return dt


def _out_shape(stage: Stage) -> tuple[int, ...] | None:
    """A checked stage's ``out_shape`` (a tuple once ``_stage`` made it one)."""
    return None if stage.out_shape is None else check_shape(stage.out_shape)


def _graph_stage(stage: Stage, index: int) -> Stage:
    """A checked Graph stage, its ``out_shape`` / ``out_dtype`` its ``out_buffer``'s."""
    graph = stage.program
    assert isinstance(graph, Graph)
    where = f"stage {index}"
    if not graph._built:
        raise InvalidCommand(f"{where}: the graph's capture block must have ended")
    if graph._variables:
        names = sorted(v.name for v in graph._variables)
        raise InvalidCommand(f"{where}: the graph has variables {names}; a stage has no values")
    if stage.params or stage.vals or stage.out_shape is not None or stage.out_dtype is not None:
        raise InvalidCommand(
            f"{where}: params, vals, out_shape and out_dtype are a program stage's; a Graph "
            "stage's output is its out_buffer"
        )
    for name in ("in_buffer", "out_buffer"):
        b = getattr(stage, name)
        if not isinstance(b, Buffer):
            raise InvalidCommand(
                f"{where}: a Graph stage needs its {name} (Stage(device=..., program=graph, "
                f"in_buffer=..., out_buffer=...)) (got {type(b).__name__})"
            )
        if b not in graph._plan.captured:
            raise InvalidCommand(f"{where}: {name} {b!r} must be a buffer the graph captured")
        if b.dtype is None or b.shape is None:
            raise InvalidCommand(f"{where}: {name} must have a dtype and a shape (got {b!r})")
    assert stage.in_buffer is not None and stage.out_buffer is not None
    if stage.in_buffer.device is not stage.device:
        raise InvalidCommand(
            f"{where}: in_buffer must be on {stage.device.name}, the stage's device "
            f"(got one on {stage.in_buffer.device.name})"
        )
    return attrs.evolve(stage, out_shape=stage.out_buffer.shape, out_dtype=stage.out_buffer.dtype)


def _graph_step(index: int, stage: Stage, inp: Buffer, steps: list[Callable[[], Fence]]) -> Buffer:
    """Record a Graph stage on ``inp`` and a fresh output buffer; returns the output."""
    graph, g_in, g_out = stage.program, stage.in_buffer, stage.out_buffer
    assert isinstance(graph, Graph) and g_in is not None and g_out is not None
    out = inp if g_out is g_in else g_out.device.alloc(shape=g_out.shape, dtype=g_out.dtype)
    steps.append(functools.partial(graph.submit, buffers={g_in: inp, g_out: out}))
    try:
        steps[-1]()
    except InvalidCommand as exc:  # (a buffer the graph also uses through a view)
        raise InvalidCommand(f"stage {index}: {exc}") from None
    return out


def _stage(s: Stage | tuple[Device, Any], index: int) -> Stage:
    if isinstance(s, Stage):
        stage = s
    elif isinstance(s, tuple) and len(s) == 2:
        stage = Stage(device=s[0], program=s[1])
    else:
        raise InvalidCommand(
            f"stage {index} must be a Stage or a (device, program) pair (got {s!r})"
        )
    if not isinstance(stage.device, Device):
        raise InvalidCommand(
            f"stage {index}: device must be a hcqa Device (got {type(stage.device).__name__})"
        )
    if isinstance(stage.program, Graph):
        return _graph_stage(stage, index)
    if stage.in_buffer is not None or stage.out_buffer is not None:
        raise InvalidCommand(
            f"stage {index}: in_buffer / out_buffer are for a Graph stage (got a "
            f"{type(stage.program).__name__} program)"
        )
    if stage.out_shape is not None:
        out_shape = check_shape(stage.out_shape, f"stage {index}'s 'out_shape'")
        stage = attrs.evolve(stage, out_shape=out_shape)
    return stage
