"""What a served model runs: anything ``serve()`` takes, as one shape of batch target.

Theory of operation
-------------------
``serve()`` takes a :class:`hcqa.models.Model` (a captured graph), a :class:`~hcqa.Pipeline`
or :class:`~hcqa.ProcessPipeline`, a list of pipelines over the same rows in batches of
different sizes (buckets), or any async batch callable. :func:`as_target` turns each into
a :class:`Target`, the one shape the server works with:

- ``inputs`` / ``outputs``: the tensors, each a :class:`~hcqa.serve.tensors.TensorSpec`
  (name, dtype, the shape of one row). A model gives its own names and shapes (its first
  dimension is the batch: ``None``, or a fixed size it is padded to); a pipeline has one
  input ``input`` and one output ``output``; a callable declares them (``inputs=``,
  ``outputs=``: ``models.TensorSpec``-like objects or ``(name, shape, dtype)`` triples,
  shapes with the batch dimension first). A symbolic dimension past the batch is refused:
  a row must have one size.
- ``rows``: the most rows one run takes; ``buckets``: the sizes it runs unpadded.
- ``run(xs)``: one array per input, ``n <= rows`` rows each, to one array per output,
  ``n`` rows each -- padded to the smallest bucket that holds ``n`` (for pipelines and
  fixed-size models; a ``Model`` with captured sizes pads itself) and sliced back. The
  result is always a copy the caller owns (a pipeline lends its output only until its next
  run).
- ``devices``: what the model runs on (readiness reads their fault state).
- ``depth``: runs in flight at once (a ``Model``'s slots: 2 by default); ``serial``: they
  run one after another (a ``Model``'s do: its slots share its buffers), which the batcher
  uses to let a batch grow while the one before it runs.

Anything else is an :class:`~hcqa.errors.InvalidCommand` that names what ``serve`` takes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from hcqa.devices.base import Device
from hcqa.errors import InvalidCommand
from hcqa.serve.tensors import TensorSpec, datatype_of

__all__ = ["Target", "as_target", "is_model", "spec_of"]

Arrays = tuple[npt.NDArray[Any], ...]
_DEFAULT_ROWS = 32  # the batch of a model or callable that takes any number of rows


@attrs.frozen(kw_only=True)
class Target:
    """One served model's batch target (see the module doc)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    rows: int
    buckets: tuple[int, ...]
    depth: int
    run: Callable[[Arrays], Awaitable[Arrays]]
    devices: tuple[Device, ...] = ()
    platform: str = "hcqa"
    backend: str = "hcqa"
    source: Any = None  # what it was made from (statistics())
    serial: bool = False  # runs its batches one after another (a models.Model)

    def statistics(self) -> Any:
        stats = getattr(self.source, "statistics", None)
        return stats() if callable(stats) else None


def spec_of(value: Any, where: str) -> tuple[str, tuple[int | None, ...], np.dtype[Any]]:
    """(name, shape, dtype) of a ``models.TensorSpec``-like object or a triple."""
    if isinstance(value, tuple) and len(value) == 3:
        name, shape, dtype = value
    elif all(hasattr(value, a) for a in ("name", "shape", "dtype")):
        name, shape, dtype = value.name, value.shape, value.dtype
    else:
        raise InvalidCommand(
            f"{where} must be a models.TensorSpec or a (name, shape, dtype) triple "
            f"(got {type(value).__name__})"
        )
    if not isinstance(name, str) or not name:
        raise InvalidCommand(f"{where}'s name must be a non-empty string (got {name!r})")
    try:
        dt = np.dtype(dtype)
        datatype_of(dt)
    except (TypeError, ValueError):
        raise InvalidCommand(
            f"{where} ({name!r}) must have a numeric or bool dtype (got {dtype!r})"
        ) from None
    if not isinstance(shape, Sequence) or not all(
        d is None or (isinstance(d, int | np.integer) and not isinstance(d, bool) and d >= 1)
        for d in shape
    ):
        raise InvalidCommand(f"{where} ({name!r}) shape must be ints >= 1 or None (got {shape!r})")
    return name, tuple(None if d is None else int(d) for d in shape), dt


