"""Pipelines across worker processes: shared-memory signals and buffers, no spinning.

Theory of operation
-------------------
:func:`open_process_pipeline` starts one worker process per stage (``python -m
hcqa._worker``), each owning its own ``cpu:0`` device, and connects to each with a
Unix socketpair. Everything the stages share is created by the coordinator and
*handed over as fds* (``hcqa.ipc``): the slots (each stage's input and output
buffers, memfds, so the output of stage ``i`` is the very memory stage ``i + 1``
reads), a *slot table* saying which slot item ``k`` uses, and the signals that order
them:

* ``fed``: items whose input is in place (and whose slot is in the table);
* ``done{i}``: items stage ``i`` has finished.

Worker ``i`` does not run a queue actor: its stage runs in its engine thread, which
sleeps in ``wait_sync`` until its input signal reaches ``k``, runs ``fn(out, inp)`` on
the item's slot and sets ``done{i} = k`` -- one wake-up per item (an actor would add a
trio hop and a thread hop), and nothing but signal writes crosses processes per item.
Every process sleeps on its own eventfd of a signal; at set-up the coordinator collects
them and gives each participant the others' as peers, so a value written anywhere
wakes everyone. An idle pipeline costs no CPU in any process.

Slots come from a LIFO pool of ``depth`` (the bound on items in flight), so items one
after another reuse the slot still in the caches. A slot goes back as soon as its item
is released: every stage handles items in order, so the next item in that slot is
written only after this one was read.

Getting an item in and out (``await pipe(x)``) is the one place the coordinator's
loop copies: small items in one memcpy, items up to 8 MiB in 1 MiB steps with a
checkpoint between (a hop to the copy engine's thread and back costs more than such a
copy), larger ones through the copy engine. Outputs over 64 KiB are not copied out
while a *loan* slot is free: the last stage writes the item straight into a loan slot
(the slot table names it) and the caller gets an array over it, whose slot comes back
when that array and every view of it are collected.

A worker that dies closes its socket and exits (trio waits on its pidfd): the
coordinator's watchers break the pipeline's signals with a
:class:`~hcqa.errors.DeviceFault`, so callers fail fast instead of hanging; a stage that
raises sends its error back over the socket, with the same effect. Closing sends
``stop``, waits for each worker to exit (killing it after a grace period) and closes
every fd; memfds vanish with their last fd. ``pipe.item()`` gives zero-copy access:
fill the input slot in place, read the output as a view until the block ends.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from hcqa import _items, aio
from hcqa.devices.base import Device
from hcqa.devices.buffer import Buffer
from hcqa.devices.opening import open_device
from hcqa.errors import DeviceClosed, DeviceFault, InvalidCommand
from hcqa.ipc import (
    PeerGone,
    WorkerProcess,
    offer_signal,
    recv_message,
    send_message,
    spawn_worker,
    stop_workers,
)
from hcqa.pipeline import check_input
from hcqa.signals import Signal

__all__ = [
    "PipelineItem",
    "ProcessPipeline",
    "ProcessPipelineStatistics",
    "ProcessStage",
    "open_process_pipeline",
]


@attrs.frozen(kw_only=True)
class ProcessPipelineStatistics:
    """What :meth:`ProcessPipeline.statistics` reports."""

    stages: int
    depth: int
    in_flight: int  # slots taken by callers now
    completed: int
    loans: int  # spare output slots for lent results
    lent: int  # of those, held by results now
    loaned: int  # results lent so far
    workers: tuple[int, ...]  # their pids
    faulted: bool


@attrs.frozen(kw_only=True)
class ProcessStage:
    """A stage run in its own process: ``fn(out, inp)`` named as ``"module:function"``.

    With ``args`` (JSON-serializable), ``fn`` names a *factory* instead: the worker
    calls ``factory(**args)`` once and runs the callable it returns -- the place to
    load a stage's weights in the worker."""

    fn: str
    out_shape: tuple[int, ...] | None = None
    out_dtype: str | None = None
    args: dict[str, Any] | None = None


