"""One served model's life: built, warmed, ready, run, and rebuilt after a fault.

Theory of operation
-------------------
A :class:`Model` says what to serve under a name: a ready target (``pipeline``: a
``models.Model``, pipeline(s) or async batch callable, see :mod:`hcqa.serve.targets`) or a
``build`` -- a function returning an async context manager that opens the devices and
yields the target (and closes them on exit). :class:`Hosted` keeps one model:

- :meth:`Hosted.keep` (a task of ``serve()``) builds the target, runs it once per batch size
  on zeros (warming it: the first request pays nothing the build could pay), opens its
  batcher and only then marks the model ready. Health endpoints answer all the while. A
  build that fails before the model was ever ready raises :class:`ModelFailed` ("model 'm'
  failed to load: why"), which ends ``serve()``. Each step is told to the model's
  ``progress`` callback, if it has one (``hcqa serve`` shows them).
- :meth:`Hosted.run` runs a request's rows (one array per input): the model's ``check``
  first (400 before anything is batched), then one row through the batcher (shared with
  other single rows), more rows directly in chunks of ``target.rows``, up to ``depth`` at
  once.

One bad request must not take the server down. When a batch fails, :meth:`_failed` sorts
it out: if the model's devices faulted and the model has a ``build``, it starts a
*recovery* (the generation counter moves on, readiness drops, :meth:`keep` leaves the old
batcher and build -- closing the faulted devices -- and builds again); the batch's own
requests then get the error if the batch was one request, and are retried once, each
alone, if it held several (the one whose input raises fails again alone and gets the
error; the others are answered). A request whose batch failed because an *earlier*
generation faulted (it was queued or running meanwhile) never counts as tried: it waits
for the new generation and runs again. A request that arrives after a fault but before a
run has handled it (the model still ready, its devices faulted) waits up to ``_FAULT_WAIT``
for the recovery to begin, rather than 503.

Runs overlap (other requests' batches, the alone retries, direct runs), and a device fault
is sticky: every run in flight on the device sees the same error, in no set order. So the
fault is *attributed*: each run sets :data:`hcqa.errors.work_owner` to a token of its own
while it queues, the device notes the owner of each batch, and a kernel's or copy's
:class:`DeviceFault` names the owner of the batch that failed (``DeviceFault.owner``, see
``hcqa/devices/faults.py``). Only the run it names is blamed; every other run it reached
is stale (runs again on the next generation). A fault nobody owns (a hang, a fault outside
any command, a driver that could not tell, a ``ProcessPipeline``'s or a callable's
device) is blamed on a single-request run only if no other run overlapped it. A request's
tries (``_TRIES``) count only runs that may have been its own fault: an overlapped run's
unattributed fault. A stale rerun (another run's fault, or it never ran) costs it nothing;
those are bounded apart (``_REBUILDS``), so nothing loops for ever. Without ``build``, a faulted
model stays unavailable (readiness false) and its requests get 503.

:class:`Hosted` also counts what Triton's statistics extension reports (success, fail,
queue and compute times, per batch size), for :func:`hcqa.serve.v2.triton_stats`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any

import anyio
import attrs
import numpy as np
import numpy.typing as npt
import trio

from hcqa.batcher import Batcher, open_batcher
from hcqa.errors import DeviceClosed, DeviceFault, HcqaError, InvalidCommand, work_owner
from hcqa.serve.targets import Target, as_target, is_model
from hcqa.serve.tensors import Packing, TensorSpec

__all__ = ["Hosted", "Model", "ModelFailed", "Unavailable", "error_status"]

Arrays = tuple[npt.NDArray[Any], ...]
_TRIES = 3  # runs that may have faulted by the request's own work, before it gives up
_REBUILDS = 16  # reruns for other runs' faults (or never run): a bound, not a budget
_FAULT_WAIT = 1.0  # seconds a request waits for a faulted device's recovery to begin


@attrs.frozen(kw_only=True)
class Model:
    """A model for :func:`hcqa.serve.serve`, served under ``name``.

    ``pipeline``: what runs -- a :class:`hcqa.models.Model`, a ``Pipeline`` or
    ``ProcessPipeline``, a list of pipelines over the same rows in batches of different
    sizes, or an async batch callable (then ``inputs`` and ``outputs`` declare its tensors:
    ``models.TensorSpec`` or ``(name, shape, dtype)``, batch dimension first). Or ``build``:
    a function returning an async context manager that yields one of those (opening its
    devices, closing them on exit); the server builds it off the request path, and builds
    it again after a device fault. ``max_batch`` (default: the largest batch) and
    ``max_wait`` set the dynamic batching; ``max_batch=1`` turns it off. ``check``: called
    with ``{input name: rows}`` before a request is batched; a ``ValueError`` or
    ``InvalidCommand`` it raises is the request's 400. ``warmup``: run the model once per
    batch size on zeros before it is ready (default: for a ``models.Model`` and for what
    ``build`` yields; a pipeline or callable handed over ready is run only by requests).
    ``progress``: called (on the trio thread) at each step of the model's start, and of each
    rebuild after a fault: ``"building"`` (``"rebuilding (why)"``), ``"warming up"``,
    ``"ready"``, ``"failed: why"``."""

    name: str
    pipeline: Any = None
    build: Callable[[], AbstractAsyncContextManager[Any]] | None = None
    inputs: Any = None
    outputs: Any = None
    version: str = "1"
    max_batch: int | None = None
    max_wait: float = 0.002
    check: Callable[[Mapping[str, npt.NDArray[Any]]], None] | None = None
    warmup: bool | None = None
    progress: Callable[[str], None] | None = None

    def __attrs_post_init__(self) -> None:
        if (self.pipeline is None) == (self.build is None):
            raise InvalidCommand(
                f"model {self.name!r} needs exactly one of 'pipeline' and 'build' "
                f"(got {'both' if self.build is not None else 'neither'})"
            )


class ModelFailed(InvalidCommand):
    """A model that could not be built (or warmed) when the server started."""


class Unavailable(HcqaError):
    """The model is not ready (building, recovering, or faulted for good): 503."""


class _Failed(Exception):
    """A batch's failure as each of its callers sees it: the error, and whether to retry."""

    def __init__(self, error: Exception, retry: str) -> None:
        super().__init__(str(error))
        self.error = error
        # "stale": not its fault (another run's, or it never ran): run again, free;
        # "maybe": an unattributed fault it may have caused: run again, one of its _TRIES;
        # "alone": run once more by itself; "": give up
        self.retry = retry


