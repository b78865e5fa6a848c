"""ONNX files as models: tinygrad's kernels on any device, or onnxruntime as one kernel on cpu:N.

Theory of operation
-------------------
:func:`load_onnx` reads the file with the ``onnx`` package first (a file that is not ONNX, a
symbolic dimension other than the first, an input type numpy has no name for: each refused
here, naming the file and the input), so nothing is captured for a model that can't run.

* ``backend="tinygrad"``: every operator is checked against tinygrad's ONNX front end (an
  unknown one is refused by name and node), then, per batch size, a fresh ``OnnxRunner`` (it
  caches shapes per runner) is captured by :func:`hcqa.models.from_tinygrad`'s machinery and
  built as its own Graph. Works on every device kind hcqa lifts to.
* ``backend="onnxruntime"``: one ``InferenceSession`` (one intra-op thread: the device is the
  unit of parallelism) becomes one Python kernel on ``cpu:N``; the engine thread calls it with
  numpy views of the input and output buffers, and ``session.run`` releases the GIL while it
  computes. Each batch size gets its buffers and ``depth`` Graphs over them (copy-in, the
  kernel, copy-out: the model's slots, see :class:`~hcqa.models.Model`), each with a kernel
  of its own.
  An input onnxruntime refuses at run time (an index out of range) is the caller's error, not
  the device's: the kernel records it, writes nothing, and the call raises InvalidCommand
  naming onnxruntime's message; the device and the model go on answering.

A symbolic first dimension (``"N"``, or unnamed) is the batch: ``batch_sizes`` graphs are
captured, and a call takes the smallest that holds its rows (:class:`~hcqa.models.Model`). A
model with fixed shapes gets one graph and ``batch_sizes == ()``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import trio

from hcqa import aio
from hcqa.devices import Device
from hcqa.devices.sizes import check_int
from hcqa.errors import InvalidCommand, install_hint
from hcqa.graph import capture
from hcqa.models import cache
from hcqa.models.kinds import device_kind
from hcqa.models.lifted import Lifted, TensorSpec
from hcqa.models.model import Bucket, Model, Slot, build, copy_in, copy_out

__all__ = ["load_onnx"]

BACKENDS = ("tinygrad", "onnxruntime")


def _read(path: Path) -> Any:
    try:
        import onnx
    except ImportError:
        raise InvalidCommand(
            "load_onnx needs the onnx package: pip install -e '.[models]' in the hcqa checkout"
        ) from None
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise InvalidCommand(
            f"{str(path)!r} is not an ONNX model: {type(exc).__name__}: {exc}"
        ) from None


def _specs(model: Any, path: Path) -> tuple[list[TensorSpec], bool]:
    """The graph's inputs (initializers left out) and whether the first dimension is a batch."""
    from onnx import TensorProto, helper

    graph = model.graph
    inits = {i.name for i in graph.initializer}
    specs: list[TensorSpec] = []
    batched: bool | None = None
    for inp in graph.input:
        if inp.name in inits:
            continue
        where = f"{str(path)!r} input {inp.name!r}"
        t = inp.type.tensor_type
        if not inp.type.HasField("tensor_type") or t.elem_type == TensorProto.UNDEFINED:
            raise InvalidCommand(f"{where} must be a tensor (got {inp.type})")
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type))
        except Exception:
            raise InvalidCommand(
                f"{where}: element type {t.elem_type} has no numpy dtype"
            ) from None
        if dtype.kind not in "biuf":
            raise InvalidCommand(f"{where} must hold numbers or bools (got {dtype})")
        dims: list[int | None] = []
        for k, d in enumerate(t.shape.dim):
            symbolic = not d.HasField("dim_value") or d.dim_value <= 0
            if symbolic and k != 0:
                raise InvalidCommand(
                    f"{where}: only the first dimension may be symbolic (the batch); "
                    f"dimension {k} is {d.dim_param or '?'}"
                )
            dims.append(None if symbolic else int(d.dim_value))
        this = bool(dims) and dims[0] is None
        if batched is not None and this != batched:
            raise InvalidCommand(f"{where}: every input or none must have a batch dimension")
        batched = this
        specs.append(TensorSpec(inp.name, tuple(dims), dtype))
    if not specs:
        raise InvalidCommand(f"{str(path)!r} has no inputs to feed")
    return specs, bool(batched)


