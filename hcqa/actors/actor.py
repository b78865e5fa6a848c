"""Queue actors: one trio task per device queue.

Theory of operation
-------------------
A :class:`QueueActor` is started with ``nursery.start(actor.run)``. It reads
:class:`Batch` messages from a bounded memory channel, dispatching on the
message type through a table, and ends on ``EndOfChannel`` (the device closed
its send side: drain) or on cancellation (the device was left by an exception:
abandon pending work).

For each batch it walks the commands in order. A ``Wait`` whose signal has
not reached its value is *awaited here*, on the event loop: the task parks on
the signal's eventfd and costs nothing until the producer writes. Every other
command is collected into a run and handed to the queue's
:class:`~hcqa.actors.engine.Engine` thread in one ``put``. Runs keep queue
order because the engine is FIFO and a run after a Wait is only handed over
once the Wait is satisfied.

A Wait that ends in an error -- the awaited signal was broken by another
device's fault, or its hang limit passed with no progress -- faults this
device with that very error instance, so faults travel across devices instead
of becoming hangs. One exception: another device's work *abandoned* when its block
was left is no fault of this device. A batch that waited for its writes fails alone
(``_fail``: its work is skipped, its fence raises a ``DeviceClosed`` naming it, and
batches of other queues waiting for exactly it fail the same way); one that waited
only for its reads goes on.

Two shortcuts skip the actor (counted in ``direct``): a batch without Waits sent
to an idle actor goes straight to the engine; and a short copy (see
``Device._inline``) on an idle queue with no hazard to wait for runs inline, on
the caller's thread, through the engine's own table and fault handling -- a
1 MiB copy costs less than the two thread wake-ups it would otherwise take.

A backend whose driver orders work itself (``driver_waits``, OpenCL) is asked first, for each
Wait not yet reached (``_driver_wait``): what it returns replaces the Wait in the run and the
driver holds what follows; only a None is awaited here. A batch whose Waits the driver keeps
all also goes straight to the executor from an idle actor.

The actor also keeps the queue's own progress signal (``actor.signal``), which
the batch's trailing ``Signal`` command advances: other queues wait on it for
cross-queue dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Protocol

import attrs
import trio

from hcqa import commands as cmd
from hcqa.actors import engine as _engine
from hcqa.actors.executor import Executor
from hcqa.errors import DeviceClosed, HcqaError
from hcqa.signals import Signal

__all__ = ["Batch", "QueueActor", "QueueOwner", "QueueStatistics"]


_WORK = (cmd.Exec, cmd.Copy, cmd.Load)  # what a failed batch does not run (see _fail)


def _is_work(c: Any) -> bool:
    """Whether ``c`` is work a failed batch does not run: a launch, a copy, a load, or a
    backend's fused run of launches (``cmd.Fused``)."""
    return type(c) in _WORK or isinstance(c, cmd.Fused)


# Allocations (their hazard records, ``Buffer._hazards``) whose contents a failed batch was
# to write: a later batch that reads one fails the same way (``Device._submit`` checks at
# submit, the actor the batches already queued behind the failed one); a write clears it.
LOST: dict[Any, BaseException] = {}


def _uses(c: Any) -> tuple[list[Any], list[Any]]:
    """The allocations (hazard records) a work command reads and writes."""
    kind = type(c)
    if kind is cmd.Exec:
        writes, reads = c.program.access(len(c.buffers))
        bufs = c.buffers
        return [bufs[i]._hazards for i in reads], [bufs[i]._hazards for i in writes]
    if kind is cmd.Copy:
        src, dest = getattr(c.src, "_hazards", None), getattr(c.dest, "_hazards", None)
        return ([src] if src is not None else []), ([dest] if dest is not None else [])
    if kind is cmd.Load:
        return [], [c.dest._hazards]
    if isinstance(c, cmd.Fused):
        reads, writes = c.access()
        return [b._hazards for b in reads], [b._hazards for b in writes]
    return [], []


def _describe(c: Any) -> str:
    if type(c) is cmd.Exec:
        return f"kernel {c.program.name!r}"
    if isinstance(c, cmd.Fused):
        return "kernels " + ", ".join(repr(n) for n in c.names)
    return "a copy" if type(c) is cmd.Copy else f"a load of {c.path!r}"


