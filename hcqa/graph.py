"""Graphs: capture work once, replay it with new variable values.

Theory of operation
-------------------
``with hcqa.capture() as g:`` makes every enqueue in the block -- program calls,
transfers, copies, queue submits -- go to ``g`` instead of to the devices (the
one hook is ``Device._submit``). Each enqueue becomes a *node* on its queue,
with the buffers it reads and writes.

At the end of the block the graph is *built*, once:

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
  symbolic one stays static). Consecutive C kernels on a cpu device are fused into
  one native runner call (``crunner.py``), those with variables too: their entries
  of the runner's argument table are filled per replay.

Replay (``g.submit(**var_vals)`` or ``await g(**var_vals)``) resolves each distinct
expression once, then the patch slots -- a slot whose values did not change since its
last build is sent as built then (``_patch.py``); an unbound or out-of-range variable
raises :class:`~hcqa.errors.InvalidCommand` before anything is sent -- then sends one
message per queue, saying whether it holds Waits (so an idle actor need not scan it).

``buffers={captured: new}`` replays on other buffers of the same device, nbytes, dtype
and shape: the entries that mention them are rebuilt for that replay (fused runs
rebind their address entries and stay fused), and the replay's hazards are tracked
on the new buffers. The graph's boundary is ordered against everything else
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
from collections.abc import Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from hcqa import aio
from hcqa import commands as cmd
from hcqa._capture import capturing, current_capture
from hcqa._patch import (
    CommandSlot,
    RunSlot,
    buffers_of,
    check_rebind,
    rebind_command,
    resolve_all,
    symbols_of,
)
from hcqa.actors import Batch
from hcqa.devices.buffer import hazard_waits
from hcqa.devices.crunner import fuse_runs
from hcqa.errors import DeviceClosed, HcqaError, InvalidCommand, QueueFull
from hcqa.signals import Fence, Signal
from hcqa.variables import Expr, Variable, VarVals, variables_of

if TYPE_CHECKING:
    from hcqa.actors import QueueActor
    from hcqa.devices.base import Device
    from hcqa.devices.buffer import Buffer

__all__ = ["Graph", "GraphStatistics", "capture", "current_capture"]


@attrs.define(eq=False)
class _Node:
    index: int
    actor: QueueActor
    commands: list[Any]
    reads: tuple[Buffer, ...]
    writes: tuple[Buffer, ...]
    also: tuple[Device, ...]
    symbolic: bool
    waits: list[tuple[QueueActor, int]] = attrs.Factory(list)  # (queue, position) kept
    clock: dict[QueueActor, int] = attrs.Factory(dict)
    signals: bool = False

    @property
    def label(self) -> str:
        for c in self.commands:
            if isinstance(c, cmd.Exec):
                return c.program.name
            if isinstance(c, cmd.Copy):
                if isinstance(c.dest, cmd.HostMemoryRef):
                    return "copyout"
                if isinstance(c.src, cmd.HostMemoryRef):
                    return "copyin"
                return "transfer" if c.src.device is not c.dest.device else "copy"
            if isinstance(c, cmd.Load):
                return "load"
        return "queue"


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


@attrs.define(eq=False)
class _Part:
    """One queue's share of the graph: the template and its patch slots."""

    actor: QueueActor
    template: list[Any]
    patches: list[tuple[int, str, Any]]  # (index, kind, data): signal and wait values
    slots: list[tuple[int, CommandSlot | RunSlot]]  # entries with variables
    touch: dict[Buffer, list[int]]  # template entries that mention each buffer
    waits: bool  # whether the part's batch holds a Wait
    nsignals: int
    reads: tuple[Buffer, ...]
    writes: tuple[Buffer, ...]
    also: tuple[Device, ...]
    transfers: list[int]  # signal indices after cross-device transfers, for the fan-out
    read_at: dict[Buffer, int] = attrs.Factory(dict)  # positions in reads / writes
    write_at: dict[Buffer, int] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        self.read_at = {b: i for i, b in enumerate(self.reads)}
        self.write_at = {b: i for i, b in enumerate(self.writes)}


def _conflicts(
    reads: Sequence[Buffer], writes: Sequence[Buffer], state: dict[int, Any]
) -> list[_Node]:
    """Graph-local hazards: the earlier nodes this access must follow."""
    deps: list[_Node] = []
    for b in reads:
        last = state.get(id(b._hazards))
        if last is not None and last[0] is not None:
            deps.append(last[0])
    for b in writes:
        last = state.get(id(b._hazards))
        if last is not None:
            if last[0] is not None:
                deps.append(last[0])
            deps.extend(last[1])
    return deps


