"""Graphs: capture work once, replay it with new variable values.

Theory of operation
-------------------
``with hcqa.capture() as g:`` makes every enqueue in the block -- program calls,
transfers, copies, queue submits -- go to ``g`` instead of to the devices (the
one hook is ``Device._submit``). Each enqueue becomes a *node* on its queue,
with the buffers it reads and writes.

At the end of the block the graph is *built*, once (``_graph/build.py`` tells how):

* Dependencies come from buffer access, as in eager mode: a node that reads a
  buffer depends on its last writer; one that writes depends on the last writer
  and every reader since. Nodes of one queue keep their order and need nothing.
* A cross-queue dependency becomes a ``Wait`` on the producer queue's signal, which
  the producer sets right after that node. Waits that a queue's vector clock already
  implies (directly or through another queue's wait) are dropped.
* Each queue's part becomes a *template* batch: static commands shared by every
  replay, plus *patch slots* for what changes per replay -- signal values
  (they count on from wherever the queue's signal is at replay time) and
  commands with variables (only those: a static command of a batch that also has a
  symbolic one stays static). Consecutive launches that the device can fuse become one
  fused command, those with variables too (the fusion seam, ``devices/fusion.py``: on a
  cpu device, C kernels as one native call over an argument table whose symbolic entries
  are filled per replay).

Replay (``g.submit(**var_vals)`` or ``await g(**var_vals)``) resolves each distinct
expression once, then the patch slots -- a slot whose values did not change since its
last build is sent as built then (``_graph/patch.py``); an unbound or out-of-range variable
raises :class:`~hcqa.errors.InvalidCommand` before anything is sent -- then sends one
message per queue, saying whether it holds Waits (so an idle actor need not scan it).

``buffers={captured: new}`` replays on other buffers of the same device, nbytes, dtype
and shape: the entries that mention them are rebuilt for that replay (fused runs
rebind their address entries and stay fused), and the replay's hazards are tracked
on the new buffers. ``g.submit(buffers=...)`` inside another capture records ``g``'s
enqueues into that graph, on the new buffers (a graph composed of graphs: how a
:class:`~hcqa.Pipeline` runs a Graph stage). The graph's boundary is ordered against everything else
with the same buffer hazards as eager work, so replays of one graph from
several tasks, or eager work around a replay, serialize correctly: a replay
simply queues behind the previous one.

``await g(...)`` fans out: one child task of a nursery per queue and per cross-device
transfer awaits that part. The first failure cancels the siblings; the replay raises
that :class:`~hcqa.errors.DeviceFault` itself (faults cross devices as one instance),
or an ``ExceptionGroup`` when the replay's devices hold several *different* errors.
Cancelling the awaiting task does not cancel device work: the devices stay usable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio

from hcqa import aio
from hcqa import commands as cmd
from hcqa._graph.build import Node, Part, Plan, build
from hcqa._graph.patch import check_rebind, rebind_command, resolve_all
from hcqa.actors import Batch
from hcqa.actors.actor import LOST
from hcqa.devices.buffer import hazard_waits
from hcqa.devices.capture import capturing, current_capture
from hcqa.errors import DeviceClosed, HcqaError, InvalidCommand, QueueFull, work_owner
from hcqa.signals import Fence, Signal
from hcqa.variables import Expr, Variable, VarVals, variables_of

if TYPE_CHECKING:
    from hcqa.actors import QueueActor
    from hcqa.devices.base import Device
    from hcqa.devices.buffer import Buffer

__all__ = ["Graph", "GraphStatistics", "capture", "current_capture"]


@attrs.frozen(kw_only=True)
class GraphStatistics:
    """What :meth:`Graph.statistics` reports."""

    nodes: int
    queues: int
    devices: int
    waits: int
    waits_dropped: int
    native_runs: int
    replays: int
    variables: tuple[str, ...]


class Graph:
    """Captured work: replay with ``await g(**var_vals)`` or ``g.submit(**var_vals)``."""

    def __init__(self) -> None:
        self._nodes: list[Node] = []
        self._plan: Plan = build([])  # what a replay sends: made once the capture ends
        self._built = False
        self._replays = 0
        self._variables: set[Variable] = set()
        self._names: set[str] = set()  # the variables' names, once the capture ends
        self._capture_signal = _placeholder()
        self._signals: dict[Signal, None] = {}  # user signals the commands use (see _submit)

    # -- capture -------------------------------------------------------------------------

    def _record(
        self,
        device: Device,
        actor: QueueActor,
        commands: list[Any],
        reads: Iterable[Buffer],
        writes: Iterable[Buffer],
        also: Sequence[Device],
    ) -> Fence:
        if self._built:
            raise InvalidCommand("this graph's capture has ended; capture a new graph")
        device._check_usable()
        symbolic = False
        for c in commands:
            if type(c) in (cmd.Wait, cmd.Signal, cmd.Timestamp):
                self._signals[c.signal] = None
            for value in attrs.astuple(c, recurse=False):
                items = value if isinstance(value, tuple) else (value,)
                for v in items:
                    if isinstance(v, (Variable, Expr)):
                        symbolic = True
                        self._variables |= variables_of(v)
        self._nodes.append(
            Node(
                index=len(self._nodes),
                actor=actor,
                commands=list(commands),
                reads=tuple(reads),
                writes=tuple(writes),
                also=tuple(also),
                symbolic=symbolic,
            )
        )
        return Fence(self._capture_signal, 1)

    # -- build ---------------------------------------------------------------------------

    def _build(self) -> None:
        self._built = True
        self._names = {v.name for v in self._variables}
        self._plan = build(self._nodes)

    # -- replay --------------------------------------------------------------------------

    def _bind(self, var_vals: dict[str, Any]) -> VarVals:
        names = self._names
        unknown = sorted(set(var_vals) - names)
        if unknown:
            raise InvalidCommand(
                f"replay got unknown variables {unknown} (the graph has {sorted(names)})"
            )
        return {v: var_vals[v.name] for v in self._variables if v.name in var_vals}

    def _batches(
        self, var_vals: VarVals, rebind: dict[Buffer, Buffer] | None
    ) -> list[tuple[Part, list[Any], int]]:
        """Resolve every part's patches: (part, batch, base). Raises before anything is sent."""
        values = resolve_all(self._plan.symbols, var_vals) if self._plan.symbols else {}
        bases = {part.actor: part.actor.value for part in self._plan.parts}
        out = []
        for part in self._plan.parts:
            base = bases[part.actor]
            batch = list(part.template)
            for index, kind, data in part.patches:
                if kind == "signal":
                    batch[index] = cmd.Signal(signal=part.actor.signal, value=base + data)
                else:
                    p, k = data
                    batch[index] = cmd.Wait(signal=p.signal, value=bases[p] + k)
            touched: set[int] = set()
            if rebind:
                for b in rebind:
                    touched.update(part.touch.get(b, ()))
            bind = False
            for index, slot in part.slots:
                if slot.patch is not None and index not in touched:
                    slot.check(values)  # (typed vals: their C range)
                    batch[index] = slot.command  # sent as captured, patched in place:
                    bind = True  # its variables resolve from the Bind (see Bind)
                    continue
                batch[index] = slot.build(values, var_vals, rebind if index in touched else None)
                touched.discard(index)
            for index in touched:  # static entries on rebound buffers: for this replay only
                batch[index] = rebind_command(batch[index], rebind)  # type: ignore[arg-type]
            if bind:  # commands patched in place resolve their variables from this
                batch.insert(0, cmd.Bind(values=values))
            out.append((part, batch, base))
        return out

    def submit(self, *, buffers: dict[Buffer, Buffer] | None = None, **var_vals: int) -> Fence:
        """Send one replay now (never blocks); the Fence is reached when all of it is done.

        ``buffers={captured: new}`` runs it on other buffers (same device, nbytes, dtype
        and shape) for this replay. Inside another graph's capture it records this graph's
        work there instead (see :meth:`_inline`)."""
        outer = current_capture()
        if outer is not None:
            return self._inline(outer, var_vals, buffers)
        fence, _ = self._submit(var_vals, buffers)
        return fence

    def _inline(self, outer: Graph, var_vals: dict[str, Any], buffers: object) -> Fence:
        """Record every enqueue this graph captured into ``outer``'s capture, on the buffers
        ``buffers`` names instead of the captured ones: as if the work were enqueued again
        there. Its variables stay variables (of ``outer``: bound when it is replayed)."""
        if not self._built:
            raise InvalidCommand("a graph can be replayed once its capture block has ended")
        if var_vals:
            raise InvalidCommand(
                "a graph replayed inside a capture keeps its variables; bind them when the "
                f"enclosing graph is replayed (got values for {sorted(var_vals)})"
            )
        rebind: dict[Buffer, Buffer] = {}
        if buffers is not None:
            rebind = check_rebind(
                buffers, self._plan.captured, self._plan.shared, self._plan.allocations
            )
        fence = Fence(outer._capture_signal, 1)
        for n in self._nodes:
            commands = [rebind_command(c, rebind) for c in n.commands] if rebind else n.commands
            reads = tuple(rebind.get(b, b) for b in n.reads)
            writes = tuple(rebind.get(b, b) for b in n.writes)
            device = cast("Device", n.actor.device)
            fence = outer._record(device, n.actor, list(commands), reads, writes, n.also)
        return fence

    def _submit(
        self, var_vals: dict[str, Any], buffers: object = None
    ) -> tuple[Fence, list[Fence]]:
        if not self._built:
            raise InvalidCommand("a graph can be replayed once its capture block has ended")
        if current_capture() is not None:
            raise InvalidCommand(
                "a graph can't be awaited inside a capture: g.submit() records its work there"
            )
        if not self._plan.parts:
            raise InvalidCommand("this graph captured no work")
        bound = self._bind(var_vals)
        rebind = None
        owners, final_state = self._plan.owners, self._plan.final
        if buffers is not None:
            rebind = check_rebind(
                buffers, self._plan.captured, self._plan.shared, self._plan.allocations
            )
            if rebind:  # the rebound buffers' entries, substituted
                owners, final_state = list(owners), list(final_state)
                for old, new in rebind.items():
                    i = self._plan.owner_at.get(old)
                    if i is not None:
                        owners[i] = new  # (checked already)
                    i = self._plan.final_at.get(old)
                    if i is not None:
                        final_state[i] = (new, *final_state[i][1:])
            else:
                rebind = None
        for b in owners:
            b._check()  # freed or closed since the capture: refuse before anything is sent
        for s in self._signals:
            if s._closed:
                s._check_queueable("replay")  # DeviceClosed, before anything is sent
        resolved = self._batches(bound, rebind)
        for part, _, _ in resolved:
            cast("Device", part.actor.device)._check_usable()
            for d in part.also:
                d._check_usable()
            if part.actor.full:
                raise QueueFull(
                    f"{part.actor.name} queue is full: await the graph to apply backpressure"
                )
        if LOST:  # a failed batch left data unwritten (rare: see QueueActor._fail)
            for hz in _written_unless_lost(self._nodes, rebind):
                LOST.pop(hz, None)  # written by this replay: valid again
        # Boundary hazards first, for all parts, before any of this replay is recorded.
        if rebind is None:
            heads = [hazard_waits(p.actor, p.reads, p.writes) for p, _, _ in resolved]
        else:
            heads = [
                hazard_waits(
                    p.actor, _swap(p.reads, p.read_at, rebind), _swap(p.writes, p.write_at, rebind)
                )
                for p, _, _ in resolved
            ]
        finals: dict[QueueActor, int] = {p.actor: base + p.nsignals for p, _, base in resolved}
        fences: list[Fence] = []
        sink_fence: Fence | None = None
        for (part, batch, base), head in zip(resolved, heads, strict=True):
            q = part.actor
            device = cast("Device", q.device)
            tail: list[Any] = []
            if q is self._plan.sink:
                for other, final in finals.items():
                    if other is not q:
                        tail.append(cmd.Wait(signal=other.signal, value=final))
            q.value = finals[q]
            run = head + batch + tail
            seq = device._steps(run, part.also)
            owner = work_owner.get()
            if owner is not None:
                device._own(q, base + 1, finals[q], owner, run)
            q.send_nowait(Batch(run), part.waits or bool(head or tail))
            limit = device.hang_limit
            fences.append(Fence(q.signal, finals[q], hang_limit=limit, context=q.name))
            for k in part.transfers:
                fences.append(Fence(q.signal, base + k, hang_limit=limit, context=q.name))
            if q is self._plan.sink:
                sink_fence = device._timeline.fence(seq)
        for b, writer, readers in final_state:
            hz = b._hazards
            if writer is not None:
                hz.write = (writer, finals[writer])
                hz.reads = {r: finals[r] for r in readers}
            else:
                for r in readers:
                    hz.reads[r] = finals[r]
        self._replays += 1
        assert sink_fence is not None
        return sink_fence, fences

    async def __call__(
        self, *, buffers: dict[Buffer, Buffer] | None = None, **var_vals: int
    ) -> None:
        """Replay and wait for all of it; see the module doc for the error policy.

        ``buffers={captured: new}``: as for :meth:`submit`."""
        if aio.asyncio_caller():
            return await aio.call(self.__call__, buffers=buffers, **var_vals)
        while True:
            try:
                _, fences = self._submit(var_vals, buffers)
                break
            except QueueFull:
                full = next((p.actor for p in self._plan.parts if p.actor.full), None)
                if full is not None:
                    await full.wait_for_space()
        errors: list[BaseException] = []

        async def watch(fence: Fence, scope: trio.CancelScope) -> None:
            try:
                await fence.wait()
            except (HcqaError, DeviceClosed) as exc:
                if all(exc is not e for e in errors):
                    errors.append(exc)
                scope.cancel()

        async with trio.open_nursery() as nursery:
            for f in fences:
                nursery.start_soon(watch, f, nursery.cancel_scope)
        if errors:  # independent faults elsewhere in this replay belong in the report too
            for part in self._plan.parts:
                other = part.actor.device._error
                if isinstance(other, HcqaError) and all(other is not e for e in errors):
                    other.observed = True
                    errors.append(other)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup("graph replay failed on several devices", errors)  # type: ignore[type-var]

    # -- introspection -------------------------------------------------------------------

    def statistics(self) -> GraphStatistics:
        """A frozen snapshot: nodes, queues, devices, waits kept/dropped, replays."""
        return GraphStatistics(
            nodes=len(self._nodes),
            queues=len(self._plan.parts),
            devices=len({id(p.actor.device) for p in self._plan.parts}),
            waits=sum(len(n.waits) for n in self._nodes),
            waits_dropped=self._plan.dropped,
            native_runs=self._plan.native,
            replays=self._replays,
            variables=tuple(sorted(v.name for v in self._variables)),
        )

    def dump(self) -> str:
        """A readable listing of the captured DAG: nodes per queue and their waits."""
        lines = [f"graph: {len(self._nodes)} nodes on {len(self._plan.parts)} queues"]
        for n in self._nodes:
            waits = ", ".join(f"{p.name}#{pos}" for p, pos in n.waits) or "-"
            extra = " signals" if n.signals else ""
            sym = " (variables)" if n.symbolic else ""
            lines.append(f"  [{n.index}] {n.actor.name}: {n.label}{sym} waits {waits}{extra}")
        for part in self._plan.parts:
            kinds = [type(c).__name__ if c is not None else "patch" for c in part.template]
            lines.append(f"  {part.actor.name} template: {' '.join(kinds)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Graph {len(self._nodes)} nodes, {len(self._plan.parts)} queues>"


def _swap(
    bufs: tuple[Buffer, ...], at: dict[Buffer, int], rebind: dict[Buffer, Buffer]
) -> Sequence[Buffer]:
    """``bufs`` with the rebound ones replaced (``at``: where each sits)."""
    out: list[Buffer] | None = None
    for old, new in rebind.items():
        i = at.get(old)
        if i is not None:
            if out is None:
                out = list(bufs)
            out[i] = new
    return bufs if out is None else out


_PLACEHOLDER: list[Signal] = []


def _written_unless_lost(
    nodes: Sequence[Node], rebind: Mapping[Buffer, Buffer] | None
) -> list[Any]:
    """Refuse a replay that reads what a failed batch was to write, as eager work is
    refused (``Device._submit``), before anything is sent; else the allocations (hazard
    records) it writes. Walks the nodes in capture order: what an earlier node of the replay
    writes is valid for a later one."""
    written: dict[int, Any] = {}
    for n in nodes:
        for b in n.reads:
            b = rebind.get(b, b) if rebind else b
            hz = b._hazards
            cause = None if id(hz) in written else LOST.get(hz)
            if cause is not None:
                error = DeviceClosed(f"{b!r} holds no valid data: {cause}")
                error.__cause__ = cause
                raise error
        for b in n.writes:
            hz = (rebind.get(b, b) if rebind else b)._hazards
            written[id(hz)] = hz
    return list(written.values())


def _placeholder() -> Signal:
    """The (broken) signal of every fence handed out while capturing: one per process."""
    if not _PLACEHOLDER:
        sig = Signal(name="capture placeholder")
        sig._break(
            InvalidCommand("a fence returned while capturing can't be awaited: await the replay")
        )
        _PLACEHOLDER.append(sig)
    return _PLACEHOLDER[0]


@contextlib.contextmanager
def capture() -> Generator[Graph, None, None]:
    """Record the enqueues of the block into a :class:`Graph` instead of running them."""
    if current_capture() is not None:
        raise InvalidCommand("capture() blocks can't be nested")
    graph = Graph()
    token = capturing.set(graph)
    try:
        yield graph
    finally:
        capturing.reset(token)
    graph._build()
