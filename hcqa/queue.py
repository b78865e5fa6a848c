"""The HCQ-style ``Queue`` builder: chainable verbs, one message per submit.

Theory of operation
-------------------
``dev.compute_queue()`` / ``dev.copy_queue()`` return an empty :class:`Queue`.
Each verb validates its arguments at once (errors raise here, before anything
is queued) and appends a frozen command; verbs return the queue, so they chain.
Any int argument may be a :class:`~hcqa.variables.Variable` or an expression.

A built queue is a program: ``submit(var_vals)`` resolves the symbolic ints
against ``var_vals`` (range-checked), adds waits for buffer hazards on other
queues, and sends the whole batch as *one* message to the queue's actor. It
can be submitted again and again with new values.

Submitted again, a queue is sent the way a graph replay is: where the device fuses
launches (the fusion seam, ``devices/fusion.py``), each run of them goes as one fused
command (``_graph.build.fuse_batch``: on a cpu device, C kernels as one native call over
an argument table), and new values are bound into a fresh copy of it instead of building
a command per kernel (see :meth:`Queue._resolve`).

Two ways to submit, by what should happen when the queue's channel is full:

* ``q.submit()`` is synchronous and never blocks the event loop: it raises
  :class:`~hcqa.errors.QueueFull` (nothing queued) when the channel is full;
* ``await q.submit_async()`` waits for room in the channel (backpressure), then
  submits.

Both return the :class:`~hcqa.signals.Fence` of the batch on the device timeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from hcqa import aio
from hcqa import commands as cmd
from hcqa._graph.build import fuse_batch
from hcqa._graph.patch import CommandSlot, _check_copy_size
from hcqa._signals.parking import _check_target
from hcqa.actors import engine as _engine
from hcqa.devices.base import Device
from hcqa.devices.buffer import Buffer
from hcqa.devices.capture import current_capture
from hcqa.errors import InvalidCommand, QueueFull
from hcqa.signals import Fence, Signal
from hcqa.variables import Expr, IntLike, Variable, VarVals, resolve, variables_of

if TYPE_CHECKING:
    from typing import Self

    from hcqa.devices.program import Program

__all__ = ["Queue"]

_SYMBOLIC = (Variable, Expr)


def _intlike(name: str, value: object) -> IntLike:
    if isinstance(value, _SYMBOLIC):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidCommand(f"{name!r} must be an int or a Variable (got {type(value).__name__})")
    return value


class Queue:
    """A batch of commands for one queue of one device."""

    def __init__(self, device: Device, kind: str) -> None:
        self.device = device
        self.kind = kind
        self._actor = device._queues[kind]
        self._commands: list[Any] = []
        # buffers touched, one entry per allocation (views share their base's hazards)
        self._reads: dict[int, Buffer] = {}
        self._writes: dict[int, Buffer] = {}
        self._symbolic_at: list[int] = []  # positions of commands with variables
        self._slots: list[CommandSlot] = []  # one per such position: rebuilt on change only
        self._symbols: dict[Any, None] = {}  # the distinct expressions they mention
        # (values, (whether fused, whether patched in place), the commands sent for them)
        self._last: tuple[dict[Any, int], tuple[bool, bool], list[Any]] | None = None
        # the fused form (see _resolve): None until it is first needed; False when
        # nothing fuses
        self._fused: tuple[list[Any], list[tuple[int, Any]]] | Literal[False] | None = None
        self._sent = False  # submitted since the last verb (a constant queue fuses then)
        self._signals: dict[Signal, None] = {}  # signals the commands use, checked at submit
        # the variables the commands use, and their names (made at the first var_vals)
        self._known: tuple[set[Variable], set[str]] | None = None
        self._waits = False

    # -- verbs ---------------------------------------------------------------------------

    def _add(self, command: Any, symbolic: bool = False) -> Self:
        self.device._check_usable()
        if symbolic:
            self._symbolic_at.append(len(self._commands))
            slot = CommandSlot(command, in_place=True)  # (the batch then gets a Bind)
            self._slots.append(slot)
            self._symbols.update(dict.fromkeys(slot.symbols))
        self._last = self._fused = None
        self._known = None
        self._sent = False
        self._commands.append(command)
        return self

    def wait(self, signal: Signal, value: IntLike) -> Self:
        """Hold the queue until ``signal.value >= value``."""
        self._signal_arg(signal, "wait")
        value = _intlike("value", value)
        if isinstance(value, int):
            _check_target(value)
        self._waits = True
        return self._add(cmd.Wait(signal=signal, value=value), isinstance(value, _SYMBOLIC))

    def signal(self, signal: Signal, value: IntLike) -> Self:
        """Set ``signal`` to ``value`` when everything before is done."""
        self._signal_arg(signal, "signal")
        value = _intlike("value", value)
        if isinstance(value, int):
            _check_target(value)
        return self._add(cmd.Signal(signal=signal, value=value), isinstance(value, _SYMBOLIC))

    def timestamp(self, signal: Signal) -> Self:
        """Write the time into ``signal``'s timestamp slot when everything before is done."""
        self._signal_arg(signal, "timestamp")
        return self._add(cmd.Timestamp(signal=signal))

    def memory_barrier(self) -> Self:
        """Make earlier writes visible to later commands (a no-op on host memory)."""
        return self._add(cmd.MemoryBarrier())

    def exec(
        self,
        prog: Program,
        bufs: tuple[Buffer, ...] | list[Buffer],
        global_size: Any = (1, 1, 1),
        local_size: Any = (1, 1, 1),
        vals: tuple[IntLike, ...] | list[IntLike] = (),
    ) -> Self:
        """Run ``prog`` over ``bufs`` (compute queues)."""
        from hcqa.devices.program import Program

        if self.kind != "compute":
            raise InvalidCommand(f"exec() needs a compute queue (got a {self.kind} queue)")
        if not isinstance(prog, Program):
            raise InvalidCommand(f"exec() needs a hcqa Program (got {type(prog).__name__})")
        if prog.device is not self.device:
            raise InvalidCommand(
                f"exec(): program {prog.name!r} must be on {self.device.name} "
                f"(got one on {prog.device.name})"
            )
        if not isinstance(bufs, (tuple, list)):
            raise InvalidCommand(
                f"exec() 'bufs' must be a tuple of buffers (got {type(bufs).__name__})"
            )
        exec_ = prog.validate(bufs, vals, global_size, local_size)
        writes, reads = prog.access(len(exec_.buffers))
        for i in writes:
            self._touch(self._writes, bufs[i])
        for i in reads:
            self._touch(self._reads, bufs[i])
        symbolic = any(isinstance(v, _SYMBOLIC) for v in (*exec_.vals, *exec_.global_size))
        symbolic = symbolic or any(isinstance(v, _SYMBOLIC) for v in exec_.local_size)
        return self._add(exec_, symbolic)

    def copy(self, dest: Buffer, src: Buffer, nbytes: IntLike) -> Self:
        """Copy ``nbytes`` from ``src`` to ``dest`` on this device (copy queues)."""
        if self.kind != "copy":
            raise InvalidCommand(f"copy() needs a copy queue (got a {self.kind} queue)")
        for name, b in (("dest", dest), ("src", src)):
            if not isinstance(b, Buffer):
                raise InvalidCommand(
                    f"copy() {name!r} must be a hcqa.Buffer (got {type(b).__name__})"
                )
            if b.device is not self.device:
                raise InvalidCommand(
                    f"copy() {name!r} must be on {self.device.name} (got a buffer on "
                    f"{b.device.name}; use hcqa.transfer across devices)"
                )
            b._check()
        nbytes = _intlike("nbytes", nbytes)
        if isinstance(nbytes, int):
            _check_copy_size(nbytes, dest, src)
        self._touch(self._writes, dest)
        self._touch(self._reads, src)
        command = cmd.Copy(dest=dest, src=src, nbytes=nbytes)
        return self._add(command, isinstance(nbytes, _SYMBOLIC))

    def _signal_arg(self, signal: object, verb: str) -> None:
        if not isinstance(signal, Signal):
            raise InvalidCommand(f"'signal' must be a hcqa.Signal (got {type(signal).__name__})")
        signal._check_queueable(verb)
        self._signals[signal] = None

    @staticmethod
    def _touch(seen: dict[int, Buffer], b: Buffer) -> None:
        seen.setdefault(id(b._hazards), b)

    # -- submitting ----------------------------------------------------------------------

    @property
    def variables(self) -> set[Variable]:
        """Every variable the queue's commands mention."""
        out: set[Variable] = set()
        for c in self._commands:
            for value in attrs.astuple(c, recurse=False):
                if isinstance(value, _SYMBOLIC):
                    out |= variables_of(value)
                elif isinstance(value, tuple):
                    for v in value:
                        if isinstance(v, _SYMBOLIC):
                            out |= variables_of(v)
        return out

    def _check_buffers(self) -> None:
        """A built queue may outlive its buffers and signals: refuse freed (or closed)
        buffers and closed signals."""
        for s in self._signals:
            if s._closed:
                s._check_queueable("submit")
        for b in self._writes.values():
            b._check()
        for b in self._reads.values():
            b._check()

    def _resolve(self, var_vals: VarVals | None) -> list[Any]:
        """The commands to send: variables bound -- or kept, inside a capture with no
        ``var_vals``, for the graph to bind at replay.

        A queue is sent in its *fused* form where its device fuses launches (as a graph
        replay is): each run of them becomes one fused command (``Device._fuse``; on a cpu
        device one native call over an argument table), and new values are bound into a
        fresh copy of it (``FusedRun.bound``: one numpy assignment per variable), instead
        of a new command per kernel. A queue with variables is
        fused from its first submit; one without from its second: once sent, each of its
        commands keeps its native record, so a queue sent once is cheapest as built, and
        one sent again cheapest fused. Not while a tracer records (it shows every kernel)
        or a graph captures (the graph fuses by itself)."""
        self._check_buffers()
        capture = current_capture()
        if var_vals is None and capture is not None:
            return list(self._commands)
        if var_vals:
            self._check_names(var_vals)
        fuse = capture is None and _engine.trace_hook is None
        if not self._slots:  # constants: fused from the second submit (see above)
            if fuse:
                plan = self._fused_form() if self._sent else None
                self._sent = True
                if plan:
                    return list(plan[0])
            return list(self._commands)
        values = {s: resolve(s, var_vals) for s in self._symbols}  # each resolved once
        mode = (fuse, capture is None)  # (patched in place only outside a capture)
        last = self._last
        if last is not None and last[1] == mode and last[0] == values:  # nothing changed
            return list(last[2])
        plan = self._fused_form() if fuse else None
        if plan:
            template, slots = plan
            commands = list(template)
            for i, slot in slots:
                commands[i] = slot.build(values, var_vals, None)
        else:
            commands = list(self._commands)
            bind = False
            in_place = capture is None  # (a graph captures resolved commands)
            for i, slot in zip(self._symbolic_at, self._slots, strict=True):
                commands[i] = slot.build(values, var_vals, None, in_place)  # reused if unchanged
                bind = bind or (in_place and slot.patch is not None)
            if bind:  # commands patched in place resolve their variables from this
                commands.insert(0, cmd.Bind(values=values))
        self._last = (values, mode, list(commands))
        return commands

    def _check_names(self, var_vals: VarVals) -> None:
        """Refuse a value for a variable the queue does not use (a typo would otherwise
        leave the real one unbound, or silently run with what it was), as a replay does."""
        known = self._known
        if known is None:
            found = set().union(*map(variables_of, self._symbols)) if self._symbols else set()
            known = self._known = (found, {v.name for v in found})
        variables, names = known
        if type(var_vals) is not dict and not isinstance(var_vals, Mapping):
            raise InvalidCommand(
                f"'var_vals' must be a dict {{Variable or name: int}} "
                f"(got {type(var_vals).__name__})"
            )
        for key in var_vals:
            if key in variables or (type(key) is str and key in names):
                continue
            what = key.name if isinstance(key, Variable) else key
            if isinstance(key, Variable) and key.name in names:
                raise InvalidCommand(
                    f"submit got a Variable {what!r} that is not the one this queue uses "
                    f"(another Variable of that name)"
                )
            raise InvalidCommand(
                f"submit got unknown variables [{what!r}] (the queue has {sorted(names)})"
            )

    def _fused_form(self) -> tuple[list[Any], list[tuple[int, Any]]] | None:
        """The fused form (template, slots), made at its first use after the last verb;
        None when nothing fuses."""
        if self._fused is None:
            self._fused = fuse_batch(self._commands, set(self._symbolic_at)) or False
        return self._fused or None

    def _send(self, commands: list[Any]) -> Fence:
        return self.device._submit(
            self._actor,
            commands,
            reads=self._reads.values(),
            writes=self._writes.values(),
            waits=self._waits,
        )

    def submit(self, var_vals: VarVals | None = None) -> Fence:
        """Send the batch now (never blocks; QueueFull when the channel is full)."""
        return self._send(self._resolve(var_vals))

    async def submit_async(self, var_vals: VarVals | None = None) -> Fence:
        """Wait for room in the queue's channel, then submit (backpressure).

        Cancelled, it queued nothing: a cancellation is taken only before the batch is
        sent (at the start, or while waiting for room); once sent, the fence is returned."""
        commands = self._resolve(var_vals)
        if aio.asyncio_caller():
            # The send runs here, on the asyncio task, after its last await: an asyncio
            # cancellation can only land in the wait for room, before anything is sent.
            while True:
                try:
                    return self._send(commands)
                except QueueFull:
                    await aio.call(self._actor.wait_for_space)
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                fence = self._send(commands)
            except QueueFull:
                await self._actor.wait_for_space()
                continue
            await trio.lowlevel.cancel_shielded_checkpoint()  # sent: no cancellation now
            return fence

    def __len__(self) -> int:
        return len(self._commands)

    def __repr__(self) -> str:
        return f"<Queue {self.device.name} {self.kind}: {len(self._commands)} commands>"


Device._queue_class = Queue  # Device.compute_queue() / copy_queue() build these