class Graph:
    """Captured work: replay with ``await g(**var_vals)`` or ``g.submit(**var_vals)``."""

    def __init__(self) -> None:
        self._nodes: list[_Node] = []
        self._parts: list[_Part] = []
        self._built = False
        self._replays = 0
        self._dropped = 0
        self._native = 0
        self._variables: set[Variable] = set()
        self._names: set[str] = set()  # the variables' names, once the capture ends
        self._capture_signal = _placeholder()
        self._signals: dict[Signal, None] = {}  # user signals the commands use (see _submit)
        self._sink: QueueActor | None = None
        self._owners: list[Buffer] = []  # the allocations the graph uses (checked per replay)
        self._symbols: tuple[Any, ...] = ()  # the distinct expressions of the patch slots
        self._captured: dict[Buffer, int] = {}  # every buffer used -> its allocation id
        self._shared: set[Buffer] = set()  # those whose allocation another buffer shares
        self._allocations: frozenset[int] = frozenset()
        # where each buffer sits in _owners / _final (to substitute rebound ones)
        self._owner_at: dict[Buffer, int] = {}
        self._final_at: dict[Buffer, int] = {}
        # per allocation touched: (a buffer, last writer queue or None, queues reading since)
        self._final: list[tuple[Buffer, QueueActor | None, tuple[QueueActor, ...]]] = []

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
            _Node(
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
        order: dict[QueueActor, list[_Node]] = {}
        position: dict[_Node, int] = {}
        clocks: dict[QueueActor, dict[QueueActor, int]] = {}
        state: dict[int, Any] = {}  # hazards id -> (last writer node, [readers since])
        buffers: dict[int, Buffer] = {}
        for node in self._nodes:
            q = node.actor
            queue_nodes = order.setdefault(q, [])
            position[node] = len(queue_nodes)
            queue_nodes.append(node)
            clock = clocks.setdefault(q, {})
            for dep in sorted(_conflicts(node.reads, node.writes, state), key=lambda n: n.index):
                p = dep.actor
                if p is q:
                    continue
                pos = position[dep]
                if clock.get(p, -1) >= pos:
                    self._dropped += 1
                    continue
                node.waits.append((p, pos))
                dep.signals = True
                for r, v in dep.clock.items():
                    if clock.get(r, -1) < v:
                        clock[r] = v
                clock[p] = pos
            clock[q] = position[node]
            node.clock = dict(clock)
            for b in node.reads:
                entry = state.setdefault(id(b._hazards), [None, []])
                entry[1].append(node)
            for b in node.writes:
                state[id(b._hazards)] = [node, []]
            for b in (*node.reads, *node.writes):
                buffers.setdefault(id(b._hazards), b)
        self._owners = list({id(b._owner): b._owner for b in buffers.values()}.values())
        for key, b in buffers.items():
            writer, readers = state[key]
            self._final.append(
                (
                    b,
                    writer.actor if writer is not None else None,
                    tuple(dict.fromkeys(r.actor for r in readers)),
                )
            )
        # signal indices: 1-based count of signalling nodes up to and including each
        sidx: dict[_Node, int] = {}
        for nodes in order.values():
            k = 0
            for n in nodes:
                if n.also:  # a cross-device transfer: the fan-out awaits its own point
                    n.signals = True
                if n.signals:
                    k += 1
                    sidx[n] = k
        self._sink = self._nodes[-1].actor if self._nodes else None
        for q, nodes in order.items():
            self._parts.append(self._build_part(q, nodes, position, sidx, order))
        symbols: dict[Any, None] = {}
        for part in self._parts:
            for _, slot in part.slots:
                symbols.update(dict.fromkeys(slot.symbols))
            for b in part.touch:
                self._captured[b] = id(b._hazards)
        self._symbols = tuple(symbols)
        per_allocation: dict[int, int] = {}
        for a in self._captured.values():
            per_allocation[a] = per_allocation.get(a, 0) + 1
        self._shared = {b for b, a in self._captured.items() if per_allocation[a] > 1}
        self._allocations = frozenset(per_allocation)
        self._owner_at = {b: i for i, b in enumerate(self._owners)}
        self._final_at = {b: i for i, (b, _, _) in enumerate(self._final)}

    def _build_part(
        self,
        q: QueueActor,
        nodes: list[_Node],
        position: dict[_Node, int],
        sidx: dict[_Node, int],
        order: dict[QueueActor, list[_Node]],
    ) -> _Part:
        template: list[Any] = []
        patches: list[tuple[int, str, Any]] = []
        transfers: list[int] = []
        nsig = sum(1 for n in nodes if n.signals)
        reads: dict[int, Buffer] = {}
        writes: dict[int, Buffer] = {}
        also: dict[int, Device] = {}
        for n in nodes:
            for p, pos in n.waits:
                patches.append((len(template), "wait", (p, sidx[order[p][pos]])))
                template.append(None)
            for c in n.commands:
                if n.symbolic and type(c) is not cmd.Exec and symbols_of(c):
                    patches.append((len(template), "command", c))
                    template.append(None)
                else:  # static, or an Exec: fuse_runs makes a slot of it if it must
                    template.append(c)
            if n.signals:
                patches.append((len(template), "signal", sidx[n]))
                template.append(None)
            if n.also:
                transfers.append(sidx[n])
            for b in n.reads:
                reads.setdefault(id(b._hazards), b)
            for b in n.writes:
                writes[id(b._hazards)] = b
            for d in n.also:
                also[id(d)] = d
        nsig += 1  # the part's final signal
        patches.append((len(template), "signal", nsig))
        template.append(None)
        template, patches, fused = fuse_runs(template, patches)
        self._native += fused
        slots: list[tuple[int, CommandSlot | RunSlot]] = []
        values: list[tuple[int, str, Any]] = []
        for index, kind, data in patches:
            if kind == "command":
                slots.append((index, CommandSlot(data)))
            elif kind == "run":
                slots.append((index, RunSlot(data)))
            else:
                values.append((index, kind, data))
        touch: dict[Buffer, list[int]] = {}
        entries = [(i, c) for i, c in enumerate(template) if c is not None]
        entries += [(i, s.command if isinstance(s, CommandSlot) else s.run) for i, s in slots]
        for i, c in entries:
            for b in dict.fromkeys(buffers_of(c)):
                touch.setdefault(b, []).append(i)
        waits = any(kind == "wait" for _, kind, _ in values) or any(
            type(c) is cmd.Wait for c in template
        )
        return _Part(
            actor=q,
            template=template,
            patches=values,
            slots=slots,
            touch=touch,
            waits=waits,
            nsignals=nsig,
            reads=tuple(b for k, b in reads.items() if k not in writes),
            writes=tuple(writes.values()),
            also=tuple(also.values()),
            transfers=transfers,
        )

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
    ) -> list[tuple[_Part, list[Any], int]]:
        """Resolve every part's patches: (part, batch, base). Raises before anything is sent."""
        values = resolve_all(self._symbols, var_vals) if self._symbols else {}
        bases = {part.actor: part.actor.value for part in self._parts}
        out = []
        for part in self._parts:
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
            for index, slot in part.slots:
                batch[index] = slot.build(values, var_vals, rebind if index in touched else None)
                touched.discard(index)
            for index in touched:  # static entries on rebound buffers: for this replay only
                batch[index] = rebind_command(batch[index], rebind)  # type: ignore[arg-type]
            out.append((part, batch, base))
        return out

    def submit(self, *, buffers: dict[Buffer, Buffer] | None = None, **var_vals: int) -> Fence:
        """Send one replay now (never blocks); the Fence is reached when all of it is done.

        ``buffers={captured: new}`` runs it on other buffers (same device, nbytes, dtype
        and shape) for this replay."""
        fence, _ = self._submit(var_vals, buffers)
        return fence

    def _submit(
        self, var_vals: dict[str, Any], buffers: object = None
    ) -> tuple[Fence, list[Fence]]:
        if not self._built:
            raise InvalidCommand("a graph can be replayed once its capture block has ended")
        if current_capture() is not None:
            raise InvalidCommand("replaying a graph inside a capture is not supported")
        if not self._parts:
            raise InvalidCommand("this graph captured no work")
        bound = self._bind(var_vals)
        rebind = None
        owners, final_state = self._owners, self._final
        if buffers is not None:
            rebind = check_rebind(buffers, self._captured, self._shared, self._allocations)
            if rebind:  # the rebound buffers' entries, substituted
                owners, final_state = list(owners), list(final_state)
                for old, new in rebind.items():
                    i = self._owner_at.get(old)
                    if i is not None:
                        owners[i] = new  # (checked already)
                    i = self._final_at.get(old)
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
            part.actor.device._check_usable()
            for d in part.also:
                d._check_usable()
            if part.actor.full:
                raise QueueFull(
                    f"{part.actor.name} queue is full: await the graph to apply backpressure"
                )
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
            device = q.device
            tail: list[Any] = []
            if q is self._sink:
                for other, final in finals.items():
                    if other is not q:
                        tail.append(cmd.Wait(signal=other.signal, value=final))
            q.value = finals[q]
            seq, steps = device._steps(part.also)
            q.send_nowait(Batch(head + batch + tail + steps), part.waits or bool(head or tail))
            limit = device.hang_limit
            fences.append(Fence(q.signal, finals[q], hang_limit=limit, context=q.name))
            for k in part.transfers:
                fences.append(Fence(q.signal, base + k, hang_limit=limit, context=q.name))
            if q is self._sink:
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
                full = next((p.actor for p in self._parts if p.actor.full), None)
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
            for part in self._parts:
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
            queues=len(self._parts),
            devices=len({id(p.actor.device) for p in self._parts}),
            waits=sum(len(n.waits) for n in self._nodes),
            waits_dropped=self._dropped,
            native_runs=self._native,
            replays=self._replays,
            variables=tuple(sorted(v.name for v in self._variables)),
        )

    def dump(self) -> str:
        """A readable listing of the captured DAG: nodes per queue and their waits."""
        lines = [f"graph: {len(self._nodes)} nodes on {len(self._parts)} queues"]
        for n in self._nodes:
            waits = ", ".join(f"{p.name}#{pos}" for p, pos in n.waits) or "-"
            extra = " signals" if n.signals else ""
            sym = " (variables)" if n.symbolic else ""
            lines.append(f"  [{n.index}] {n.actor.name}: {n.label}{sym} waits {waits}{extra}")
        for part in self._parts:
            kinds = [type(c).__name__ if c is not None else "patch" for c in part.template]
            lines.append(f"  {part.actor.name} template: {' '.join(kinds)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Graph {len(self._nodes)} nodes, {len(self._parts)} queues>"


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
