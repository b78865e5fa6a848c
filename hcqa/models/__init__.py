"""Models: a tinygrad function or an ONNX file becomes a captured hcqa Graph.

People who serve models bring a model, not kernels. This package takes one from a compiler front
end and hands hcqa what it runs best -- one captured :class:`~hcqa.Graph` per input shape:

1. ``_tinygrad`` (the only module that imports tinygrad, pinned to one version and checked at
   import) runs the function under ``TinyJit`` on the tinygrad device that matches the hcqa
   device (:func:`tinygrad_device`: ``"CPU"`` for ``cpu:N``, ``"CL"`` for ``opencl:N``, set up
   by hcqa for pip's PoCL and a pip-installed clang: ``_toolchain``) and writes down what it
   captured as plain records (``lifted``): kernel sources, buffers, views, Variables.
2. ``model.build`` makes them hcqa objects -- programs from the same source with the front
   end's flags, weights copied once, scratch allocated, arena views as hcqa views -- and
   captures one Graph: copy-ins, every launch, copy-outs.
3. A :class:`Model` checks and copies numpy arrays in, replays, and returns numpy arrays;
   a symbolic batch dimension is served by one graph per batch size (``batch_sizes``), the
   smallest that fits, padded.

:func:`from_tinygrad` and :func:`load_onnx` (``onnx``: tinygrad's ONNX front end, or
onnxruntime's session as one kernel on ``cpu:N``) are the two ways in. This layer sits above
graphs and pipelines (a model may use them all) and below serving and the command line, which
use models (docs/architecture.md, "The layers"); an import-linter contract in pyproject.toml
keeps tinygrad's imports in ``_tinygrad``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import trio

from hcqa import aio
from hcqa.devices import Device
from hcqa.devices.sizes import check_int
from hcqa.errors import InvalidCommand
from hcqa.models.kinds import device_kind
from hcqa.models.lifted import TensorSpec
from hcqa.models.model import Model, ModelStatistics, build
from hcqa.models.onnx import load_onnx
from hcqa.models.pipelined import (
    ModelPipeline,
    ModelPipelineStatistics,
    PipelineStage,
    pipeline,
)

__all__ = [
    "Model",
    "ModelPipeline",
    "ModelPipelineStatistics",
    "ModelStatistics",
    "PipelineStage",
    "TensorSpec",
    "from_tinygrad",
    "load_onnx",
    "pipeline",
    "tinygrad_device",
]


def tinygrad_device(dev: Device) -> str:
    """The tinygrad device whose kernels ``dev`` runs (``"CPU"``, ``"CL"``), set up for use:
    put a model's weights there (``Tensor(w, device=models.tinygrad_device(dev))``)."""
    kind = device_kind(dev)
    from hcqa.models import _tinygrad

    return _tinygrad.prepare(kind)


async def from_tinygrad(
    fn: Callable[..., Any],
    example_inputs: Sequence[np.ndarray],
    *,
    device: Device,
    variables: Mapping[str, tuple[int, int]] | None = None,
    name: str | None = None,
    depth: int = 2,
) -> Model:
    """Capture ``fn`` (tinygrad Tensors in, a Tensor or a tuple of them out; weights realized
    on :func:`tinygrad_device`) and build it on ``device`` as one Graph.

    ``example_inputs``: numpy arrays of the shapes and dtypes every call will have.
    ``variables``: ``{"start_pos": (lo, hi)}``: ``fn`` takes each as a keyword, a bound tinygrad
    Variable; ``await model(x, start_pos=17)`` binds it per call. ``depth``: calls in flight
    at once (the Graph is captured that many times over the same device buffers: see
    :class:`~hcqa.models.Model`)."""
    if aio.asyncio_caller():
        return await aio.call(
            from_tinygrad, fn, example_inputs, device=device, variables=variables, name=name,
            depth=depth,
        )  # fmt: skip
    kind = device_kind(device)
    inputs = check_examples(example_inputs)
    vars_ = check_variables(variables)
    check_int("depth", depth, minimum=1)
    if not callable(fn):
        raise InvalidCommand(f"'fn' must be callable (got {type(fn).__name__})")
    label = name or str(getattr(fn, "__name__", "model"))
    names = [f"input_{i}" for i in range(len(inputs))]
    from hcqa.models import _tinygrad

    try:
        lifted = await trio.to_thread.run_sync(
            lambda: _tinygrad.locked_capture(fn, inputs, kind=kind, variables=vars_, names=names)
        )
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_tinygrad.release)
    bucket = await build(device, lifted, depth=depth)
    return Model(
        name=label,
        device=device,
        inputs=tuple(s for s, _ in lifted.inputs),
        outputs=tuple(s for s, _ in lifted.outputs),
        buckets={0: bucket},
        batched=False,
        backend="tinygrad",
    )


def check_examples(example_inputs: Sequence[Any]) -> list[np.ndarray]:
    if isinstance(example_inputs, np.ndarray) or not isinstance(example_inputs, (list, tuple)):
        raise InvalidCommand(
            "'example_inputs' must be a list or tuple of numpy arrays "
            f"(got {type(example_inputs).__name__})"
        )
    out: list[np.ndarray] = []
    for i, a in enumerate(example_inputs):
        if not isinstance(a, np.ndarray):
            raise InvalidCommand(
                f"example input {i} must be a numpy ndarray (got {type(a).__name__})"
            )
        if a.dtype.kind not in "biuf" or a.dtype.byteorder == ">":
            raise InvalidCommand(
                f"example input {i} must have a native bool, int or float dtype (got {a.dtype})"
            )
        out.append(np.ascontiguousarray(a))
    return out


def check_variables(variables: Mapping[str, tuple[int, int]] | None) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for n, rng in (variables or {}).items():
        if not isinstance(n, str) or not n.isidentifier():
            raise InvalidCommand(f"variable names must be identifiers (got {n!r})")
        ok = isinstance(rng, tuple) and len(rng) == 2
        if not ok or not all(isinstance(x, int) and not isinstance(x, bool) for x in rng):
            raise InvalidCommand(f"variable {n!r} must be a (lo, hi) pair of ints (got {rng!r})")
        lo, hi = rng
        if not 0 <= lo <= hi < 2**31:
            raise InvalidCommand(
                f"variable {n!r} range must satisfy 0 <= lo <= hi < 2**31 (got ({lo}, {hi}))"
            )
        out[n] = (lo, hi)
    return out
