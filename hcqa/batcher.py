"""Dynamic batching: single samples from many concurrent callers become microbatches.

Theory of operation
-------------------
``await batch(sample)`` checks the sample (shape, dtype) and appends a *request* to a
FIFO of pending requests, wakes the batcher's collector task, then parks on the
request's own event. The collector (one trio task, started by :func:`open_batcher`) is
the only one that turns requests into batches. It dispatches the oldest pending
requests, up to ``max_batch`` of them, as one batch when

- a slot is free (at most ``depth`` batches run at once: the target's own depth for a
  pipeline, so batches queue here, where they can still grow, not inside the pipeline),
- and one of: the batch is full; the oldest request has waited ``max_wait``; or **no batch
  is running at all** -- the target is idle, so waiting could only add latency. A lone
  caller pays no ``max_wait``; under load requests pile up while the target works, and
  batches fill by themselves.

A *serial* target (a ``models.Model``: its slots share one set of buffers, so its batches
run one after another) takes a second batch only to queue it behind the running one, so that
the device goes on without waiting for the event loop. A batch that is not full gains nothing
by leaving early there: it would only wait on the device, with fewer rows, and the rows that
arrive meanwhile would make a batch more. So while a serial target runs a batch, only a full
one is queued behind it; one that is not full waits for the running batch to end.

The call that fills a batch while a slot is free starts it itself (a round of the event
loop sooner than the collector would: under load, a round runs every connection's task).
A batch's task that sees its batch end runs the batch that end made ready (a serial
target's partial one, or a full one waiting for the slot) itself, in that very step: the
next batch reaches the device with no round of the event loop (nor a task start) between.
A batch: its samples stacked into one array (padded with zeros up to a pipeline's fixed
batch dimension), the target run once, row ``i`` of its result copied to request ``i``
(padding dropped); an exception from the target goes to exactly the callers of that batch.

Cancellation: a caller cancelled while its request is still pending removes it from the FIFO
(nothing ran); one cancelled after dispatch just stops waiting -- its row is computed with
the others and dropped, so the rest of its batch is unharmed.

Closing: leaving the ``async with`` block normally stops new calls (``DeviceClosed``), runs
what is pending and waits for the running batches. Leaving it by an exception cancels the
batches; every caller still waiting gets ``DeviceClosed``.

Nothing spins: the collector sleeps on a ``trio.Event`` (woken by a new request or a finished
batch) or until the oldest request's ``max_wait`` deadline.

::

    caller ──▶ check sample ──▶ pending FIFO ──▶ collector (slot free? full / waited /
      ▲                                           idle?) ──▶ batch task: stack, pad,
      │                                                        await target(x), slice
      └───────────────── row i (or the batch's exception) ◀────────────┘
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from hcqa import aio
from hcqa.actors import engine as _engine
from hcqa.devices.sizes import check_int, check_sample
from hcqa.errors import DeviceClosed, InvalidCommand, QueueFull
from hcqa.trace import serving

__all__ = ["Batcher", "BatcherStatistics", "open_batcher"]

Target = Callable[[npt.NDArray[Any]], Awaitable[npt.NDArray[Any]]]
_WAIT_HISTORY = 4096  # queue waits kept for the percentiles


@attrs.frozen(kw_only=True)
class BatcherStatistics:
    """What :meth:`Batcher.statistics` reports (times in seconds)."""

    max_batch: int
    max_wait: float
    depth: int  # batches allowed to run at once
    batches: int  # batches run (finished, failed or not)
    samples: int  # samples in those batches
    mean_batch: float  # samples / batches (NaN before the first batch)
    batch_sizes: tuple[int, ...]  # batch_sizes[k - 1]: batches of k samples
    failed_batches: int  # batches whose target raised
    cancelled: int  # callers that stopped waiting (their rows were dropped or never ran)
    pending: int  # requests waiting for a batch
    in_flight: int  # batches running now
    queue_wait_p50: float  # from the call to its batch's dispatch, last 4096 requests
    queue_wait_p99: float
    queue_wait_total: float  # every request's wait from its call to its batch's dispatch


@attrs.define(eq=False)
class _Request:
    sample: npt.NDArray[Any]
    arrived: float
    done: trio.Event = attrs.field(factory=trio.Event)
    result: npt.NDArray[Any] | None = None
    error: BaseException | None = None
    traced: tuple[int, int, int] | None = None  # where its request range was (tracing only)


class Batcher:
    """Gathers single samples into batches for ``target``; made by :func:`open_batcher`.

    ``await batcher(sample)`` returns the sample's row of the target's output.
    """

    def __init__(
        self,
        target: Target,
        *,
        max_batch: int,
        max_wait: float,
        sample_shape: tuple[int, ...],
        dtype: np.dtype[Any],
        depth: int,
        buckets: list[tuple[int, Target]],
        max_pending: int | None,
        name: str = "",
        serial: bool = False,
    ) -> None:
        self.target = target
        self.name = name
        self.max_batch = max_batch
        self.max_wait = max_wait
        self.sample_shape = sample_shape
        self.dtype = dtype
        self.depth = depth
        self.max_pending = max_pending
        self.serial = serial
        self._buckets = buckets
        self._pending: collections.deque[_Request] = collections.deque()
        self._wake = trio.Event()
        self._in_flight = 0
        self._closed = False
        self._batches = 0
        self._samples = 0
        self._sizes = [0] * max_batch
        self._failed = 0
        self._cancelled = 0
        self._waits: collections.deque[float] = collections.deque(maxlen=_WAIT_HISTORY)
        self._wait_total = 0.0
        self._nursery: trio.Nursery | None = None  # the collector's, while it runs

    async def __call__(self, sample: npt.ArrayLike) -> npt.NDArray[Any]:
        """Run ``sample`` in the next batch; returns its row of the target's output."""
        if aio.asyncio_caller():
            return await aio.call(self.__call__, sample)
        arr = check_sample("a sample", sample, self.sample_shape, self.dtype)
        if self._closed:
            raise DeviceClosed("the batcher is closed")
        if self.max_pending is not None and len(self._pending) >= self.max_pending:
            raise QueueFull(
                f"batcher pending requests must stay <= {self.max_pending} "
                f"(got {len(self._pending)} waiting)"
            )
        request = _Request(sample=arr, arrived=trio.current_time())
        if _engine.trace_hook is not None:  # tracing: an arrow from the request to its batch
            request.traced = serving.here()
        self._pending.append(request)
        free = self._in_flight < self.depth and self._nursery is not None
        if free and len(self._pending) >= self.max_batch:
            self._dispatch()  # full, and a slot is free: no round of the collector first
        else:
            self._wake.set()
        try:
            await request.done.wait()
        except BaseException:
            self._cancelled += 1
            if not request.done.is_set():
                try:
                    self._pending.remove(request)  # still pending: it leaves the queue
                except ValueError:
                    pass  # dispatched: its row is computed and dropped
            raise
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def statistics(self) -> BatcherStatistics:
        """A frozen snapshot of the counters (see :class:`BatcherStatistics`)."""
        if self._waits:  # nearest-rank percentiles, as numpy's "inverted_cdf" method computes
            p50, p99 = np.percentile(list(self._waits), [50, 99], method="inverted_cdf").tolist()
        else:
            p50 = p99 = math.nan
        return BatcherStatistics(
            max_batch=self.max_batch,
            max_wait=self.max_wait,
            depth=self.depth,
            batches=self._batches,
            samples=self._samples,
            mean_batch=self._samples / self._batches if self._batches else math.nan,
            batch_sizes=tuple(self._sizes),
            failed_batches=self._failed,
            cancelled=self._cancelled,
            pending=len(self._pending),
            in_flight=self._in_flight,
            queue_wait_p50=p50,
            queue_wait_p99=p99,
            queue_wait_total=self._wait_total,
        )

    def __repr__(self) -> str:
        return (
            f"<Batcher {self.dtype}{list(self.sample_shape)} max_batch={self.max_batch} "
            f"max_wait={self.max_wait} depth={self.depth}>"
        )

    # -- the collector -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The collector: dispatch batches until closed and drained (see the module doc)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                if not self._pending:
                    if self._closed:
                        break
                    await self._sleep(math.inf)
                    continue
                when = self._due()
                if when > trio.current_time():
                    await self._sleep(when)  # inf: until a slot frees or the batch fills
                    continue
                self._dispatch()
            # closed and nothing pending: the nursery waits for the running batches
            self._nursery = None

    def _due(self) -> float:
        """When the pending requests go as a batch: now (-inf), at the oldest's ``max_wait``
        deadline, or once a batch ends or more arrive (inf): the module doc's rules."""
        if self._in_flight >= self.depth:
            return math.inf
        full = len(self._pending) >= self.max_batch
        if full or self._in_flight == 0 or self._closed:
            return -math.inf
        if self.serial:
            return math.inf  # it grows until full or the running one ends
        return self._pending[0].arrived + self.max_wait

    def _dispatch(self) -> None:
        """Start a batch of the oldest pending requests (the caller saw it ready)."""
        assert self._nursery is not None
        self._nursery.start_soon(self._run_batches, self._take(), name=self._task_name)

    def _take(self) -> list[_Request]:  # the oldest pending requests, as a batch in flight
        self._in_flight += 1
        return [self._pending.popleft() for _ in range(min(self.max_batch, len(self._pending)))]

    @property
    def _task_name(self) -> str:
        return f"batch of {self.name}" if self.name else "hcqa.batcher.Batcher._run_batch"

    async def _sleep(self, deadline: float) -> None:
        """Park until woken (new request, finished batch, close) or ``deadline`` passes."""
        self._wake = trio.Event()
        if deadline == math.inf:
            await self._wake.wait()
        else:
            with trio.move_on_after(max(0.0, deadline - trio.current_time())):
                await self._wake.wait()

    async def _run_batches(self, batch: list[_Request]) -> None:
        """Run ``batch``; then, in the step that saw it end, each batch its end made ready."""
        while True:
            await self._run_batch(batch)
            if not (self._pending and self._nursery and self._due() <= trio.current_time()):
                return
            batch = self._take()  # submitted before this step ends: no round of the loop

    async def _run_batch(self, batch: list[_Request]) -> None:
        now = trio.current_time()
        n = len(batch)
        waits = [now - r.arrived for r in batch]
        self._waits.extend(waits)
        self._wait_total += sum(waits)
        self._batches += 1
        self._samples += n
        self._sizes[n - 1] += 1
        tracer = serving.active() if _engine.trace_hook is not None else None
        span = None if tracer is None else serving.batch_begin(tracer, self.name or "batcher")
        error = ""
        try:
            # the smallest pipeline that holds n rows (a plain callable takes exactly n)
            rows, target = next(((r, t) for r, t in self._buckets if r >= n), (n, self.target))
            x = np.empty((rows, *self.sample_shape), self.dtype)
            for i, r in enumerate(batch):
                x[i] = r.sample
            x[n:] = 0
            y = await target(x)
            y = np.asarray(y)
            if y.ndim < 1 or y.shape[0] != rows:
                raise InvalidCommand(
                    f"the batch target must return one row per sample, {rows} rows "
                    f"(got {y.dtype}{list(y.shape)})"
                )
            for i, r in enumerate(batch):
                r.result = np.array(y[i])  # a copy: a pipeline's lent output goes back at once
        except Exception as exc:
            self._failed += 1
            error = type(exc).__name__
            for r in batch:
                r.error = exc
        except BaseException:  # cancelled: the batcher is closing by an exception
            for r in batch:
                r.error = DeviceClosed("the batcher closed before this batch finished")
            raise
        finally:
            if span is not None:
                froms = [r.traced for r in batch]
                serving.batch_end(tracer, span, self.name or "batcher", froms, error)
            for r in batch:
                r.done.set()
            self._in_flight -= 1
            self._wake.set()

    def _close(self, *, failed: bool) -> None:
        self._closed = True
        if failed:
            while self._pending:
                r = self._pending.popleft()
                r.error = DeviceClosed("the batcher closed before this sample ran")
                r.done.set()
        self._wake.set()


