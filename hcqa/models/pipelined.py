"""A model cut across devices: ``models.pipeline(model, devices=[...], depth=)``.

Theory of operation
-------------------
:func:`pipeline` checks everything first (the model can be cut, the devices are open, of the
model's kind and distinct, ``depth`` >= 1, no more devices than kernels) and plans the cut
(:mod:`hcqa.models.cut`: stages balanced by the front end's cost estimates, moves of exactly
the byte ranges a later stage reads); nothing is allocated or queued yet. The first call, or
``await pipe.build()``, builds it off the event loop: each stage's programs on its device
(the model's own sources and flags: the same answers, bit for bit), the weights each stage
reads copied once to its device (on the model's own device, the model's weights are used),
a model's state kept on its one stage.

Like :class:`hcqa.Pipeline`, it owns ``depth`` *slots*. A slot is a set of per-call buffers
(each stage's copy of the model's bases it touches), host staging arrays for the inputs and
outputs, and one captured :class:`~hcqa.Graph` per stage, on its device: the inputs the stage
reads copied in from the host, the moves into it (``hcqa.transfer`` of a view, on the copy
engines), its kernels, the outputs it holds copied out. The slot's own graph records the
stages' graphs in order (``g.submit()`` inside a capture), so a call is one replay. Slots share no
per-call buffer, so slot ``k + 1``'s first stage runs while slot ``k``'s second does.

``await pipe(x)`` takes its place in line and a free slot from the slot pool
(:mod:`hcqa._slots`, as ``hcqa.Pipeline`` does: ``depth`` slots, backpressure, calls reach the
devices in the order they were made, from trio or asyncio tasks), writes the arrays into its
staging arrays, replays its graph (one submit per queue) and awaits it; ``await pipe.map(xs)``
keeps up to ``depth`` calls in flight and returns the answers in order. Cancelling a caller
stops its wait at once; its slot returns to the pool only once the work already queued on it
is done, so the devices stay usable and the next call is correct.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import trio

from hcqa import aio
from hcqa._slots import SlotPool, Turn
from hcqa.devices import Buffer, Device
from hcqa.devices.opening import transfer
from hcqa.devices.sizes import check_int
from hcqa.errors import InvalidCommand
from hcqa.graph import Graph, capture
from hcqa.models import cut
from hcqa.models.kinds import device_kind
from hcqa.models.lifted import Arg, Lifted
from hcqa.models.model import Model, build_programs, launch, program_key
from hcqa.variables import Variable

__all__ = ["ModelPipeline", "ModelPipelineStatistics", "PipelineStage", "pipeline"]


@attrs.frozen
class PipelineStage:
    """One stage as planned: its device, kernels ``start:stop`` of the model's, their summed
    cost estimate, and the byte ranges moved in from other stages before it runs."""

    device: Device
    start: int
    stop: int
    cost: int
    moves: tuple[cut.Move, ...]

    @property
    def moved_bytes(self) -> int:
        return sum(m.nbytes for m in self.moves)


@attrs.frozen(kw_only=True)
class ModelPipelineStatistics:
    """What :meth:`ModelPipeline.statistics` reports."""

    stages: tuple[PipelineStage, ...]
    depth: int
    in_flight: int
    completed: int
    cancelled: int


@attrs.define(eq=False)
class _Slot:
    graph: Graph
    stages: tuple[Graph, ...]
    host_in: tuple[np.ndarray, ...]
    host_out: tuple[np.ndarray, ...]
    need: dict[Any, int]


def pipeline(
    model: Model,
    devices: Sequence[Device],
    *,
    depth: int = 2,
    batch_size: int | None = None,
    cuts: Sequence[int] | None = None,
) -> ModelPipeline:
    """``model`` cut into one stage per device (see the module doc); built on first use.

    ``batch_size``: which of a batched model's captured sizes to pipeline (default: the
    largest; smaller calls are padded). ``cuts``: kernel indices where stages 1.. start,
    instead of the balance by cost."""
    if not isinstance(model, Model):
        raise InvalidCommand(f"'model' must be a hcqa.models.Model (got {type(model).__name__})")
    check_int("depth", depth, minimum=1)
    if isinstance(devices, Device) or not isinstance(devices, (list, tuple)):
        raise InvalidCommand(
            f"'devices' must be a list of hcqa Devices (got {type(devices).__name__})"
        )
    if not devices:
        raise InvalidCommand("'devices' must name at least one device (got none)")
    sizes = model._buckets
    if batch_size is None:
        batch_size = max(sizes)
    elif batch_size not in sizes or not model.batch_sizes:
        raise InvalidCommand(
            f"'batch_size' must be one of the model's batch sizes {model.batch_sizes} "
            f"(got {batch_size!r})"
        )
    lifted = sizes[batch_size].lifted
    if lifted is None:
        raise InvalidCommand(
            f"model {model.name!r} runs as one opaque kernel (onnxruntime's session): it can't "
            "be cut into stages; load it with backend='tinygrad' to pipeline it"
        )
    kind = "cpu" if lifted.language == "c" else "opencl"
    seen: set[int] = set()
    for i, d in enumerate(devices):
        if not isinstance(d, Device):
            raise InvalidCommand(f"devices[{i}] must be a hcqa Device (got {type(d).__name__})")
        if id(d) in seen:
            raise InvalidCommand(f"devices[{i}] ({d.name}) appears twice: one stage per device")
        seen.add(id(d))
        if d.closed or d.faulted is not None:
            raise InvalidCommand(f"devices[{i}] ({d.name}) must be open and healthy (got {d!r})")
        if device_kind(d) != kind:
            raise InvalidCommand(
                f"devices[{i}] must be a {kind}:N device: model {model.name!r} was lifted to "
                f"{kind} kernels (got {d.name})"
            )
    if len(devices) > len(lifted.kernels):
        raise InvalidCommand(
            f"'devices' must be at most the model's {len(lifted.kernels)} kernels, one stage "
            f"each (got {len(devices)})"
        )
    planned = cut.plan(lifted, len(devices), cuts)
    return ModelPipeline(model, tuple(devices), lifted, planned, depth, batch_size)


class ModelPipeline:
    """A model over several devices: ``await pipe(*arrays)``, ``await pipe.map(xs)``."""

    def __init__(
        self,
        model: Model,
        devices: tuple[Device, ...],
        lifted: Lifted,
        planned: cut.Plan,
        depth: int,
        batch_size: int,
    ) -> None:
        self.model = model
        self.devices = devices
        self.depth = depth
        self.inputs, self.outputs = model.inputs, model.outputs
        self._lifted = lifted
        self._variables = {n: Variable(n, lo, hi) for n, lo, hi in lifted.variables}
        self._plan = planned
        self._batched = bool(model.batch_sizes)
        self._rows = batch_size
        self.stages = tuple(
            PipelineStage(devices[i], s.start, s.stop, s.cost, s.moves)
            for i, s in enumerate(planned.stages)
        )
        self.final_moves = planned.final
        self._pool: SlotPool[_Slot] = SlotPool(depth)  # filled by build()
        self._building = trio.Lock()
        self._completed = 0

    def __repr__(self) -> str:
        cuts = " | ".join(f"{s.device.name}[{s.start}:{s.stop}]" for s in self.stages)
        return f"<ModelPipeline {self.model.name} {cuts} depth={self.depth}>"

    @property
    def graphs(self) -> tuple[tuple[Graph, ...], ...]:
        """Per slot, each stage's captured Graph (its device's work: copy-ins, the moves into
        it, its kernels, copy-outs); a call replays one slot's graph, which records them all.
        Empty until built."""
        return tuple(slot.stages for slot in self._pool.slots)

    @property
    def moves(self) -> tuple[cut.Move, ...]:
        """Every byte range a call moves between stages' devices."""
        return self._plan.moves

    # -- building --------------------------------------------------------------------

    async def build(self) -> None:
        """Build programs, weights and every slot's graph (the first call does it otherwise)."""
        if aio.asyncio_caller():
            return await aio.call(self.build)
        async with self._building:
            if self._pool.slots:
                return
            for d in self.devices:
                d._check_usable()
            lifted, stages = self._lifted, self._plan.stages
            programs = [
                await build_programs(d, lifted, lifted.kernels[s.start : s.stop])
                for d, s in zip(self.devices, stages, strict=True)
            ]
            shared: list[dict[int, Buffer]] = []  # per stage: weights and state
            own = self.model._buckets[self._rows].buffers  # by base, on the model's device
            for i, (d, s) in enumerate(zip(self.devices, stages, strict=True)):
                mine = [b for b, where in self._plan.state.items() if where == i]
                held = {}
                for b in (*s.weights, *mine):
                    base = lifted.bases[b]
                    if d is self.model.device and b not in mine:  # the model's own weights
                        held[b] = own[b]
                        continue
                    held[b] = d.alloc(base.nbytes)
                    if base.data is not None:
                        held[b].copyin(np.frombuffer(base.data, np.uint8))
                shared.append(held)
            slots = [self._slot(programs, shared) for _ in range(self.depth)]
            for d in self.devices:  # the weights are in place before the first replay
                await d.synchronize()
            self._pool.fill(slots)

    def _slot(self, programs: list[dict[Any, Any]], shared: list[dict[int, Buffer]]) -> _Slot:
        lifted = self._lifted
        bases: list[dict[int, Buffer]] = []
        for d, s, held in zip(self.devices, self._plan.stages, shared, strict=True):
            mine = dict(held)
            for b in s.bases:
                mine[b] = d.alloc(lifted.bases[b].nbytes)
            bases.append(mine)

        def view(stage: int, arg: Arg) -> Buffer:
            n = arg.nbytes // arg.dtype.itemsize
            return bases[stage][arg.base].view(arg.offset, arg.nbytes, dtype=arg.dtype, shape=(n,))

        def move(m: cut.Move) -> None:
            src = bases[m.src][m.base].view(m.offset, m.nbytes)
            transfer(bases[m.dst][m.base].view(m.offset, m.nbytes), src)

        host_in = tuple(np.zeros(a.nbytes // a.dtype.itemsize, a.dtype) for _, a in lifted.inputs)
        host_out = tuple(np.zeros(a.nbytes // a.dtype.itemsize, a.dtype) for _, a in lifted.outputs)
        stage_graphs: list[Graph] = []
        last = len(self._plan.stages) - 1
        for i, s in enumerate(self._plan.stages):
            with capture() as g:  # this stage's work, on its device's queues
                for slot in s.inputs:
                    view(i, lifted.inputs[slot][1]).copyin(host_in[slot])
                for m in s.moves:
                    move(m)
                for k in lifted.kernels[s.start : s.stop]:
                    args = [view(i, a) for a in k.args]
                    launch(k, programs[i][program_key(k)], args, self._variables)
                for m in self._plan.final if i == last else ():
                    move(m)
                for (_, arg), host, where in zip(
                    lifted.outputs, host_out, self._plan.outputs, strict=True
                ):
                    if where == i:
                        view(i, arg).copyout(host)
            stage_graphs.append(g)
        with capture() as graph:  # the stages, recorded in order: one replay per call
            for g in stage_graphs:
                g.submit()
        need: dict[Any, int] = {}
        for part in graph._plan.parts:
            need[part.actor] = need.get(part.actor, 0) + 1
        return _Slot(graph, tuple(stage_graphs), host_in, host_out, need)

    # -- running ---------------------------------------------------------------------

    def _check(self, arrays: Sequence[Any], variables: dict[str, Any]) -> int:
        """Refuse a call the model would refuse; returns its rows (0: not batched)."""
        if len(arrays) != len(self.inputs):
            raise InvalidCommand(
                f"model {self.model.name!r} takes {len(self.inputs)} input(s) "
                f"({', '.join(s.name for s in self.inputs)}) (got {len(arrays)})"
            )
        rows, _ = self.model._check(arrays, variables)
        if rows > self._rows:
            raise InvalidCommand(
                f"pipeline of {self.model.name!r} takes batches of at most {self._rows} rows "
                f"(got {rows})"
            )
        return rows

    async def __call__(self, *arrays: Any, **variables: int) -> Any:
        """Run one call through every stage: one array out, or a tuple for several outputs.
        A model's variables are keywords, as for the model (``start_pos=3``)."""
        rows = self._check(arrays, variables)
        turn = self._pool.join()  # its place in line: the call's order is made here
        try:
            if aio.asyncio_caller():
                return await aio.call(self._run, arrays, rows, variables, turn)
            return await self._run(arrays, rows, variables, turn)
        finally:
            turn.leave()

    async def _run(
        self, arrays: Sequence[np.ndarray], rows: int, variables: dict[str, Any], turn: Turn
    ) -> Any:
        """One call, in the trio host: a slot once ``turn`` heads the line; leaves the line
        once its replay is queued."""
        if not self._pool.slots:
            await self.build()
        with await self._pool.take(turn) as lease:
            slot = lease.slot
            while short := [a for a, k in slot.need.items() if a.room < k]:
                await short[0].wait_for_space()
            for host, a in zip(slot.host_in, arrays, strict=True):
                if self._batched:
                    shaped = host.reshape(self._rows, *a.shape[1:])
                    shaped[:rows] = a
                    shaped[rows:] = 0
                else:
                    host[...] = a.reshape(-1)
            vals = {n: int(v) for n, v in variables.items()}
            fence = lease.fence = slot.graph.submit(**vals)  # type: ignore[arg-type]
            lease.queued()
            await fence
            outs = []
            for spec, host in zip(self.outputs, slot.host_out, strict=True):
                if self._batched:
                    outs.append(host.reshape(self._rows, *spec.shape[1:])[:rows].copy())
                else:
                    outs.append(host.reshape(tuple(d or 0 for d in spec.shape)).copy())
        self._completed += 1
        return outs[0] if len(outs) == 1 else tuple(outs)

    async def map(self, xs: Iterable[Any], **variables: int) -> list[Any]:
        """``[await self(x, **variables) for x in xs]`` with up to ``depth`` calls in flight;
        an item is an array, or a tuple of arrays for a model with several inputs."""
        if aio.asyncio_caller():
            return await aio.call(self.map, xs, **variables)
        calls = [tuple(x) if isinstance(x, tuple) else (x,) for x in xs]
        rows = [self._check(c, variables) for c in calls]

        async def run(i: int, turn: Turn) -> Any:
            return await self._run(calls[i], rows[i], variables, turn)

        failed = "pipelined calls failed"
        return await self._pool.map(len(calls), run, name="pipeline.map", failed=failed)

    def statistics(self) -> ModelPipelineStatistics:
        """A frozen snapshot: stages, depth, calls in flight, completed, cancelled."""
        return ModelPipelineStatistics(
            stages=self.stages,
            depth=self.depth,
            in_flight=self._pool.in_flight,
            completed=self._completed,
            cancelled=self._pool.cancelled,
        )