class ProcessPipeline:
    """Microbatches through stages in worker processes: ``await pipe(x)``."""

    def __init__(
        self,
        device: Device,
        stages: Sequence[ProcessStage],
        *,
        in_shape: tuple[int, ...],
        dtype: npt.DTypeLike,
        depth: int,
    ) -> None:
        self.device = device
        self.stages = tuple(stages)
        self.depth = depth
        self.in_shape = tuple(in_shape)
        self.dtype = np.dtype(dtype)
        self.shapes: list[tuple[tuple[int, ...], np.dtype[Any]]] = [(self.in_shape, self.dtype)]
        for s in self.stages:
            shape, dt = self.shapes[-1]
            self.shapes.append(
                (tuple(s.out_shape) if s.out_shape else shape, np.dtype(s.out_dtype or dt))
            )
        out_shape, out_dtype = self.shapes[-1]
        out_nbytes = math.prod(out_shape) * out_dtype.itemsize
        self.loans = 0  # spare output slots for lent results: up to depth, within budget
        if out_nbytes > _items.INLINE_COPY:
            self.loans = min(depth, max(1, _items.LOAN_BUDGET // out_nbytes))
        # buffers[j][slot]: the input of stage j (j = len(stages): the final output,
        # whose row also holds the loan slots, depth ... depth + loans - 1)
        rows = [depth] * (len(self.shapes) - 1) + [depth + self.loans]
        self.buffers: list[list[Buffer]] = [
            [device.alloc(shape=shape, dtype=dt, shared=True) for _ in range(n)]
            for (shape, dt), n in zip(self.shapes, rows, strict=True)
        ]
        # slot_table[k % depth] = (slot, output slot) of item k, written before ``fed``
        # reaches k; the output slot is the slot itself or a loan (last stage only)
        self.slot_table = device.alloc(shape=(depth, 2), dtype="int64", shared=True)
        self._table = self.slot_table._kernel_array()
        self._free_slots = list(range(depth))  # LIFO: the warmest slot goes next
        self._free_loans = list(range(depth, depth + self.loans))
        self.loaned = 0  # outputs handed out without a copy
        self.signals: dict[str, Signal] = {"fed": Signal(name="fed")}
        for i in range(len(self.stages)):
            self.signals[f"done{i}"] = Signal(name=f"done{i}")
        self._fed_signal = self.signals["fed"]
        self._last = self.signals[f"done{len(self.stages) - 1}"]
        # the slots as arrays: the first stage's inputs, the last stage's outputs
        self._inputs = [b._kernel_array() for b in self.buffers[0]]
        self._outputs = [b._kernel_array() for b in self.buffers[-1][:depth]]
        self.workers: list[WorkerProcess] = []
        self._next = 0
        self._fed: set[int] = set()  # items whose input is ready, not yet in the prefix
        self._limit = trio.Semaphore(depth)
        self.fault: DeviceFault | None = None
        self.completed = 0

    def statistics(self) -> ProcessPipelineStatistics:
        """A frozen snapshot: slots in use, items completed, loans held, worker pids."""
        return ProcessPipelineStatistics(
            stages=len(self.stages),
            depth=self.depth,
            in_flight=self.depth - len(self._free_slots),
            completed=self.completed,
            loans=self.loans,
            lent=self.loans - len(self._free_loans),
            loaned=self.loaned,
            workers=tuple(w.pid for w in self.workers),
            faulted=self.fault is not None,
        )

    def __repr__(self) -> str:
        names = " -> ".join(s.fn for s in self.stages)
        return f"<ProcessPipeline {names} depth={self.depth}>"

    def _stage_signals(self, i: int) -> list[str]:
        return ["fed" if i == 0 else f"done{i - 1}", f"done{i}"]

    async def _connect(self, worker: WorkerProcess) -> list[int]:
        """Phase 1: hand the worker its buffers and signals; returns its eventfds."""
        i = worker.index
        fds: list[int] = []
        bufs = []
        for b in (*self.buffers[i], *self.buffers[i + 1], self.slot_table):
            fd, meta = b.export()
            fds.append(fd)
            bufs.append(meta)
        sigs = []
        for name in self._stage_signals(i):
            meta, sfds = offer_signal(self.signals[name])
            sigs.append(meta)
            fds.extend(sfds)
        header = {
            "op": "setup",
            "stage": self.stages[i].fn,
            "args": self.stages[i].args,
            "inputs": len(self.buffers[i]),
            "outputs": len(self.buffers[i + 1]),
            "column": 1 if i == len(self.stages) - 1 else 0,  # of the slot table
            "buffers": bufs,
            "signals": sigs,
        }
        await send_message(worker.sock, header, fds)
        reply, eventfds = await recv_message(worker.sock)
        if reply.get("op") != "ready" or len(eventfds) != 2:
            for fd in eventfds:
                os.close(fd)
            raise DeviceFault(f"worker {i} failed to set up: {reply.get('error', reply)}")
        return eventfds

    async def _mesh(self, eventfds: list[list[int]]) -> None:
        """Phase 2: every participant of a signal gets the others' eventfds as peers."""
        holders: dict[str, list[tuple[int, int]]] = {}
        for w, fds in zip(self.workers, eventfds, strict=True):
            for name, fd in zip(self._stage_signals(w.index), fds, strict=True):
                holders.setdefault(name, []).append((w.index, fd))
        for name, held in holders.items():
            for _, fd in held:
                self.signals[name].add_peer(fd)  # the coordinator wakes every worker copy
        for w in self.workers:
            send: list[int] = []
            names: list[str] = []
            for name in self._stage_signals(w.index):
                for j, fd in holders[name]:
                    if j != w.index:
                        send.append(fd)
                        names.append(name)
            await send_message(w.sock, {"op": "peers", "names": names}, send)

    async def _watch(self, worker: WorkerProcess) -> None:
        """Turn a worker's death (its socket closing) into a fault, never a hang."""
        what = "died: its socket closed"
        try:
            while True:
                message, extra = await recv_message(worker.sock)
                for e in extra:
                    os.close(e)
                if message.get("op") == "fault":
                    what = f"failed: {message.get('error')}"
                    break
        except (PeerGone, OSError):
            pass
        self._fail(worker, what)

    async def _watch_exit(self, worker: WorkerProcess) -> None:
        """The process's own exit (trio waits on a pidfd): caught even if the socket
        somehow stays open."""
        code = await worker.process.wait()
        self._fail(worker, f"exited with status {code}")

    def _fail(self, worker: WorkerProcess, what: str) -> None:
        if self._closing or self.fault is not None:
            return
        fault = DeviceFault(
            f"worker {worker.index} (pid {worker.pid}, stage {self.stages[worker.index].fn!r}) "
            + what,
            device=f"worker{worker.index}",
        )
        self.fault = fault
        for sig in self.signals.values():
            sig._break(fault)

    _closing = False

    async def __call__(self, x: npt.ArrayLike) -> npt.NDArray[Any]:
        """Run one item through every stage process; returns the last stage's output."""
        if aio.asyncio_caller():
            return await aio.call(self.__call__, x)
        arr = check_input(x, self.in_shape, self.dtype)
        k, slot, oslot = await self._take(fast=True, loan=True)
        fed = lent = False
        try:
            await _items.copy(self._inputs[slot], arr, lambda: self.buffers[0][slot].copyin(arr))
            fed = True
            self._feed(k)
            await self._last._wait_limited(k, None, "")
            self.completed += 1
            if oslot != slot:
                lent = True
                return self._lend(oslot)
            view = self._outputs[slot]
            out = np.empty_like(view)
            await _items.copy(out, view, lambda: self.buffers[-1][slot].copyout(out))
            return out
        finally:
            self._give(k, slot, fed)
            if oslot != slot and not lent:
                self._free_loans.append(oslot)

    def _lend(self, oslot: int) -> npt.NDArray[Any]:
        """The output in loan slot ``oslot``, lent: see ``hcqa._items.lend``."""
        self.loaned += 1
        return _items.lend(self.buffers[-1][oslot], lambda: self._free_loans.append(oslot))

    async def _take(self, *, fast: bool = False, loan: bool = False) -> tuple[int, int, int]:
        """Take the next item number, a slot (waiting for one: backpressure) and its
        output slot: a free loan slot if ``loan``, else the slot itself.

        ``fast``: when a slot is free, take it without a schedule point -- for callers
        that are sure to reach one later (``__call__`` always waits for its item)."""
        if self.fault is not None:
            raise self.fault
        if self._closing:
            raise DeviceClosed("the process pipeline is closed")
        if fast:
            try:
                self._limit.acquire_nowait()
            except trio.WouldBlock:
                await self._limit.acquire()
        else:
            await self._limit.acquire()
        self._next += 1
        slot = self._free_slots.pop()
        oslot = self._free_loans.pop() if loan and self._free_loans else slot
        row = self._table[self._next % self.depth]
        row[0], row[1] = slot, oslot
        return self._next, slot, oslot

    def _give(self, k: int, slot: int, fed: bool) -> None:
        """Item ``k`` is over: pass it on if it was never fed, and free its slot.

        The slot goes back to the pool at once: every stage handles items in order, so
        the next item in this slot is written after this one is read -- and if this item
        was abandoned midway, only its own (dropped) data is overwritten."""
        if not fed:
            self._feed(k)
        self._free_slots.append(slot)
        self._limit.release()

    @asynccontextmanager
    async def item(self) -> AsyncIterator[PipelineItem]:
        """One item, zero-copy: write ``item.input`` in place, ``await item.run()`` returns
        the output *as a view of the shared slot*, valid until the block is left.

        Takes one of the ``depth`` slots for the block (backpressure). Items run in the
        order they were taken; one whose block is left without ``run()`` is passed through
        the stages with whatever its input slot holds, and its output is dropped."""
        k, slot, _ = await self._take()
        item = PipelineItem(self, k, slot)
        try:
            yield item
        finally:
            item.done = True
            self._give(k, slot, item.fed)

    def _feed(self, k: int) -> None:
        """Item ``k``'s input is in place: ``fed`` moves over the prefix of such items."""
        ready, sig = self._fed, self._fed_signal
        v = sig.value
        if k == v + 1 and not ready:  # in order: the common case
            sig._set_from_engine(k)
            return
        ready.add(k)
        while v + 1 in ready:
            v += 1
            ready.discard(v)
        if v != sig.value:
            sig._set_from_engine(v)


class PipelineItem:
    """One item of a :class:`ProcessPipeline` (see :meth:`ProcessPipeline.item`)."""

    def __init__(self, pipe: ProcessPipeline, number: int, slot: int) -> None:
        self.pipe = pipe
        self.number = number
        self.slot = slot
        self.fed = False
        self.done = False

    @property
    def input(self) -> npt.NDArray[Any]:
        """The input slot, to fill in place before :meth:`run`."""
        self._check()
        return self.pipe._inputs[self.slot]

    async def run(self) -> npt.NDArray[Any]:
        """Hand the input to the first stage; returns a view of the last stage's output."""
        self._check()
        if self.fed:
            raise InvalidCommand(f"item {self.number} was already run")
        self.fed = True
        pipe = self.pipe
        pipe._feed(self.number)
        await pipe._last.wait(self.number)
        pipe.completed += 1
        return pipe._outputs[self.slot]

    def _check(self) -> None:
        if self.done:
            raise InvalidCommand(f"item {self.number}'s slot was released (its block ended)")


@asynccontextmanager
async def open_process_pipeline(
    stages: Sequence[ProcessStage | str],
    *,
    in_shape: tuple[int, ...],
    dtype: npt.DTypeLike = "float32",
    depth: int = 2,
    grace: float = 5.0,
    blas_threads: int | None = 1,
) -> AsyncIterator[ProcessPipeline]:
    """Start a worker process per stage and yield a :class:`ProcessPipeline` over them.

    ``blas_threads`` limits each worker's BLAS/OpenMP pool (None: inherit), so the
    workers, not BLAS threads, are the unit of parallelism."""
    if aio.asyncio_caller():
        make = functools.partial(
            open_process_pipeline,
            stages,
            in_shape=in_shape,
            dtype=dtype,
            depth=depth,
            grace=grace,
            blas_threads=blas_threads,
        )
        async with aio.hosted(make, "open_process_pipeline") as hosted:
            yield hosted
        return
    if not stages:
        raise InvalidCommand("a process pipeline needs at least one stage (got none)")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise InvalidCommand(f"'depth' must be an int >= 1 (got {depth!r})")
    specs = [ProcessStage(fn=s) if isinstance(s, str) else s for s in stages]
    pipe: ProcessPipeline | None = None
    try:
        async with open_device("cpu:0") as device:
            pipe = ProcessPipeline(device, specs, in_shape=in_shape, dtype=dtype, depth=depth)
            error: BaseException | None = None
            try:
                async with trio.open_nursery() as nursery:
                    try:
                        for i in range(len(specs)):
                            worker = await spawn_worker(i, blas_threads)
                            pipe.workers.append(worker)
                        eventfds = [await pipe._connect(w) for w in pipe.workers]
                        await pipe._mesh(eventfds)
                        for w in pipe.workers:
                            nursery.start_soon(pipe._watch, w, name=f"worker {w.index} watch")
                            nursery.start_soon(pipe._watch_exit, w, name=f"worker {w.index} exit")
                        yield pipe
                    except BaseException as exc:
                        error = exc
                    pipe._closing = True
                    with trio.CancelScope(shield=True):
                        await stop_workers(pipe.workers, grace)
                    nursery.cancel_scope.cancel()
            finally:
                for w in pipe.workers:
                    w.sock.close()
                # Drop our numpy views of the shared memory: an mmap can only unmap (and
                # close its own dup of the memfd) once no view exports it.
                for row in pipe.buffers:
                    for b in row:
                        b._array = None
                pipe.buffers = []
                pipe._inputs, pipe._outputs = [], []
                pipe.slot_table._array = None
                pipe._table = np.empty(0, np.int64)
            if error is not None:
                raise error
    finally:
        # Only now that the device has drained (or dropped) its copies and their
        # Signal commands may the signals go: an engine must never write a closed one.
        if pipe is not None:
            for sig in pipe.signals.values():
                sig.close()


def identity(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """A sample stage: copy the input."""
    np.copyto(out, inp)


def add_one(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """A sample stage: ``out = inp + 1``."""
    np.add(inp, 1, out=out)
