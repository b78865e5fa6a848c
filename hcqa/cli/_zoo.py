"""Real architectures with seeded weights, made in code: the onnx wheel's light model zoo.

Theory of operation
-------------------
``onnx/backend/test/data/light/light_*.onnx`` (shipped inside the ``onnx`` wheel, so nothing is
downloaded) hold nine model-zoo architectures -- SqueezeNet, ResNet-50, ... -- whose weights are
``ConstantOfShape`` fills of zeros. :func:`with_weights` replaces each fill by a seeded random
initializer scaled for its use (He-scaled Conv / Gemm weights, small biases, BatchNorm in sane
ranges), drops the fills' shape tensors (onnxruntime warns about every unused initializer), can
give the input a symbolic batch (``"N"``), a fixed number of rows or a smaller picture, and
writes the result: the same seed gives the same bytes, so hcqa's model cache (keyed by the
file's bytes) finds it again in the next run.

``hcqa demo --model squeezenet`` builds its model here; the tests and ``bench/`` use it too
(``tests/_onnx_zoo.py``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["light_model", "with_weights"]


def light_model(arch: str) -> Path:
    """The onnx wheel's ``light_<arch>.onnx`` (zero weights)."""
    import onnx

    return Path(os.path.dirname(onnx.__file__)) / "backend/test/data/light" / f"light_{arch}.onnx"


def _fill(op: str, index: int, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if op in ("Conv", "Gemm") and index == 1:
        fan_in = math.prod(shape[1:]) if op == "Conv" else shape[-1]
        return rng.normal(0.0, math.sqrt(2.0 / max(fan_in, 1)), shape)
    if op == "BatchNormalization":
        if index == 1:
            return rng.uniform(0.8, 1.2, shape)
        if index == 4:
            return rng.uniform(0.5, 1.5, shape)
    return rng.normal(0.0, 0.05, shape)


def _reshape_input(graph: Any, *, batch: bool, rows: int | None, side: int | None) -> None:
    """The first non-initializer input's batch (symbolic or ``rows``) and picture side; the
    outputs' shapes are cleared (onnx's shape inference and the runtimes derive them again)."""
    inits = {i.name for i in graph.initializer}
    for inp in graph.input:
        if inp.name in inits:
            continue
        dims = inp.type.tensor_type.shape.dim
        if batch:
            dims[0].ClearField("dim_value")
            dims[0].dim_param = "N"
        elif rows is not None:
            dims[0].dim_value = rows
        if side is not None:
            dims[2].dim_value = side
            dims[3].dim_value = side
    for out in graph.output:
        out.type.tensor_type.shape.ClearField("dim")
    del graph.value_info[:]


def with_weights(
    arch: str,
    out_dir: Path,
    *,
    seed: int = 0,
    batch: bool = False,
    side: int | None = None,
    rows: int | None = None,
) -> Path:
    """``light_<arch>.onnx`` with seeded random weights (see the module doc); its path.

    ``batch``: a symbolic first dimension ``"N"``; else ``rows`` fixes it (the file has 1).
    ``side``: the input picture's height and width (SqueezeNet needs at least 40)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(light_model(arch)))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    users: dict[str, tuple[str, int]] = {}
    for node in graph.node:
        for k, name in enumerate(node.input):
            users.setdefault(name, (node.op_type, k))
    rng = np.random.default_rng(seed)
    keep = []
    shape_tensors: set[str] = set()
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[0]]))
            op, index = users.get(node.output[0], ("", 0))
            value = _fill(op, index, shape, rng).astype(np.float32)
            graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
            shape_tensors.add(node.input[0])
        else:
            keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)
    still_read = {name for node in keep for name in node.input}
    unused = [i for i in graph.initializer if i.name in shape_tensors - still_read]
    for init in unused:
        graph.initializer.remove(init)
    for inp in [i for i in graph.input if i.name in shape_tensors - still_read]:
        graph.input.remove(inp)
    if batch or rows is not None or side is not None:
        _reshape_input(graph, batch=batch, rows=rows, side=side)
    tag = "_n" if batch else (f"_b{rows}" if rows is not None else "")
    path = out_dir / f"{arch}{tag}{side or ''}_{seed}.onnx"
    onnx.save(model, str(path))
    return path