class QueueOwner(Protocol):
    """What a queue actor needs of its device (a :class:`~hcqa.devices.Device`): the
    actors sit below the devices and name them only through this."""

    name: str
    hang_limit: float
    driver_waits: ClassVar[bool]
    _error: BaseException | None

    def _fault(self, exc: BaseException) -> None: ...

    def _driver_wait(self, actor: QueueActor, signal: Signal, value: int) -> Any: ...

    def _cancel(self) -> None: ...

    def _hung_at_close(self, actor: QueueActor) -> None: ...


@attrs.frozen
class Batch:
    """One submitted batch: resolved commands, in queue order."""

    commands: list[Any]


@attrs.frozen(kw_only=True)
class QueueStatistics:
    """What :meth:`QueueActor.statistics` reports."""

    name: str
    kind: str
    submitted: int
    completed: int
    pending_batches: int
    capacity: int
    waiting: bool
    direct: int  # batches that skipped the actor: handed straight to the engine, or run inline


class QueueActor:
    """The trio task behind one device queue (``kind`` is ``"compute"`` or ``"copy"``)."""

    def __init__(self, device: QueueOwner, kind: str, engine: Executor, *, capacity: int) -> None:
        self.device = device
        self.kind = kind
        self.name = f"{device.name} {kind}"
        self.engine = engine
        self.capacity = capacity
        self._send, self._recv = trio.open_memory_channel[Batch](capacity)
        self.signal = Signal(name=f"{self.name} queue")
        self.signal._guarded = False  # closed by the device only once its writers are joined
        self.value = 0  # the last value of ``signal`` handed out
        self.sent = 0
        self.received = 0
        self._space = trio.lowlevel.ParkingLot()
        self._waiting = False
        self._busy = False
        self._closed = False
        self._leftover: list[Any] = []  # commands cut off by cancellation
        self.failed = 0  # batches failed alone (see _fail)
        self._suspect = 0  # batches in the channel when one failed (see _reads_lost)
        self.direct = 0  # batches that went straight to the engine (or ran inline)
        # Waits the driver may keep (see the module doc): asked before awaiting on the host
        self._hold = device._driver_wait if device.driver_waits else None
        self._table: dict[type, Callable[[Any], Awaitable[None]]] = {Batch: self._batch}

    # -- the submitting side (caller's task) ---------------------------------------------

    @property
    def full(self) -> bool:
        return self.room <= 0

    @property
    def room(self) -> int:
        """How many more batches the channel takes now."""
        return self.capacity - (self.sent - self.received)

    def idle(self) -> bool:
        """Nothing in the channel, no batch being walked, and every batch handed out so far
        has reached its queue signal: the engine has nothing of this queue's before a new
        batch (at most the timeline steps behind the last signal, which complete in any
        order). A batch run inline now keeps queue order."""
        return (
            self.sent == self.received
            and not self._busy
            and not self._closed
            and self.signal.value == self.value
        )

    def run_inline(self, commands: list[Any]) -> None:
        """Execute a batch without Waits now, on the caller's thread (the queue must be
        ``idle()`` before the batch took its value). Short copies only: the event loop
        is blocked while it runs."""
        self.sent += 1
        self.received += 1
        self.direct += 1
        self.engine.run_inline(commands)

    def send_nowait(self, batch: Batch, waits: bool | None = None) -> None:
        """Queue ``batch`` (the channel must have room: check ``full`` first).

        A batch without Waits sent to an idle actor -- nothing in its channel,
        not inside a batch -- goes straight to the engine: all the actor would do
        is forward it, and the engine's FIFO keeps the order just the same. ``waits``
        says whether the batch holds a Wait, when the caller knows (else it is scanned)."""
        self.send_commands(batch.commands, waits, batch)

    def send_commands(
        self, commands: list[Any], waits: bool | None = None, batch: Batch | None = None
    ) -> None:
        """:meth:`send_nowait` for a list of commands: the :class:`Batch` message is only
        made when the batch goes through the channel (not when it skips the actor)."""
        if _engine.trace_hook is not None:  # tracing: served work's flows into its kernels
            _engine.trace_hook.sent(self.engine, commands)
        if self.sent == self.received and not self._busy and not self._closed:
            if waits is None:
                waits = any(type(c) is cmd.Wait for c in commands)
            if not waits:
                self.engine.put(commands)
                self.sent += 1
                self.received += 1
                self.direct += 1
                return
            if self._hold is not None:
                run = self._held(commands)
                if run is not None:  # every Wait kept by the driver (or already reached)
                    self.engine.put(run)
                    self.sent += 1
                    self.received += 1
                    self.direct += 1
                    return
        self._send.send_nowait(batch if batch is not None else Batch(commands))
        self.sent += 1

    def _held(self, commands: list[Any]) -> list[Any] | None:
        """``commands`` with each Wait replaced by what the driver keeps it with (dropped
        when already reached); None when one must be awaited on the host."""
        hold = self._hold
        if hold is None or self.device._error is not None:
            return None
        run: list[Any] = []
        for c in commands:
            if type(c) is cmd.Wait:
                sig: Signal = c.signal
                target: int = c.value  # type: ignore[assignment]  # resolved at submit
                if sig._failed and target in sig._failed:
                    return None  # the actor fails this batch (see _batch)
                if sig.value >= target:
                    continue
                gate = hold(self, sig, target)
                if gate is None:
                    return None
                c = gate
            run.append(c)
        return run

    async def wait_for_space(self) -> None:
        """Park until the channel may have room (a batch was received). Raises
        :class:`DeviceClosed` once the queue's input is closed -- the device block was
        left, normally or by an exception -- so no task waits for room that never comes."""
        if not self._closed:
            await self._space.park()
        else:
            await trio.lowlevel.checkpoint()
        if self._closed:
            raise DeviceClosed(f"{self.device.name} was closed while waiting for queue room")

    async def close_input(self) -> None:
        """No more batches: the actor drains what it has and ends. Tasks waiting for
        room are woken (with DeviceClosed)."""
        self._closed = True
        self._space.unpark_all()
        await self._send.aclose()

    # -- the actor -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.engine.start()
        task_status.started()
        try:
            async with self._recv:
                try:
                    await self._loop()
                finally:
                    while True:  # batches never received (only when cancelled)
                        try:
                            self._leftover.extend(self._recv.receive_nowait().commands)
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
        except trio.Cancelled:
            self.device._cancel()  # left by an exception or cancelled: abandon pending work
            raise
        finally:
            # Abandoned work -- the rest of a batch cut off at a Wait, batches still in
            # the channel -- goes to the engine too: with the device's error set, the
            # engine skips it, breaking its signals and completing other devices' steps,
            # so nobody waits for work that will never run.
            if self._leftover:
                self.engine.put(self._leftover)
            await self._stop_engine()

    async def _loop(self) -> None:
        while True:
            try:
                message = await self._recv.receive()
            except trio.EndOfChannel:
                break
            self.received += 1
            if self._space:
                self._space.unpark_all()
            handler = self._table.get(type(message))
            if handler is None:
                raise TypeError(
                    f"queue {self.name!r} got an unknown message "
                    f"{type(message).__name__} (expected Batch)"
                )
            self._busy = True
            try:
                await handler(message)
            finally:
                self._busy = False

    async def _batch(self, batch: Batch) -> None:
        run: list[Any] = []
        commands = batch.commands
        if self._suspect:  # queued before a batch of this queue failed: reads what it lost?
            self._suspect -= 1
            if LOST and self._reads_lost(commands, run):
                return
        for i, command in enumerate(commands):
            if type(command) is not cmd.Wait:
                run.append(command)
                continue
            sig: Signal = command.signal
            target: int = command.value  # type: ignore[assignment]  # resolved at submit
            if self.device._error is not None:
                continue
            if sig.value >= target:
                if sig._failed and command.after_write and target in sig._failed:
                    self._fail(commands[i + 1 :], run, sig, sig._failed[target])
                    return
                continue
            if self._hold is not None:  # the driver may keep it: no await
                gate = self._hold(self, sig, target)
                if gate is not None:  # (the producer's batch is enqueued: its fate decided)
                    if sig._failed and command.after_write and target in sig._failed:
                        self._fail(commands[i + 1 :], run, sig, sig._failed[target])
                        return
                    run.append(gate)
                    continue
            if run:
                self.engine.put(run)
                run = []
            self._waiting = True
            try:
                await sig._wait_limited(
                    target, self.device.hang_limit, f"{self.name} queue", observe=False
                )
            except HcqaError as exc:
                # Another device's work abandoned when its block was left. A wait only for
                # its *reads* (before we overwrite what they read): they will never read,
                # nothing to wait for. A wait for its *writes*: this batch can't run
                # correctly, and fails alone -- not a fault of this device.
                if not getattr(exc, "abandoned", False) or self.engine.error is not None:
                    self.device._fault(exc)
                elif command.after_write:
                    self._fail(commands[i + 1 :], run, sig, exc)
                    return
            except trio.Cancelled:
                self._leftover = commands[i + 1 :]
                raise
            finally:
                self._waiting = False
            if sig._failed and command.after_write and target in sig._failed:
                self._fail(commands[i + 1 :], run, sig, sig._failed[target])
                return
            if _engine.trace_hook is not None:  # tracing: a flow arrow into `run`'s first range
                _engine.trace_hook.waited(self.engine, sig, target, run)
        if run:
            self.engine.put(run)

    def _fail(
        self, rest: list[Any], run: list[Any], sig: Signal | None, cause: BaseException
    ) -> None:
        """This batch needed what another queue's abandoned (or itself failed) work was to
        write: its work (``rest``'s kernels, fused runs, copies, loads) is not run and its
        later Waits are dropped; its bookkeeping still runs, so the queue and the timeline go
        on. The values it sets are marked failed with a :class:`DeviceClosed` naming the work and
        ``sig``: its fence raises it, and so does a batch of another queue that waited for
        exactly this one (the failure travels along the dependency, not to the device)."""
        work = [c for c in rest if _is_work(c)]
        what = ", ".join(_describe(c) for c in work[:3]) or "a batch"
        if len(work) > 3:
            what += f" and {len(work) - 3} more"
        source = f"work that {sig.name} did not finish" if sig is not None else "failed work"
        error = DeviceClosed(
            f"{self.name} queue: {what} not run: it needed the writes of {source} ({cause})"
        )
        error.__cause__ = cause
        for c in work:
            for hz in _uses(c)[1]:
                if len(LOST) >= 4096:
                    del LOST[next(iter(LOST))]
                LOST[hz] = error
        self._suspect = self.sent - self.received  # queued behind it: checked (_batch)
        for c in rest:
            kind = type(c)
            if kind is cmd.Wait or _is_work(c):
                continue
            if kind is cmd.Signal:
                c.signal._fail_value(c.value, error)
            elif kind is cmd.Step and getattr(c.timeline, "_owner", None) is self.device:
                c.timeline.fail(c.seq, error)
            run.append(c)
        self.failed += 1
        if run:
            self.engine.put(run)

    def _reads_lost(self, commands: list[Any], run: list[Any]) -> bool:
        """Fail this batch (True) when its work reads what a failed batch was to write;
        its writes clear what they overwrite."""
        for c in commands:
            if _is_work(c):
                reads, writes = _uses(c)
                for hz in reads:
                    cause = LOST.get(hz)
                    if cause is not None:
                        self._fail(commands, run, None, cause)
                        return True
                for hz in writes:
                    LOST.pop(hz, None)
        return False

    async def _stop_engine(self) -> None:
        """Let the engine finish (drain) or skip (cancelled) its work, then join it.

        A drain is cut short by a cancellation that arrives meanwhile (a deadline that
        passes while the block closes): what has not started is skipped, as when the
        block was left by the cancellation; the wait goes on shielded, for the kernel
        that is running (the thread must end before the device's memory goes). Waits
        while the queue makes progress; a queue with no progress for the hang limit is
        declared hung and its thread is left behind (a daemon)."""
        self.engine.stop()
        limit = self.device.hang_limit
        period = limit if not math.isinf(limit) else 3600.0
        seen = self.signal.value
        cancelled: trio.Cancelled | None = None
        while True:
            try:
                with trio.CancelScope(shield=cancelled is not None), trio.move_on_after(period):
                    await self.engine.exited.wait(1)
                    self.engine.join()
                    break
            except trio.Cancelled as exc:  # the drain is cut short: skip what is left
                self.device._cancel()
                cancelled = exc
                continue
            if self.signal.value == seen:
                self.device._hung_at_close(self)
                break
            seen = self.signal.value
        if cancelled is not None:
            raise cancelled

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(
            name=self.name,
            kind=self.kind,
            submitted=self.value,
            completed=self.signal.value,
            pending_batches=self.sent - self.received,
            capacity=self.capacity,
            waiting=self._waiting,
            direct=self.direct,
        )
