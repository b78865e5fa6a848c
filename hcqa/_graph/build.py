"""Building a captured graph: from recorded nodes to one template batch per queue.

Theory of operation
-------------------
A capture records *nodes* (``Node``): the commands of one enqueue, the queue it
went to, and the buffers it reads and writes. :func:`build` turns the node list,
once, into a :class:`Plan` that :class:`hcqa.graph.Graph` replays:

* **Dependencies** come from buffer access, as in eager mode (:func:`conflicts`):
  a node that reads a buffer follows its last writer; one that writes follows the
  last writer and every reader since. Nodes of one queue keep their order.
* **Waits.** A dependency on another queue becomes a wait on that queue's signal
  at the producer node's position. Each queue keeps a *vector clock* (the latest
  position of every other queue it already waits for, directly or through another
  queue's wait); a wait the clock already implies is dropped and counted.
* **Signal indices.** A node that someone waits for -- or a cross-device transfer,
  which the replay's fan-out awaits on its own -- signals its queue right after it;
  indices count from 1 per queue, and each part ends with one more signal. Their
  absolute values are known only at replay time (the queue's signal counts on from
  wherever it is), so they are *patches*.
* **Templates** (:func:`build_part`). Each queue's nodes become one list of
  commands: static commands as they are, ``None`` holes for patches (signal and wait
  values, commands holding variables). Consecutive launches the device can fuse
  become one fused command (``hcqa.devices.fusion.fuse``, which asks the device: the
  fusion seam), which may turn symbolic kernels into run slots. For rebinding buffers
  on replay, the part lists which template entries mention each buffer (``touch``).
* **The boundary**: what the whole graph reads and writes, per allocation, and
  which queue wrote each last -- so a replay can take eager hazards on entry and
  leave them set on exit, as an eager enqueue would.

Nothing here sends anything or touches a device: a plan is plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from hcqa import commands as cmd
from hcqa._graph.patch import CommandSlot, RunSlot, buffers_of, symbols_of
from hcqa.devices.fusion import fuse

if TYPE_CHECKING:
    from hcqa.actors import QueueActor
    from hcqa.devices.base import Device
    from hcqa.devices.buffer import Buffer

__all__ = ["Node", "Part", "Plan", "build", "conflicts", "fuse_batch"]

FinalState = list[tuple["Buffer", "QueueActor | None", "tuple[QueueActor, ...]"]]


@attrs.define(eq=False)
class Node:
    """One recorded enqueue."""

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


@attrs.define(eq=False)
class Part:
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


@attrs.define(eq=False)
class Plan:
    """What a graph replays: its parts and its boundary (see the module doc)."""

    parts: list[Part]
    dropped: int  # waits a vector clock made redundant
    native: int  # fused native runs
    sink: QueueActor | None  # the queue whose final batch waits for all the others
    owners: list[Buffer]  # the allocations the graph uses (checked per replay)
    final: FinalState  # per allocation: (a buffer, last writer queue, queues reading since)
    symbols: tuple[Any, ...]  # the distinct expressions of the patch slots
    captured: dict[Buffer, int]  # every buffer used -> its allocation id
    shared: set[Buffer]  # those whose allocation another buffer shares
    allocations: frozenset[int]
    owner_at: dict[Buffer, int]  # where each buffer sits in owners / final
    final_at: dict[Buffer, int]


def conflicts(
    reads: Sequence[Buffer], writes: Sequence[Buffer], state: dict[int, Any]
) -> list[Node]:
    """Graph-local hazards: the earlier nodes this access must follow."""
    deps: list[Node] = []
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


def build(nodes: list[Node]) -> Plan:
    """Dependencies, waits, signal indices and one part per queue (see the module doc)."""
    dropped = 0
    order: dict[QueueActor, list[Node]] = {}
    position: dict[Node, int] = {}
    clocks: dict[QueueActor, dict[QueueActor, int]] = {}
    state: dict[int, Any] = {}  # hazards id -> (last writer node, [readers since])
    buffers: dict[int, Buffer] = {}
    for node in nodes:
        q = node.actor
        queue_nodes = order.setdefault(q, [])
        position[node] = len(queue_nodes)
        queue_nodes.append(node)
        clock = clocks.setdefault(q, {})
        for dep in sorted(conflicts(node.reads, node.writes, state), key=lambda n: n.index):
            p = dep.actor
            if p is q:
                continue
            pos = position[dep]
            if clock.get(p, -1) >= pos:
                dropped += 1
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
    owners = list({id(b._owner): b._owner for b in buffers.values()}.values())
    final: FinalState = []
    for key, b in buffers.items():
        writer, readers = state[key]
        final.append(
            (
                b,
                writer.actor if writer is not None else None,
                tuple(dict.fromkeys(r.actor for r in readers)),
            )
        )
    # signal indices: 1-based count of signalling nodes up to and including each
    sidx: dict[Node, int] = {}
    for queue_nodes in order.values():
        k = 0
        for n in queue_nodes:
            if n.also:  # a cross-device transfer: the fan-out awaits its own point
                n.signals = True
            if n.signals:
                k += 1
                sidx[n] = k
    parts: list[Part] = []
    native = 0
    for q, queue_nodes in order.items():
        part, fused = build_part(q, queue_nodes, sidx, order)
        parts.append(part)
        native += fused
    symbols: dict[Any, None] = {}
    captured: dict[Buffer, int] = {}
    for part in parts:
        for _, slot in part.slots:
            symbols.update(dict.fromkeys(slot.symbols))
        for b in part.touch:
            captured[b] = id(b._hazards)
    per_allocation: dict[int, int] = {}
    for a in captured.values():
        per_allocation[a] = per_allocation.get(a, 0) + 1
    return Plan(
        parts=parts,
        dropped=dropped,
        native=native,
        sink=nodes[-1].actor if nodes else None,
        owners=owners,
        final=final,
        symbols=tuple(symbols),
        captured=captured,
        shared={b for b, a in captured.items() if per_allocation[a] > 1},
        allocations=frozenset(per_allocation),
        owner_at={b: i for i, b in enumerate(owners)},
        final_at={b: i for i, (b, _, _) in enumerate(final)},
    )


def build_part(
    q: QueueActor,
    nodes: list[Node],
    sidx: dict[Node, int],
    order: dict[QueueActor, list[Node]],
) -> tuple[Part, int]:
    """One queue's template, patches and slots; also how many native runs it fused."""
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
            else:  # static, or an Exec: fuse makes a slot of it if it must
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
    # A capture ends on the caller's task (the event loop), where a compile would block
    # it: ``Device._fuse`` builds nothing (the cpu backend's generic runner was loaded with
    # the programs, ``program_async``).
    template, patches, fused = fuse(template, patches)
    slots: list[tuple[int, CommandSlot | RunSlot]] = []
    values: list[tuple[int, str, Any]] = []
    for index, kind, data in patches:
        if kind == "command":
            slots.append((index, CommandSlot(data, in_place=True)))
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
    part = Part(
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
    return part, fused


def fuse_batch(
    commands: Sequence[Any], symbolic: set[int]
) -> tuple[list[Any], list[tuple[int, CommandSlot | RunSlot]]] | None:
    """A built queue's commands with their runs of C kernels fused, for a queue submitted
    again or with variables: the template, and the slots to build per new set of values
    (positions in the template; none for a queue without variables); None when nothing
    fuses. ``symbolic``: the positions of the commands that hold variables. Nothing is
    compiled on the caller's task (``Device._fuse`` builds nothing)."""
    template: list[Any] = []
    patches: list[tuple[int, str, Any]] = []
    for i, c in enumerate(commands):
        if i in symbolic and type(c) is not cmd.Exec:
            patches.append((i, "command", c))
            template.append(None)
        else:  # static, or an Exec: fuse makes a slot of it if it must
            template.append(c)
    template, patches, fused = fuse(template, patches)
    if not fused:
        return None
    slots: list[tuple[int, CommandSlot | RunSlot]] = [
        (index, CommandSlot(data) if kind == "command" else RunSlot(data))
        for index, kind, data in patches
    ]
    return template, slots
