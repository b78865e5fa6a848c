"""Real architectures for the model tests: the onnx wheel's light model-zoo files with weights.

``onnx/backend/test/data/light/light_*.onnx`` hold nine architectures whose weights are
``ConstantOfShape`` fills. :func:`with_weights` replaces each fill by a seeded random
initializer scaled for its use (He-scaled Conv / Gemm weights, small biases, BatchNorm in sane
ranges), optionally gives the input a symbolic batch (``"N"``) and a smaller picture, and
writes the result next to the test's other files.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

__all__ = ["light_model", "with_weights"]


def light_model(arch: str) -> Path:
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


def with_weights(
    arch: str, out_dir: Path, *, seed: int = 0, batch: bool = False, side: int | None = None
) -> Path:
    """``light_<arch>.onnx`` with seeded random weights (see the module doc); its path."""
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
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[0]]))
            op, index = users.get(node.output[0], ("", 0))
            value = _fill(op, index, shape, rng).astype(np.float32)
            graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
        else:
            keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)
    if batch or side is not None:
        inits_now = {i.name for i in graph.initializer}
        for inp in graph.input:
            if inp.name in inits_now:
                continue
            dims = inp.type.tensor_type.shape.dim
            if batch:
                dims[0].ClearField("dim_value")
                dims[0].dim_param = "N"
            if side is not None:
                dims[2].dim_value = side
                dims[3].dim_value = side
        for out in graph.output:
            out.type.tensor_type.shape.ClearField("dim")
        del graph.value_info[:]
    path = out_dir / f"{arch}{'_n' if batch else ''}{side or ''}_{seed}.onnx"
    onnx.save(model, str(path))
    return path