def _is_pipeline(target: Any) -> bool:
    return all(hasattr(target, a) for a in ("in_shape", "dtype", "depth")) and callable(target)


def _is_async_callable(target: Any) -> bool:
    """An ``async def`` function, a partial of one, or an object whose ``__call__`` is one."""
    while isinstance(target, functools.partial):
        target = target.func
    if inspect.iscoroutinefunction(target):
        return True
    call = getattr(target, "__call__", None)  # noqa: B004  (a callable object's method)
    return call is not None and inspect.iscoroutinefunction(call)


@aio.rehosts
@asynccontextmanager
async def open_batcher(
    target: Any,
    *,
    max_batch: int | None = None,
    max_wait: float = 0.002,
    sample_shape: Sequence[int] | int | None = None,
    dtype: npt.DTypeLike | None = None,
    depth: int | None = None,
    max_pending: int | None = None,
    name: str = "",
    serial: bool = False,
) -> AsyncIterator[Batcher]:
    """Batch single samples for ``target`` inside the block: ``row = await batch(sample)``.

    ``target`` is a :class:`~hcqa.Pipeline`, a :class:`~hcqa.ProcessPipeline` (anything with
    ``in_shape``, ``dtype`` and ``depth``: samples are rows of ``in_shape``, batches are
    padded to ``in_shape[0]``, ``max_batch`` defaults to it and may not exceed it, and up to
    ``depth`` batches run at once), a list of such pipelines taking the same rows with
    different batch dimensions (*buckets*: a batch of ``n`` runs on the smallest one with
    ``in_shape[0] >= n``, so a lone sample is not padded to the largest batch), or any async
    callable over an array
    ``[n, *sample_shape]`` that returns ``n`` rows (then ``sample_shape`` and ``dtype`` are
    required, ``max_batch`` too, and ``depth`` defaults to 1).

    ``max_wait`` (seconds): the longest a request waits for its batch to fill while the
    target is busy; when nothing runs, a batch goes at once. ``max_pending``: a call that
    finds that many requests waiting raises ``QueueFull`` (None: no limit). ``name`` (a served
    model's) names the batch tasks and, in a trace, the batches' track. ``serial``: the
    target runs its batches one after another (a ``models.Model``), so while one runs only a
    full batch is queued behind it (see the module doc).

    Under asyncio the batcher's tasks (and so an async callable target) run in the loop's
    trio host (see ``hcqa.aio``): the target must be trio-flavoured or an hcqa pipeline.
    """
    if isinstance(sample_shape, int | np.integer) and not isinstance(sample_shape, bool):
        sample_shape = (int(sample_shape),)  # an int is a shape, as everywhere in hcqa
    elif sample_shape is not None and (
        isinstance(sample_shape, str | bytes) or not isinstance(sample_shape, Sequence)
    ):
        raise InvalidCommand(
            f"'sample_shape' must be an int or a sequence of ints >= 1 (got {sample_shape!r})"
        )
    buckets: list[tuple[int, Target]] = []  # (rows, pipeline), smallest first
    if isinstance(target, list | tuple):  # pipelines of several batch sizes: buckets
        pipes = list(target)
        if not pipes or not all(_is_pipeline(p) for p in pipes):
            raise InvalidCommand(
                "a list of batch targets must hold Pipelines or ProcessPipelines "
                f"(got {[type(p).__name__ for p in pipes]})"
            )
    elif _is_pipeline(target):
        pipes = [target]
    elif callable(target):
        if not _is_async_callable(target):
            name = getattr(target, "__name__", None) or type(target).__name__
            raise InvalidCommand(
                "the batch target must be an async callable (async def), a Pipeline or a "
                f"ProcessPipeline (got the plain callable {name!r}: define it with async def, "
                "or wrap it in one)"
            )
        pipes = []
    else:
        raise InvalidCommand(
            f"the batch target must be a Pipeline, ProcessPipeline or async callable "
            f"(got {type(target).__name__})"
        )
    if pipes:
        rows_shape = tuple(pipes[0].in_shape)[1:]
        for p in pipes:
            in_shape = tuple(p.in_shape)
            if len(in_shape) < 1:
                raise InvalidCommand(
                    f"the pipeline's in_shape must have a batch dimension (got {[]})"
                )
            if in_shape[1:] != rows_shape or p.dtype != pipes[0].dtype:
                raise InvalidCommand(
                    f"the pipelines must take the same rows, {pipes[0].dtype}{list(rows_shape)} "
                    f"(got {p.dtype}{list(in_shape[1:])})"
                )
        buckets = sorted(((int(p.in_shape[0]), p) for p in pipes), key=lambda b: b[0])
        if len({rows for rows, _ in buckets}) != len(buckets):
            raise InvalidCommand(
                f"the pipelines' batch dimensions must differ (got {[r for r, _ in buckets]})"
            )
        if sample_shape is not None and tuple(sample_shape) != rows_shape:
            raise InvalidCommand(
                f"'sample_shape' must be {list(rows_shape)}, the pipeline's rows "
                f"(got {list(sample_shape)})"
            )
        if dtype is not None and np.dtype(dtype) != pipes[0].dtype:
            raise InvalidCommand(
                f"'dtype' must be {pipes[0].dtype}, the pipeline's (got {np.dtype(dtype)})"
            )
        pad_to: int | None = buckets[-1][0]
        sample_shape, dtype = rows_shape, pipes[0].dtype
        max_batch = pad_to if max_batch is None else max_batch
        depth = max(p.depth for p in pipes) if depth is None else depth
    elif sample_shape is None or dtype is None or max_batch is None:
        raise InvalidCommand(
            "an async callable target needs 'max_batch', 'sample_shape' and 'dtype' (got "
            f"max_batch={max_batch!r}, sample_shape={sample_shape!r}, dtype={dtype!r})"
        )
    else:
        pad_to = None
    max_batch = check_int("max_batch", max_batch, minimum=1)
    if pad_to is not None and max_batch > pad_to:
        raise InvalidCommand(
            f"'max_batch' must be <= {pad_to}, the pipeline's batch dimension (got {max_batch})"
        )
    if (
        isinstance(max_wait, bool)
        or not isinstance(max_wait, int | float)
        or not max_wait >= 0
        or max_wait == math.inf
    ):
        raise InvalidCommand(f"'max_wait' must be a finite number >= 0 seconds (got {max_wait!r})")
    depth = 1 if depth is None else depth
    check_int("depth", depth, minimum=1)
    if max_pending is not None:
        check_int("max_pending", max_pending, minimum=1)
    shape = tuple(sample_shape)
    for d in shape:
        check_int("sample_shape", d, minimum=1)
    batcher = Batcher(
        target,
        max_batch=max_batch,
        max_wait=float(max_wait),
        sample_shape=shape,
        dtype=np.dtype(dtype),
        depth=depth,
        buckets=buckets,
        max_pending=max_pending,
        name=str(name),
        serial=bool(serial),
    )
    error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        try:
            yield batcher
        except BaseException as exc:  # raised below, not wrapped in an ExceptionGroup
            error = exc
            batcher._close(failed=True)
            nursery.cancel_scope.cancel()
        else:
            batcher._close(failed=False)
    if error is not None:
        raise error