@attrs.define
class _Times:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, n: int = 1) -> None:
        self.count += n
        self.ns += int(seconds * 1e9)

    def doc(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class Hosted:
    """One served model (see the module doc)."""

    def __init__(self, model: Model, *, batcher: Batcher | None = None) -> None:
        self.model = model
        self.name = model.name
        self.version = model.version
        self.target: Target | None = None
        self.batcher: Batcher | None = batcher
        self.state = "building"
        self.reason = ""
        self.generation = 0
        self._recover: trio.Event | None = None
        self._ready_event: trio.Event | None = None
        self._ready_once: trio.Event | None = None
        self.success, self.fail = _Times(), _Times()
        self.compute_input, self.compute_infer, self.compute_output = _Times(), _Times(), _Times()
        self.by_size: dict[int, list[_Times]] = {}
        self.executions = 0
        self.inferences = 0
        self.last_inference_ms = 0
        self._running: dict[object, bool] = {}  # each run in flight: did another overlap it
        self._packs: tuple[Target, Packing, Packing] | None = None  # a target's, for its rows
        self._given: Target | None = None  # a ready target, checked before anything starts
        if model.pipeline is not None:
            self._given = as_target(model.pipeline, inputs=model.inputs, outputs=model.outputs)

    @classmethod
    def ready_now(cls, model: Model, batcher: Batcher | None = None) -> Hosted:
        """A model whose target is ready now (``make_app`` without ``serve``)."""
        hosted = cls(model, batcher=batcher)
        assert hosted._given is not None
        hosted._set_ready(hosted._given)
        return hosted

    def _set_ready(self, target: Target) -> None:
        self.target = target
        self.state = "ready"
        self.reason = ""
        if self._ready_once is not None:
            self._ready_once.set()

    async def wait_ready(self) -> None:
        """Return once the model has been ready (built and warmed) for the first time."""
        if self.state == "building":
            if self._ready_once is None:
                self._ready_once = trio.Event()
            await self._ready_once.wait()

    # -- readiness -------------------------------------------------------------------------

    def unavailable(self) -> str:
        """Why the model can't answer now ('' when it is ready)."""
        if self.state != "ready" or self.target is None:
            return f"{self.state}" + (f": {self.reason}" if self.reason else "")
        bad = [d.name for d in self.target.devices if d.faulted or d.closed]
        return f"devices {', '.join(bad)} unusable" if bad else ""

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.ready_target().inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self.ready_target().outputs

    def ready_target(self) -> Target:
        if self.target is None:
            raise Unavailable(f"model '{self.name}' is not ready ({self.unavailable()})")
        return self.target

    # -- the life of the model -------------------------------------------------------------

    async def keep(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Build, warm and batch the model; rebuild it after each recoverable fault."""
        m = self.model
        first = True
        while True:
            self._recover = trio.Event()
            self._tell("building" if first else f"rebuilding ({self.reason})")
            try:
                async with AsyncExitStack() as stack:
                    obj, target = m.pipeline, self._given
                    if m.build is not None:
                        obj = await stack.enter_async_context(m.build())
                        target = as_target(obj, inputs=m.inputs, outputs=m.outputs)
                    assert target is not None
                    warm = m.warmup
                    if warm is None:
                        warm = m.build is not None or target.platform != "hcqa" or is_model(obj)
                    if warm:
                        self._tell("warming up")
                        await self._warm(target)
                    batcher = None
                    if m.max_batch != 1:
                        batcher = await stack.enter_async_context(self._batcher(target))
                    self.batcher = batcher
                    self._set_ready(target)
                    self._tell("ready")
                    self._wake_waiters()
                    if first:
                        task_status.started()
                        first = False
                    await self._recover.wait()
                    self.state = "recovering"
                    self.batcher = None
            except Exception as exc:
                why = " ".join(f"{type(exc).__name__}: {exc}".split())
                self._tell(f"failed: {why}")
                if first:
                    raise ModelFailed(f"model '{self.name}' failed to load: {why}") from exc
                self.state, self.reason, self.target = "failed", why, None
                self._wake_waiters()
                return
            if m.build is None:  # nothing to rebuild with
                return

    def _tell(self, step: str) -> None:
        if self.model.progress is not None:
            self.model.progress(step)

    async def _warm(self, target: Target) -> None:
        for rows in target.buckets or (1,):
            xs = tuple(np.zeros((rows, *s.sample_shape), s.dtype) for s in target.inputs)
            await target.run(xs)

    def _batcher(self, target: Target) -> AbstractAsyncContextManager[Batcher]:
        m = self.model
        max_batch = m.max_batch if m.max_batch is not None else target.rows
        if max_batch > target.rows:
            raise InvalidCommand(
                f"model '{self.name}': 'max_batch' must be <= {target.rows}, the model's "
                f"largest batch (got {max_batch})"
            )
        gen = self.generation
        pack = Packing(target.inputs)
        unpack_out = Packing(target.outputs)

        async def batch(rows: npt.NDArray[Any]) -> npt.NDArray[Any]:
            t0 = time.perf_counter()
            xs = pack.split(rows)
            t1 = time.perf_counter()
            ys = await self._guarded(target, xs, gen, len(rows))
            t2 = time.perf_counter()
            out = unpack_out.join(ys)
            self._count_batch(len(rows), t1 - t0, t2 - t1, time.perf_counter() - t2)
            return out

        return open_batcher(
            batch,
            max_batch=max_batch,
            max_wait=m.max_wait,
            sample_shape=pack.row_shape,
            dtype=pack.row_dtype,
            depth=target.depth,
            name=self.name,
            serial=target.serial,
        )

    def _wake_waiters(self) -> None:
        if self._ready_event is not None:
            self._ready_event.set()
            self._ready_event = None

    # -- running ---------------------------------------------------------------------------

    async def run(self, xs: Arrays) -> Arrays:
        """The model's outputs for ``xs`` (one array per input, ``n`` rows each)."""
        t0 = time.perf_counter()
        try:
            ys = await self._run(xs)
        except BaseException:
            self.fail.add(time.perf_counter() - t0)
            raise
        self.success.add(time.perf_counter() - t0)
        self.last_inference_ms = int(time.time() * 1e3)
        return ys

    async def _run(self, xs: Arrays) -> Arrays:
        check = self.model.check
        if check is not None:
            try:
                check({s.name: x for s, x in zip(self.inputs, xs, strict=True)})
            except (ValueError, InvalidCommand) as exc:
                raise InvalidCommand(f"model '{self.name}' refused the input: {exc}") from None
        alone = tried = stale = 0
        while True:
            target, gen = await self._current()
            try:
                if len(xs[0]) == 1 and self.batcher is not None and not alone:
                    packs = self._packs
                    if packs is None or packs[0] is not target:  # made once per target
                        packs = self._packs = (
                            target,
                            Packing(target.inputs),
                            Packing(target.outputs),
                        )
                    row = await self.batcher(packs[1].join(xs)[0])
                    return packs[2].split(row[None])
                return await self._chunks(target, xs, gen)
            except _Failed as f:
                if f.retry == "stale" and stale < _REBUILDS:
                    stale += 1
                    continue
                if f.retry == "maybe" and tried < _TRIES:
                    tried += 1
                    continue
                if f.retry == "alone" and not alone:
                    alone = 1
                    continue
                raise f.error from None
            except DeviceClosed:  # the batcher closed under it: a recovery began
                if stale >= _REBUILDS or self.generation == gen:
                    raise
                stale += 1

    async def _current(self) -> tuple[Target, int]:
        """The ready target and its generation; waits while the model recovers, and (up to
        ``_FAULT_WAIT``) for the recovery of a faulted device whose fault is not yet handled."""
        waited = False
        while True:
            if self.state == "recovering":
                await self._ready_wait()
                continue
            if self.state != "ready" or self.target is None:
                raise Unavailable(f"model '{self.name}' is not ready ({self.unavailable()})")
            bad = [d.name for d in self.target.devices if d.faulted or d.closed]
            if not bad:
                return self.target, self.generation
            if waited or self.model.build is None:
                raise Unavailable(f"model '{self.name}': devices {', '.join(bad)} unusable")
            waited = True  # a run in flight will report the fault: wait for the rebuild
            with trio.move_on_after(_FAULT_WAIT):
                await self._ready_wait()

    async def _ready_wait(self) -> None:
        if self._ready_event is None:
            self._ready_event = trio.Event()
        await self._ready_event.wait()

    async def _chunks(self, target: Target, xs: Arrays, gen: int) -> Arrays:
        """Run ``n`` rows in chunks of ``target.rows``, up to ``depth`` chunks at once."""
        n, step = len(xs[0]), target.rows
        starts = list(range(0, n, step))
        outs: list[Arrays | None] = [None] * len(starts)

        async def one(i: int) -> None:
            a = starts[i]
            t0 = time.perf_counter()
            outs[i] = await self._guarded(target, tuple(x[a : a + step] for x in xs), gen, 1)
            self._count_batch(min(step, n - a), 0.0, time.perf_counter() - t0, 0.0)

        if len(starts) == 1:
            await one(0)
        else:
            left = iter(range(len(starts)))
            errors: list[Exception] = []

            async def worker(scope: anyio.CancelScope) -> None:
                try:
                    for i in left:
                        await one(i)
                except Exception as exc:
                    errors.append(exc)
                    scope.cancel()

            async with anyio.create_task_group() as tg:
                for _ in range(min(len(starts), max(1, target.depth))):
                    tg.start_soon(worker, tg.cancel_scope)
            if errors:
                raise errors[0]
        done = [o for o in outs if o is not None]
        return tuple(np.concatenate(parts) for parts in zip(*done, strict=True))

    async def _guarded(self, target: Target, xs: Arrays, gen: int, requests: int) -> Arrays:
        """``target.run(xs)``; a failure becomes a :class:`_Failed` for each caller. The run
        is the owner (:data:`hcqa.errors.work_owner`) of what it queues, so a device fault
        names the run whose own work faulted."""
        if gen != self.generation:
            raise _Failed(DeviceClosed(f"model '{self.name}' is being rebuilt"), "stale")
        me = object()
        self._running[me] = bool(self._running)
        for other in self._running:  # everyone running now overlaps someone
            self._running[other] = self._running[other] or len(self._running) > 1
        token = work_owner.set(me)
        try:
            return await target.run(xs)
        except Exception as exc:
            raise self._failed(target, exc, gen, requests, me) from exc
        finally:
            work_owner.reset(token)
            del self._running[me]

    def _failed(
        self, target: Target, exc: Exception, gen: int, requests: int, me: object
    ) -> _Failed:
        owner = exc.owner if isinstance(exc, DeviceFault) else None
        mine = "alone" if requests > 1 else ""
        if gen != self.generation:  # an earlier failure began a recovery meanwhile
            if owner is me:
                return _Failed(exc, mine)
            if owner is not None or isinstance(exc, DeviceClosed):
                return _Failed(exc, "stale")  # another run's fault, or it never ran
            return _Failed(exc, "maybe")
        faulted = [d for d in target.devices if d.faulted or d.closed]
        if faulted and self.model.build is not None and self._recover is not None:
            self.generation += 1
            self.state, self.reason = "recovering", f"device {faulted[0].name} faulted"
            self._recover.set()
        if isinstance(exc, InvalidCommand | DeviceClosed) and not faulted:
            return _Failed(exc, "")  # the request's own fault, or the server closing
        if faulted and owner is not me:
            if owner is not None:
                return _Failed(exc, "stale")  # another run's work faulted the device
            if self._running.get(me) and requests == 1:
                return _Failed(exc, "maybe")  # unattributed, and not ours alone
        return _Failed(exc, mine)

    def _count_batch(self, n: int, t_in: float, t_infer: float, t_out: float) -> None:
        self.executions += 1
        self.inferences += n
        for times, t in zip(
            (self.compute_input, self.compute_infer, self.compute_output),
            (t_in, t_infer, t_out),
            strict=True,
        ):
            times.add(t)
        row = self.by_size.setdefault(n, [_Times(), _Times(), _Times()])
        for times, t in zip(row, (t_in, t_infer, t_out), strict=True):
            times.add(t)


def error_status(exc: Exception) -> tuple[int, str]:
    """The HTTP status and message for a run's error: 400 for a request the model refuses,
    503 while the model or its devices can't run, 500 for a fault or a model's bug."""
    if isinstance(exc, InvalidCommand):
        return 400, str(exc)
    if isinstance(exc, Unavailable):
        return 503, str(exc)
    if isinstance(exc, DeviceFault):
        return 500, f"DeviceFault: {exc}"
    if isinstance(exc, HcqaError):  # DeviceClosed, a hang
        return 503, f"{type(exc).__name__}: {exc}"
    return 500, f"{type(exc).__name__}: {exc}"
