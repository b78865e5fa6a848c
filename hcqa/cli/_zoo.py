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


def gpt_block(
    out_dir: Path,
    *,
    rows: int,
    seq: int = 32,
    width: int = 128,
    heads: int = 4,
    layers: int = 2,
    seed: int = 0,
) -> Path:
    """A GPT-like decoder stack as an ONNX file (opset 17), seeded weights; its path.

    ``x[rows, seq, width]`` (embedded tokens) through ``layers`` pre-norm blocks: causal
    multi-head self-attention (``heads``, a constant mask) and a ReLU MLP of ``4 * width``, each
    added back to the residual stream; a final LayerNorm."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    d, dh = width, width // heads
    inits: list[Any] = []
    nodes: list[Any] = []

    def weight(name: str, shape: tuple[int, ...], scale: float) -> str:
        value = (rng.standard_normal(shape) * scale).astype(np.float32)
        inits.append(numpy_helper.from_array(value, name))
        return name

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    def node(op: str, ins: list[str], out: str, **attrs: Any) -> str:
        nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    def norm(x: str, tag: str) -> str:
        g = const(f"{tag}.g", np.ones(d, np.float32))
        b = const(f"{tag}.b", np.zeros(d, np.float32))
        return node("LayerNormalization", [x, g, b], f"{tag}.out", axis=-1)

    mask = np.triu(np.full((seq, seq), -1e9, np.float32), k=1)
    const("mask", mask)
    const("scale", np.array(1.0 / math.sqrt(dh), np.float32))
    const("heads_shape", np.array([rows, seq, heads, dh], np.int64))
    const("model_shape", np.array([rows, seq, d], np.int64))
    x = "x"
    for i in range(layers):
        p = f"l{i}"
        h = norm(x, f"{p}.ln1")
        qkv = {}
        for t in "qkv":
            m = node("MatMul", [h, weight(f"{p}.w{t}", (d, d), d**-0.5)], f"{p}.{t}")
            r = node("Reshape", [m, "heads_shape"], f"{p}.{t}.heads")
            perm = [0, 2, 3, 1] if t == "k" else [0, 2, 1, 3]
            qkv[t] = node("Transpose", [r], f"{p}.{t}.t", perm=perm)
        s = node("MatMul", [qkv["q"], qkv["k"]], f"{p}.scores")
        s = node("Mul", [s, "scale"], f"{p}.scaled")
        s = node("Add", [s, "mask"], f"{p}.masked")
        a = node("Softmax", [s], f"{p}.attn", axis=-1)
        o = node("MatMul", [a, qkv["v"]], f"{p}.mix")
        o = node("Transpose", [o], f"{p}.mix.t", perm=[0, 2, 1, 3])
        o = node("Reshape", [o, "model_shape"], f"{p}.mix.r")
        o = node("MatMul", [o, weight(f"{p}.wo", (d, d), d**-0.5)], f"{p}.proj")
        x = node("Add", [x, o], f"{p}.res1")
        h = norm(x, f"{p}.ln2")
        f = node("MatMul", [h, weight(f"{p}.w1", (d, 4 * d), math.sqrt(2.0 / d))], f"{p}.up")
        f = node("Add", [f, weight(f"{p}.b1", (4 * d,), 0.02)], f"{p}.up.b")
        f = node("Relu", [f], f"{p}.relu")
        f = node("MatMul", [f, weight(f"{p}.w2", (4 * d, d), (4 * d) ** -0.5)], f"{p}.down")
        x = node("Add", [x, f], f"{p}.res2")
    norm(x, "final")
    graph = helper.make_graph(
        nodes,
        "gpt",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, seq, d])],
        [helper.make_tensor_value_info("final.out", TensorProto.FLOAT, [rows, seq, d])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = out_dir / f"gpt_b{rows}_s{seq}_d{width}_{seed}.onnx"
    onnx.save(model, str(path))
    return path