def _rows_of(
    specs: Sequence[tuple[str, tuple[int | None, ...], np.dtype[Any]]], what: str
) -> tuple[int | None, tuple[TensorSpec, ...]]:
    """The fixed batch size (None: symbolic) and each tensor's row spec."""
    firsts: set[int | None] = set()
    rows: list[TensorSpec] = []
    for name, shape, dt in specs:
        if not shape:
            raise InvalidCommand(
                f"{what} {name!r} must have a batch dimension first (got a scalar); serve "
                "runs batches of rows"
            )
        for k, d in enumerate(shape[1:], 1):
            if d is None:
                raise InvalidCommand(
                    f"{what} {name!r} dimension {k} must have a fixed size (got a symbolic "
                    f"one in {list(shape)}); serve needs one size per row"
                )
        firsts.add(shape[0])
        rows.append(TensorSpec(name, dt, tuple(d for d in shape[1:] if d is not None)))
    if len(firsts) > 1:
        raise InvalidCommand(
            f"every {what} must have the same batch dimension (got {sorted(map(str, firsts))})"
        )
    names = [r.name for r in rows]
    if len(set(names)) != len(names):
        raise InvalidCommand(f"{what} names must differ (got {names})")
    return next(iter(firsts)), tuple(rows)


def _is_async_callable(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004
    return call is not None and inspect.iscoroutinefunction(call)


def _is_pipeline(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("in_shape", "dtype", "depth")) and callable(obj)


def is_model(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("inputs", "outputs", "batch_sizes")) and callable(obj)


def _padded(xs: Arrays, rows: int) -> Arrays:
    n = len(xs[0])
    if n == rows:
        return xs
    out = []
    for x in xs:
        p = np.zeros((rows, *x.shape[1:]), x.dtype)
        p[:n] = x
        out.append(p)
    return tuple(out)


def _tuple(y: Any, count: int, what: str) -> Arrays:
    ys = tuple(y) if isinstance(y, tuple | list) else (y,)
    if len(ys) != count:
        raise InvalidCommand(f"{what} must return {count} outputs (got {len(ys)})")
    return tuple(np.asarray(v) for v in ys)


def _owned(ys: Arrays, n: int, outputs: tuple[TensorSpec, ...], what: str) -> Arrays:
    """The first ``n`` rows of each output, copied, checked against the specs."""
    out = []
    for y, spec in zip(ys, outputs, strict=True):
        if y.ndim < 1 or len(y) < n or y.shape[1:] != spec.sample_shape:
            raise InvalidCommand(
                f"{what} output {spec.name!r} must be {spec.dtype}[{n}, "
                f"{', '.join(map(str, spec.sample_shape))}] (got {y.dtype}{list(y.shape)})"
            )
        out.append(np.array(y[:n], dtype=spec.dtype))
    return tuple(out)


def _devices(obj: Any) -> tuple[Device, ...]:
    found: list[Any] = list(getattr(obj, "devices", None) or ())
    found.append(getattr(obj, "device", None))
    found += [getattr(s, "device", None) for s in getattr(obj, "stages", ())]
    return tuple({id(d): d for d in found if isinstance(d, Device)}.values())


def _from_model(model: Any) -> Target:
    ins = [spec_of(s, "a model input") for s in model.inputs]
    outs = [spec_of(s, "a model output") for s in model.outputs]
    fixed, inputs = _rows_of(ins, "model input")
    _, outputs = _rows_of(outs, "model output")
    buckets = tuple(sorted(int(b) for b in model.batch_sizes))
    if fixed is not None:
        rows, buckets = fixed, (fixed,)
    else:
        rows = buckets[-1] if buckets else _DEFAULT_ROWS
    what = f"model {getattr(model, 'name', '')!r}".replace(" ''", "")

    async def run(xs: Arrays) -> Arrays:
        n = len(xs[0])
        if fixed is not None:
            xs = _padded(xs, fixed)
        y = await model(*xs)
        return _owned(_tuple(y, len(outputs), what), n, outputs, what)

    backend = str(getattr(model, "backend", "tinygrad"))
    return Target(
        inputs=inputs,
        outputs=outputs,
        rows=rows,
        buckets=buckets or (rows,),
        depth=int(getattr(model, "depth", 1)),
        run=run,
        devices=_devices(model),
        platform="onnxruntime_onnx" if backend == "onnxruntime" else "hcqa",
        backend=backend,
        source=model,
        serial=True,
    )


def _from_pipelines(pipes: list[Any], inputs: Any, outputs: Any) -> Target:
    for p in pipes:
        if not _is_pipeline(p):
            raise InvalidCommand(
                "a list to serve must hold Pipelines or ProcessPipelines over the same rows "
                f"(got {[type(q).__name__ for q in pipes]})"
            )
    pipes = sorted(pipes, key=lambda p: int(p.in_shape[0]))
    first = pipes[0]
    for p in pipes:
        if len(p.in_shape) < 1:
            raise InvalidCommand(f"the pipeline needs a batch dimension (got in_shape {[]})")
        if tuple(p.in_shape[1:]) != tuple(first.in_shape[1:]) or p.dtype != first.dtype:
            raise InvalidCommand(
                f"the pipelines must take the same rows, {first.dtype}{list(first.in_shape[1:])} "
                f"(got {p.dtype}{list(p.in_shape[1:])})"
            )
    buckets = tuple(int(p.in_shape[0]) for p in pipes)
    if len(set(buckets)) != len(buckets):
        raise InvalidCommand(f"the pipelines' batch dimensions must differ (got {list(buckets)})")
    if hasattr(first, "out_shape"):
        out_shape, out_dtype = tuple(first.out_shape), np.dtype(first.out_dtype)
    else:  # a ProcessPipeline
        out_shape, out_dtype = tuple(first.shapes[-1][0]), np.dtype(first.shapes[-1][1])
    in_name = "input" if inputs is None else _one_name(inputs, "inputs")
    out_name = "output" if outputs is None else _one_name(outputs, "outputs")
    in_spec = TensorSpec(in_name, np.dtype(first.dtype), tuple(first.in_shape[1:]))
    out_spec = TensorSpec(out_name, out_dtype, out_shape[1:])

    async def run(xs: Arrays) -> Arrays:
        n = len(xs[0])
        pipe = next(p for p in pipes if int(p.in_shape[0]) >= n)
        (x,) = _padded(xs, int(pipe.in_shape[0]))
        y = np.asarray(await pipe(x))
        return (np.array(y[:n]),)  # a copy: the pipeline lends y until its next run

    devices: dict[int, Device] = {}
    for p in pipes:
        devices.update((id(d), d) for d in _devices(p))
    return Target(
        inputs=(in_spec,),
        outputs=(out_spec,),
        rows=buckets[-1],
        buckets=buckets,
        depth=max(int(p.depth) for p in pipes),
        run=run,
        devices=tuple(devices.values()),
        source=pipes[-1],
    )


def _one_name(specs: Any, what: str) -> str:
    if isinstance(specs, str):
        return specs
    names = [spec_of(s, f"one of '{what}'")[0] for s in specs]
    if len(names) != 1:
        raise InvalidCommand(f"a pipeline has one of '{what}' (got {len(names)}: {names})")
    return names[0]


def _from_callable(fn: Any, inputs: Any, outputs: Any, max_batch: int | None) -> Target:
    missing = [k for k, v in (("inputs", inputs), ("outputs", outputs)) if not v]
    if missing:
        raise InvalidCommand(
            f"an async batch callable needs {' and '.join(repr(m) for m in missing)}: "
            "declare its tensors, e.g. inputs=[('x', (None, 4), 'float32')]"
        )
    fixed, ins = _rows_of([spec_of(s, "an input") for s in inputs], "input")
    _, outs = _rows_of([spec_of(s, "an output") for s in outputs], "output")
    rows = fixed or max_batch or _DEFAULT_ROWS
    what = f"the batch callable {getattr(fn, '__name__', type(fn).__name__)!r}"

    async def run(xs: Arrays) -> Arrays:
        n = len(xs[0])
        if fixed is not None:
            xs = _padded(xs, fixed)
        y = await fn(*xs)
        return _owned(_tuple(y, len(outs), what), n, outs, what)

    return Target(
        inputs=ins,
        outputs=outs,
        rows=rows,
        buckets=(rows,) if fixed else (),
        depth=1,
        run=run,
        devices=_devices(fn),
        source=fn,
    )


def as_target(
    obj: Any, *, inputs: Any = None, outputs: Any = None, max_batch: int | None = None
) -> Target:
    """``obj`` (a model, pipeline(s) or async batch callable) as a :class:`Target`."""
    if isinstance(obj, Target):
        return obj
    if isinstance(obj, list | tuple):
        if not obj:
            raise InvalidCommand("serve needs a model or pipeline (got an empty list)")
        return _from_pipelines(list(obj), inputs, outputs)
    if _is_pipeline(obj):
        return _from_pipelines([obj], inputs, outputs)
    if is_model(obj):
        if inputs is not None or outputs is not None:
            raise InvalidCommand(
                "a models.Model names its own tensors: leave 'inputs' and 'outputs' unset"
            )
        return _from_model(obj)
    if _is_async_callable(obj):
        return _from_callable(obj, inputs, outputs, max_batch)
    if callable(obj):
        name = getattr(obj, "__name__", None) or type(obj).__name__
        got = f"the plain callable {name!r}: define it with async def"
    else:
        got = type(obj).__name__
    raise InvalidCommand(
        "serve takes a models.Model, a Pipeline or ProcessPipeline, a list of pipelines, or "
        f"an async batch callable (got {got})"
    )
