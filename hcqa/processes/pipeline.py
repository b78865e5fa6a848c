"""The coordinator's side of a process pipeline: ``ProcessPipeline`` and its opening.

Theory of operation: see the package (``hcqa.processes``); this module holds the item
paths (``__call__``, ``item()``), the watchers that turn a worker's death or a stalled
stage into a sticky fault, and the close; ``opening`` starts and stops the workers.
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from hcqa import aio
from hcqa.devices.base import Device
from hcqa.devices.buffer import Buffer
from hcqa.errors import (
    DeviceClosed,
    DeviceFault,
    HcqaError,
    InvalidCommand,
    OutOfMemory,
    SignalTimeout,
)
from hcqa.pipeline import check_input
from hcqa.processes import _items
from hcqa.processes._checks import ProcessStage, check_fds
from hcqa.processes._checks import out_shape as stage_out_shape
from hcqa.processes._pool import SlotPool
from hcqa.processes._spawn import (
    WorkerProcess,
)
from hcqa.processes.ipc import PeerGone, recv_message
from hcqa.signals import Signal

__all__ = [
    "PipelineItem",
    "ProcessPipeline",
    "ProcessPipelineStatistics",
]


@attrs.frozen(kw_only=True)
class ProcessPipelineStatistics:
    """What :meth:`ProcessPipeline.statistics` reports."""

    stages: int
    depth: int
    in_flight: int  # slots taken by items now (held by callers, or retired)
    retired: int  # of those, items whose caller left before the item left every stage
    completed: int
    loans: int  # spare output slots for lent results
    lent: int  # of those, held by results (or retired items) now
    loaned: int  # results lent so far
    workers: tuple[int, ...]  # their pids
    faulted: bool


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
        hang_limit: float = 30.0,
    ) -> None:
        self.device = device
        self.stages = tuple(stages)
        self.depth = depth
        self.hang_limit = float(hang_limit)
        self.in_shape = tuple(in_shape)
        self.dtype = np.dtype(dtype)
        self.shapes: list[tuple[tuple[int, ...], np.dtype[Any]]] = [(self.in_shape, self.dtype)]
        for s in self.stages:
            shape, dt = self.shapes[-1]
            self.shapes.append((stage_out_shape(s) or shape, np.dtype(s.out_dtype or dt)))
        out_shape, out_dtype = self.shapes[-1]
        out_nbytes = math.prod(out_shape) * out_dtype.itemsize
        loans = 0  # spare output slots for lent results: up to depth, within budget
        if out_nbytes > _items.INLINE_COPY:
            loans = min(depth, max(1, _items.LOAN_BUDGET // out_nbytes))
        self.loans = loans
        # buffers[j][slot]: the input of stage j (j = len(stages): the final output,
        # whose row also holds the loan slots, depth ... depth + loans - 1)
        self.rows = [depth] * (len(self.shapes) - 1) + [depth + loans]
        check_fds(sum(self.rows) + 1, len(self.stages))
        self.buffers: list[list[Buffer]] = []
        try:
            for (shape, dt), n in zip(self.shapes, self.rows, strict=True):
                row = [device.alloc(shape=shape, dtype=dt, shared=True) for _ in range(n)]
                self.buffers.append(row)
            # slot_table[k % depth] = (slot, output slot) of item k, written before
            # ``fed`` reaches k; the output slot is the slot itself or a loan
            self.slot_table = device.alloc(shape=(depth, 2), dtype="int64", shared=True)
        except OSError as exc:
            sizes = [math.prod(sh) * dt.itemsize for sh, dt in self.shapes]
            total = sum(b * n for b, n in zip(sizes, self.rows, strict=True))
            raise OutOfMemory(
                f"the process pipeline's shared slots ({total} bytes in {sum(self.rows)} "
                f"buffers) could not be allocated: {exc.strerror or exc}"
            ) from exc
        self._table = self.slot_table._kernel_array()
        # row r of the table is [2 r], [2 r + 1] (a cast never copies: it refuses a
        # table that is not one contiguous buffer)
        self._rows = self._table.data.cast("B").cast("q")
        self.pool = SlotPool(depth, loans)
        self.loaned = 0  # outputs handed out without a copy
        self.signals: dict[str, Signal] = {"fed": Signal(name="fed")}
        for i in range(len(self.stages)):
            self.signals[f"done{i}"] = Signal(name=f"done{i}")
        self._fed_signal = self.signals["fed"]
        self._last = self.signals[f"done{len(self.stages) - 1}"]
        # Only the last worker writes it, always value then eventfd (a peer's eventfd is
        # written on every set): its waits here need no timed re-read of memory.
        self._last._rereads = False
        # the slots as arrays: the first stage's inputs, the last stage's outputs
        self._inputs = [b._kernel_array() for b in self.buffers[0]]
        self._outputs = [b._kernel_array() for b in self.buffers[-1][:depth]]
        self.workers: list[WorkerProcess] = []
        self._fed: set[int] = set()  # items whose input is ready, not yet in the prefix
        self._idle: trio.Event | None = None  # the watchdog sleeps on it while idle
        self.fault: HcqaError | None = None
        self.completed = 0
        self._closing = False

    def statistics(self) -> ProcessPipelineStatistics:
        """A frozen snapshot: slots in use, items completed, loans held, worker pids."""
        return ProcessPipelineStatistics(
            stages=len(self.stages),
            depth=self.depth,
            in_flight=self.pool.in_flight(),
            retired=len(self.pool.retired),
            completed=self.completed,
            loans=self.loans,
            lent=self.loans - len(self.pool.free_loans),
            loaned=self.loaned,
            workers=tuple(w.pid for w in self.workers),
            faulted=self.fault is not None,
        )

    def __repr__(self) -> str:
        names = " -> ".join(s.fn for s in self.stages)
        return f"<ProcessPipeline {names} depth={self.depth}>"

    # -- items ------------------------------------------------------------------------------

    async def __call__(self, x: npt.ArrayLike) -> npt.NDArray[Any]:
        """Run one item through every stage process; returns the last stage's output."""
        if aio.asyncio_caller():
            return await aio.call(self.__call__, x)
        arr = check_input(x, self.in_shape, self.dtype)
        # The common case costs no coroutine, lambda or await before the item's own wait:
        # a free slot is taken at once, and a small input copied straight into it.
        taken = self.pool.take_nowait(loan=True)
        if taken is None:
            taken = await self.pool.take(fast=True, loan=True)
        k, slot, oslot = taken
        self._enter(k, slot, oslot)
        fed = lent = False
        try:
            if arr.nbytes <= _items.INLINE_COPY:
                np.copyto(self._inputs[slot], arr)
            else:
                await _items.copy(self._inputs[slot], arr, lambda: self._copy_in(slot, arr))
            fed = True
            self._feed(k)
            await self._last._wait_sole(k)
            self.completed += 1
            if oslot != slot:
                lent = True
                return self._lend(oslot)
            view = self._outputs[slot]
            if view.nbytes <= _items.INLINE_COPY:
                return view.copy()
            out = np.empty_like(view)
            await _items.copy(out, view, lambda: self.buffers[-1][slot].copyout(out))
            return out
        finally:
            if not fed:
                self._feed(k)  # passed through with whatever its slot holds; dropped
            self._release(k, slot, oslot, lent)

    async def _take(self, *, fast: bool, loan: bool) -> tuple[int, int, int]:
        """A slot for the next item (see ``SlotPool.take``), entered in the slot table."""
        k, slot, oslot = await self.pool.take(fast=fast, loan=loan)
        self._enter(k, slot, oslot)
        return k, slot, oslot

    def _enter(self, k: int, slot: int, oslot: int) -> None:
        """Item ``k``'s row of the slot table: its slot and its output slot."""
        row = 2 * (k % self.depth)
        rows = self._rows
        rows[row] = slot
        rows[row + 1] = oslot

    async def _copy_in(self, slot: int, arr: npt.NDArray[Any]) -> None:
        """The largest inputs go through the copy engine: shielded, so a cancelled caller
        never leaves the engine writing a slot that is already fed (and reused)."""
        fence = self.buffers[0][slot].copyin(arr)
        with trio.CancelScope(shield=True):
            await fence

    def _release(self, k: int, slot: int, oslot: int, lent: bool = False) -> None:
        pool = self.pool
        finished = self._last.value
        pool.release(k, slot, oslot, left=finished >= k, lent=lent)
        if pool.retired:
            pool.reclaim(finished)

    def _lend(self, oslot: int) -> npt.NDArray[Any]:
        """The output in loan slot ``oslot``, lent: see ``_items.lend``."""
        self.loaned += 1
        pool = self.pool
        return _items.lend(self.buffers[-1][oslot], lambda: pool.give_loan(oslot))

    @asynccontextmanager
    async def item(self) -> AsyncIterator[PipelineItem]:
        """One item, zero-copy: write ``item.input`` in place, ``await item.run()`` returns
        the output *as a view of the shared slot*, valid until the block is left.

        Takes one of the ``depth`` slots for the block (backpressure). Items run in the
        order they were taken; one whose block is left without ``run()`` is passed through
        the stages with whatever its input slot holds, and its output is dropped. Either
        way the slot is reused only once the item has left every stage."""
        if aio.asyncio_caller():  # the slot is taken and given back in the trio host
            async with aio.hosted(self.item, "ProcessPipeline.item") as hosted:
                yield hosted
            return
        k, slot, _ = await self._take(fast=False, loan=False)
        item = PipelineItem(self, k, slot)
        try:
            yield item
        finally:
            item.done = True
            if not item.fed:
                item.fed = True
                self._feed(k)
            self._release(k, slot, slot)

    def _feed(self, k: int) -> None:
        """Item ``k``'s input is in place: ``fed`` moves over the prefix of such items."""
        if self._closing:
            return  # the signals are broken (or closed: never write a closed one)
        if self._idle is not None:
            self._idle.set()
            self._idle = None
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

    def _who(self, worker: WorkerProcess) -> str:
        return f"worker {worker.index} (pid {worker.pid}, stage {self.stages[worker.index].fn!r})"

    # -- watchers: a worker's death, a stage's error, a stalled stage, retired slots --------

    async def _watch(self, worker: WorkerProcess) -> None:
        """Turn a worker's death (its socket closing) or its stage's error into a fault."""
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
        """The process's own exit (a pidfd): caught even if the socket stays open."""
        code = await worker.wait_exit()
        self._fail(worker, f"exited with status {code}")

    def _fail(self, worker: WorkerProcess, what: str) -> None:
        if not self._closing:
            self._fault(DeviceFault(f"{self._who(worker)} {what}", device=f"worker{worker.index}"))

    def _fault(self, fault: HcqaError) -> None:
        """Sticky: every waiter, now and later, raises ``fault``."""
        if self.fault is not None:
            return
        self.fault = fault
        for sig in self.signals.values():
            sig._break(fault)
        self.pool.close(self._refusal)

    def _refusal(self) -> BaseException:
        if self.fault is not None:
            return self.fault
        return DeviceClosed("the process pipeline is closed")

    async def _reap(self) -> None:
        """While items are retired, sleep on the last stage's signal and free them."""
        pool = self.pool
        while True:
            await pool.retired_event.wait()
            if not pool.retired:
                continue
            try:
                await self._last.wait(pool.retired[0][0])
            except HcqaError:
                return  # faulted or closed: slots no longer matter
            pool.reclaim(self._last.value)

    async def _watchdog(self) -> None:
        """No progress for ``hang_limit`` in a stage that has work: the pipeline hangs.

        Sleeps while idle (until the next item is fed), else wakes every quarter limit
        and compares each busy stage's ``done`` value with what it saw: a stage whose
        value stood still for a whole limit while its input was ahead is stalled (stuck,
        stopped, or looping); one that keeps finishing items, however slowly, is not."""
        limit = self.hang_limit
        if math.isinf(limit):
            return
        n = len(self.stages)
        inputs = [self.signals[name] for name in ["fed", *(f"done{i}" for i in range(n - 1))]]
        dones = [self.signals[f"done{i}"] for i in range(n)]
        seen = [-1] * n
        since: list[float | None] = [None] * n  # busy and unchanged since then
        while self.fault is None and not self._closing:
            if inputs[0].value <= dones[-1].value:
                self._idle = trio.Event()
                await self._idle.wait()
            await trio.sleep(limit / 4)
            now = trio.current_time()
            if self.fault is not None or self._closing:
                return
            for i in range(n):
                done = dones[i].value
                if inputs[i].value <= done:
                    since[i] = None  # nothing to do: waiting is not hanging
                elif done != seen[i] or since[i] is None:
                    since[i] = now
                elif now - since[i] >= limit:  # type: ignore[operator]
                    self._hang(i, done)
                    return
                seen[i] = done

    def _hang(self, i: int, done: int) -> None:
        worker = self.workers[i]
        self._fault(
            SignalTimeout(
                f"stage {i} ({self.stages[i].fn!r}, worker pid {worker.pid}) made no progress "
                f"for {self.hang_limit:g} s: item {done + 1} entered it and did not leave "
                f"(signal 'done{i}' stayed at {done}); the pipeline is faulted and its "
                "workers killed",
                signal=f"done{i}",
                expected=done + 1,
                seen=done,
                device=f"worker{i}",
            )
        )
        for w in self.workers:
            w.kill()

    # -- closing ----------------------------------------------------------------------------

    async def _drain(self, grace: float) -> None:
        """A normal exit: let the items already fed leave (within ``grace``)."""
        with trio.move_on_after(grace):
            try:
                await self._last.wait(self._fed_signal.value)
            except HcqaError:
                pass

    def _close(self) -> None:
        """Every task parked on the pipeline (a slot, a result) raises DeviceClosed (or
        the fault); every later call too."""
        self._closing = True
        if self.fault is None:
            closed = DeviceClosed("the process pipeline is closed")
            for sig in self.signals.values():
                sig._break(closed)
        self.pool.close(self._refusal)


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
        await pipe._last._wait_sole(self.number)
        pipe.completed += 1
        return pipe._outputs[self.slot]

    def _check(self) -> None:
        if self.pipe._closing or self.pipe.fault is not None:
            raise self.pipe._refusal()
        if self.done:
            raise InvalidCommand(f"item {self.number}'s slot was released (its block ended)")