def _check_sizes(batch_sizes: Sequence[int]) -> tuple[int, ...]:
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence):
        raise InvalidCommand(f"'batch_sizes' must be a sequence of ints (got {batch_sizes!r})")
    out = sorted(set(batch_sizes))
    if not out or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in out):
        raise InvalidCommand(f"'batch_sizes' must be ints >= 1 (got {tuple(batch_sizes)!r})")
    if out[-1] > 65536:
        raise InvalidCommand(f"'batch_sizes' must be <= 65536 (got {out[-1]})")
    return tuple(out)


def _examples(specs: Sequence[TensorSpec], rows: int) -> list[np.ndarray]:
    return [np.zeros(tuple(rows if d is None else d for d in s.shape), s.dtype) for s in specs]


async def load_onnx(
    path: str | os.PathLike[str],
    *,
    device: Device,
    backend: str = "tinygrad",
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    name: str | None = None,
    depth: int = 2,
    progress: Callable[[int, int], None] | None = None,
) -> Model:
    """Load the ONNX model at ``path`` onto ``device`` as captured graphs (see the module doc).

    ``depth``: calls in flight at once (each batch size captured that many times over the same
    device buffers: call ``k + 1`` is queued while call ``k`` runs). ``progress(k, n)`` is
    called before the ``k``-th of the ``n`` batch sizes is built (``hcqa serve`` shows it)."""
    if aio.asyncio_caller():
        return await aio.call(
            load_onnx, path, device=device, backend=backend, batch_sizes=batch_sizes, name=name,
            depth=depth, progress=progress,
        )  # fmt: skip
    kind = device_kind(device)
    if backend not in BACKENDS:
        raise InvalidCommand(f"'backend' must be one of {BACKENDS} (got {backend!r})")
    check_int("depth", depth, minimum=1)
    if backend == "onnxruntime" and kind != "cpu":
        raise InvalidCommand(
            f"backend 'onnxruntime' runs as a Python kernel on cpu:N (got {device.name}); "
            "use backend='tinygrad' there"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidCommand(f"'path' must be a str or os.PathLike (got {type(path).__name__})")
    p = Path(path)
    if not p.is_file():
        raise InvalidCommand(f"ONNX file {str(p)!r} must be a readable file (got none there)")
    sizes = _check_sizes(batch_sizes)
    model = await trio.to_thread.run_sync(_read, p)
    specs, batched = _specs(model, p)
    label = name or p.stem
    buckets_for = sizes if batched else (0,)
    buckets: dict[int, Bucket] = {}
    outputs: tuple[TensorSpec, ...] = ()
    if backend == "tinygrad":
        weights: dict[bytes, Any] = {}  # shared by the buckets
        try:
            for k, rows in enumerate(buckets_for, 1):
                if progress is not None:
                    progress(k, len(buckets_for))
                lifted = await _lifted(p, model, _examples(specs, max(rows, 1)), kind)
                buckets[rows] = await build(device, lifted, weights, depth=depth)
                outputs = tuple(s for s, _ in lifted.outputs)
        finally:
            if "hcqa.models._tinygrad" in sys.modules:  # not imported when all came from cache
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(sys.modules["hcqa.models._tinygrad"].release)
    else:
        session = await trio.to_thread.run_sync(_session, p)
        for k, rows in enumerate(buckets_for, 1):
            if progress is not None:
                progress(k, len(buckets_for))
            buckets[rows], outputs = await _ort_bucket(device, session, specs, max(rows, 1), depth)
    if batched:
        for s in outputs:
            if not s.shape or s.shape[0] != max(buckets_for):
                raise InvalidCommand(
                    f"{str(p)!r} output {s.name!r} must keep the batch as its first dimension "
                    f"(got shape {s.shape} for a batch of {max(buckets_for)})"
                )
        outputs = tuple(TensorSpec(s.name, (None, *s.shape[1:]), s.dtype) for s in outputs)
    return Model(
        name=label,
        device=device,
        inputs=tuple(specs),
        outputs=outputs,
        buckets={max(r, 1): b for r, b in buckets.items()},
        batched=batched,
        backend=backend,
    )


async def _lifted(path: Path, model: Any, examples: list[np.ndarray], kind: str) -> Lifted:
    """tinygrad's capture of ``path`` for ``examples``: from hcqa's cache when this file, this
    tinygrad and these shapes were captured before (then tinygrad is not even imported)."""
    version = _installed("tinygrad")
    shapes = [(e.shape, e.dtype.str) for e in examples]
    reader = cache.reader_digest()  # a changed reader never reuses an older reading
    key = await trio.to_thread.run_sync(
        functools.partial(cache.key_for, "tinygrad", version, reader, kind, shapes, file=path)
    )
    hit = await trio.to_thread.run_sync(cache.load, key)
    if hit is not None:
        return hit
    from hcqa.models import _tinygrad

    await trio.to_thread.run_sync(_tinygrad.check_onnx_ops, model, str(path))
    nodes = [(n.name, n.op_type) for n in model.graph.node]
    lifted: Lifted = await trio.to_thread.run_sync(
        functools.partial(
            _tinygrad.locked_onnx_capture, str(path), examples, kind=kind, nodes=nodes
        )
    )
    await trio.to_thread.run_sync(cache.store, key, lifted)
    return lifted


def _installed(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _session(path: Path) -> Any:
    try:
        import onnxruntime as ort
    except ImportError:
        raise InvalidCommand(
            f"backend 'onnxruntime' needs onnxruntime: {install_hint('models')}"
        ) from None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise InvalidCommand(
            f"onnxruntime can't load {str(path)!r}: {type(exc).__name__}: {exc}"
        ) from None


async def _ort_bucket(
    device: Device, session: Any, specs: Sequence[TensorSpec], rows: int, depth: int
) -> tuple[Bucket, tuple[TensorSpec, ...]]:
    """``depth`` graphs for ``rows`` (the bucket's slots, over the same device buffers), each:
    copy-in, ``session.run`` as one Python kernel, copy-out. Each slot has its own kernel, so
    an input onnxruntime refuses is recorded on the slot whose call it was."""
    examples = _examples(specs, rows)
    names = [s.name for s in specs]
    try:
        probe = await trio.to_thread.run_sync(
            lambda: session.run(None, dict(zip(names, examples, strict=True)))
        )
    except Exception as exc:
        raise InvalidCommand(f"onnxruntime could not run the model: {exc}") from None
    out_names = [o.name for o in session.get_outputs()]
    outputs = tuple(TensorSpec(n, r.shape, r.dtype) for n, r in zip(out_names, probe, strict=True))
    n_out = len(outputs)
    ins = [device.alloc(shape=e.shape, dtype=e.dtype) for e in examples]
    shapes = [tuple(int(d or 0) for d in s.shape) for s in outputs]
    outs = [
        device.alloc(shape=shape, dtype=s.dtype) for shape, s in zip(shapes, outputs, strict=True)
    ]
    slots: list[Slot] = []
    for _ in range(depth):
        host_in = tuple(np.zeros(e.shape, e.dtype) for e in examples)
        host_out = tuple(np.zeros(shape, s.dtype) for shape, s in zip(shapes, outputs, strict=True))
        holder: list[Slot] = []  # the slot whose kernel this is, once captured
        prog = await device.program_async(
            "onnxruntime",
            functools.partial(_ort_run, session, names, n_out, holder),
            writes=tuple(range(n_out)),
            reads=tuple(range(n_out, n_out + len(specs))),
        )
        with capture() as graph:
            for buf, host in zip(ins, host_in, strict=True):
                copy_in(buf, host)
            prog(*outs, *ins)
            for buf, host in zip(outs, host_out, strict=True):
                copy_out(buf, host)
        holder.append(Slot(graph, host_in, host_out))
        slots.append(holder[0])
    bucket = Bucket(
        slots=slots,
        variables={},
        launches=1,
        programs=1,
        weight_bytes=0,
        scratch_bytes=0,
        buffers=[*ins, *outs],
    )
    return bucket, outputs


def _ort_run(
    session: Any, names: list[str], n_out: int, holder: list[Slot], *bufs: np.ndarray
) -> None:
    """The Python kernel: ``session.run`` on the input buffers, into the output buffers."""
    feeds = {n: b for n, b in zip(names, bufs[n_out:], strict=True)}
    try:
        got = session.run(None, feeds)
    except Exception as exc:  # the input's fault (an index out of range): not the device's
        holder[0].failure = f"onnxruntime: {type(exc).__name__}: {exc}"
        return
    for dest, out in zip(bufs[:n_out], got, strict=True):
        dest[...] = out
