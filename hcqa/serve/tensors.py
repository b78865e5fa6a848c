"""Tensors of the Open Inference Protocol (KServe v2) to and from numpy arrays.

Theory of operation
-------------------
An inference request is a JSON object ``{"id"?, "parameters"?, "inputs": [...],
"outputs"?: [...]}``; each input names a tensor and gives its ``datatype`` (``"FP32"``,
``"INT64"``, ...), its ``shape`` and its elements -- either in ``data`` (a JSON list,
flat or nested, in row-major order) or, with the binary tensor data extension, as raw
little-endian bytes after the JSON: the HTTP header ``Inference-Header-Content-Length``
says where the JSON ends, and each binary input says its byte count in
``parameters.binary_data_size``, in the order of the inputs.

:func:`parse_request` turns a body into an :class:`InferRequest` checked against the
:class:`TensorSpec` of each of the model's inputs (several, named, in any order): the name,
the datatype, the shape (``[n, *sample_shape]``, the batch dimension first, the same ``n``
for every input), the number and kind of the elements (a boolean, a string or a fraction
where integers are expected is refused by position). The datatype must be the model's,
but for integers of another width (``INT64`` token ids for an ``INT32`` input): they are
converted when every value fits, and refused -- naming the tensor, the range they must
fit and the range that came -- when one does not. Every refusal is an
:class:`InputError` 400 that says what was expected and what came.

:func:`encode_response` writes the answer: each requested output either as JSON
``data`` (flat, row-major) or, when the request asked for binary outputs (the request's
``parameters.binary_data_output`` or the output's own ``parameters.binary_data``), as
bytes after the JSON, with ``binary_data_size`` in the output's parameters and the
``Inference-Header-Content-Length`` header giving the JSON's length.

:class:`Packing` puts a model's several tensors' rows into one row of bytes (the batcher
batches rows of one shape) and back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from hcqa.serve.bodies import dumps_array, inflate, loads_json
from hcqa.serve.inputs import InputError, json_kind

__all__ = [
    "DATATYPES",
    "HEADER_LENGTH",
    "InferRequest",
    "Packing",
    "TensorSpec",
    "datatype_of",
    "encode_response",
    "inflate",
    "parse_request",
]

Arrays = tuple[npt.NDArray[Any], ...]
HEADER_LENGTH = "inference-header-content-length"
MAX_TIMEOUT = (1 << 64) - 1  # microseconds: Triton's uint64; larger would overflow a float

#: the protocol's datatypes and the numpy dtypes they are (BYTES and BF16 are not served)
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}


def datatype_of(dtype: npt.DTypeLike) -> str:
    """The protocol's name for a numpy dtype (``float32`` -> ``"FP32"``)."""
    want = np.dtype(dtype)
    for name, dt in DATATYPES.items():
        if dt == want:
            return name
    raise ValueError(f"no Open Inference Protocol datatype for {want}")


@attrs.frozen
class TensorSpec:
    """A model's tensor: its name, datatype and shape of one sample (the batch dim is -1)."""

    name: str
    dtype: np.dtype[Any]
    sample_shape: tuple[int, ...]

    @property
    def datatype(self) -> str:
        return datatype_of(self.dtype)

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *self.sample_shape]}


@attrs.frozen
class InferRequest:
    """A checked request: the input rows and what the answer should look like."""

    id: str | None
    xs: tuple[npt.NDArray[Any], ...]  # [n, *sample_shape], one per model input, in its order
    outputs: tuple[tuple[str, bool], ...] | None  # (name, binary) asked for; None: all
    binary_output: bool  # the request-level default for outputs
    timeout_us: int  # 0: none


def _field(doc: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = doc.get(key)
    if value is not None and not isinstance(value, kind):
        want = "an object" if kind is dict else "a list"
        raise InputError(400, f"{where}'{key}' must be {want} (got {json.dumps(value)[:40]})")
    return value


def _flag(params: dict[str, Any], key: str, where: str) -> bool | None:
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise InputError(
            400, f"{where}parameters '{key}' must be true or false (got {json.dumps(value)[:40]})"
        )
    return value


def parse_request(
    body: bytes,
    header_length: str | None,
    specs: Sequence[TensorSpec],
    outputs: Sequence[str],
) -> InferRequest:
    """The request in ``body`` (JSON, then binary tensors if ``header_length`` is given),
    checked against the model's input ``specs`` and its output names. Binary inputs take
    the bytes after the JSON in the order the request lists them."""
    json_part, binary = _split(body, header_length)
    doc = loads_json(json_part)  # in bounded pieces: see hcqa.serve.bodies
    if not isinstance(doc, dict):
        raise InputError(400, 'expected a JSON object {"inputs": [...]} (got something else)')
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InputError(400, f"'id' must be a string (got {json.dumps(request_id)[:40]})")
    params = _field(doc, "parameters", dict, "") or {}
    binary_output = bool(_flag(params, "binary_data_output", "request "))
    timeout = params.get("timeout", 0)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 0 <= timeout <= MAX_TIMEOUT:
        shown = json.dumps(timeout)
        shown = shown if len(shown) <= 40 else f"{shown[:20]}... ({len(shown)} characters)"
        raise InputError(
            400,
            "request parameters 'timeout' must be an integer number of microseconds >= 0 "
            f"and <= {MAX_TIMEOUT} (got {shown})",
        )
    inputs = _field(doc, "inputs", list, "")
    want = ", ".join(f"'{s.name}'" for s in specs)
    if not inputs:
        tensors = "the tensor" if len(specs) == 1 else "the tensors"
        raise InputError(400, f"expected 'inputs': a list with {tensors} {want}")
    by_name = {s.name: s for s in specs}
    xs: dict[str, npt.NDArray[Any]] = {}
    used = 0
    after = memoryview(binary)
    for i, item in enumerate(inputs):
        if not isinstance(item, dict):
            raise InputError(400, f"inputs[{i}] must be an object with name, datatype, shape, data")
        name = item.get("name")
        spec = by_name.get(name) if isinstance(name, str) else None
        if spec is None or not isinstance(name, str):
            raise InputError(
                400, f"unknown input {json.dumps(name)[:40]} (the model's inputs: {want})"
            )
        if name in xs:
            raise InputError(400, f"input '{name}' is given twice")
        xs[name], took = _input(item, after[used:], spec)
        used += took
    missing = [s.name for s in specs if s.name not in xs]
    if missing:
        raise InputError(
            400, f"expected the inputs {want} (got no {', '.join(repr(m) for m in missing)})"
        )
    rows = {len(x) for x in xs.values()}
    if len(rows) > 1:
        sizes = ", ".join(f"'{k}' {len(v)}" for k, v in xs.items())
        raise InputError(400, f"every input must have the same batch size (got {sizes})")
    if used != len(binary):
        raise InputError(
            400,
            f"the binary data after the JSON is {len(binary)} bytes; the inputs' "
            f"binary_data_size add up to {used}",
        )
    wanted = _field(doc, "outputs", list, "")
    asked: tuple[tuple[str, bool], ...] | None = None
    if wanted is not None:
        pairs = []
        for i, out in enumerate(wanted):
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise InputError(400, f"outputs[{i}] must be an object with a 'name' string")
            if out["name"] not in outputs:
                raise InputError(
                    400,
                    f"unknown output '{out['name']}' (the model's outputs: {', '.join(outputs)})",
                )
            oparams = _field(out, "parameters", dict, f"outputs[{i}] ") or {}
            flag = _flag(oparams, "binary_data", f"output '{out['name']}' ")
            pairs.append((out["name"], binary_output if flag is None else flag))
        asked = tuple(pairs)
    ordered = tuple(xs[s.name] for s in specs)
    return InferRequest(request_id, ordered, asked, binary_output, timeout)


def _split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    text = header_length.strip()
    # isascii: '²' passes isdigit but not int(); 18 digits: int() refuses past 4300
    if not (text.isascii() and text.isdigit() and len(text) <= 18) or int(text) > len(body):
        raise InputError(
            400,
            f"Inference-Header-Content-Length must be a byte count <= the body's {len(body)} "
            f"bytes (got {header_length[:40]!r})",
        )
    n = int(text)
    return body[:n], body[n:]


def _input(doc: Any, binary: bytes | memoryview, spec: TensorSpec) -> tuple[npt.NDArray[Any], int]:
    """The input's array (``[n, *sample_shape]``) and how many binary bytes it used."""
    name = doc.get("name")
    where = f"input '{name}': "
    datatype = doc.get("datatype")
    if datatype != spec.datatype:
        given = DATATYPES.get(datatype) if isinstance(datatype, str) else None
        if given is None or given.kind not in "iu" or spec.dtype.kind not in "iu":
            raise InputError(
                400,
                f"{where}expected datatype {spec.datatype} (got {json.dumps(datatype)[:40]}; "
                "only integer datatypes are converted, when every value fits)",
            )
        x, took = _input(doc, binary, TensorSpec(spec.name, given, spec.sample_shape))
        return _narrowed(x, spec, datatype, where), took
    shape = doc.get("shape")
    want = [-1, *spec.sample_shape]
    if (
        not isinstance(shape, list)
        or len(shape) != len(want)
        or not all(type(d) is int for d in shape)
        or shape[0] < 1
        or list(shape[1:]) != list(spec.sample_shape)
    ):
        raise InputError(
            400,
            f"{where}expected shape {want} with a batch size >= 1 (got {json.dumps(shape)[:60]})",
        )
    count = math.prod(shape)
    params = _field(doc, "parameters", dict, where) or {}
    size = params.get("binary_data_size")
    if size is not None:
        nbytes = count * spec.dtype.itemsize
        if isinstance(size, bool) or not isinstance(size, int) or size != nbytes:
            raise InputError(
                400,
                f"{where}binary_data_size must be {nbytes} bytes for shape {shape} "
                f"{spec.datatype} (got {json.dumps(size)[:40]})",
            )
        if "data" in doc:
            raise InputError(400, f"{where}has both 'data' and binary_data_size")
        if len(binary) < nbytes:
            raise InputError(
                400,
                f"{where}binary_data_size is {nbytes} bytes; only {len(binary)} bytes follow "
                "the JSON",
            )
        raw = np.frombuffer(binary, spec.dtype.newbyteorder("<"), count=count)
        return raw.astype(spec.dtype).reshape(shape), nbytes  # native order, owned
    if "data" not in doc:
        raise InputError(400, f"{where}needs 'data' (or binary data with binary_data_size)")
    flat = _flatten(doc["data"], shape, spec, where)
    if len(flat) != count:
        raise InputError(
            400, f"{where}shape {shape} holds {count} elements (got {len(flat)} in 'data')"
        )
    try:
        with np.errstate(over="ignore"):  # checked below
            x = np.array(flat, dtype=spec.dtype)
    except (OverflowError, ValueError) as exc:
        raise InputError(400, f"{where}data must fit in {spec.datatype} ({exc})") from None
    if spec.dtype.kind in "fc" and not np.isfinite(x).all():
        i = int(np.argmax(~np.isfinite(x)))
        raise InputError(
            400, f"{where}data must fit in {spec.datatype} (got {flat[i]!r} at element {i})"
        )
    return x.reshape(shape), 0


def _narrowed(x: npt.NDArray[Any], spec: TensorSpec, given: str, where: str) -> npt.NDArray[Any]:
    """Integers of another datatype as the model's, when every value fits: else a 400
    naming the tensor, the range it must fit and the range that came."""
    info = np.iinfo(spec.dtype)
    if x.size:
        lo, hi = int(x.min()), int(x.max())
        if lo < info.min or hi > info.max:
            raise InputError(
                400,
                f"{where}{given} values must fit in {spec.datatype}, [{info.min}, {info.max}], "
                f"to be converted (got values in [{lo}, {hi}])",
            )
    return x.astype(spec.dtype)


def _flatten(data: Any, shape: list[int], spec: TensorSpec, where: str) -> list[Any]:
    """``data`` as one flat list of checked elements: flat, or nested exactly as ``shape``."""
    if not isinstance(data, list):
        raise InputError(400, f"{where}'data' must be a list (got {json_kind(data)})")
    kind = spec.dtype.kind
    if data and not isinstance(data[0], list):  # flat: the common case, checked in one pass
        _check_leaves(data, kind, where, "data")
        return data
    level: list[Any] = [data]
    for depth, n in enumerate(shape):
        nxt: list[Any] = []
        for i, v in enumerate(level):
            if not isinstance(v, list) or len(v) != n:
                got = f"a list of {len(v)}" if isinstance(v, list) else json_kind(v)
                raise InputError(
                    400,
                    f"{where}nested 'data' must have shape {shape} (got {got} at depth "
                    f"{depth}, item {i}, where a list of {n} belongs)",
                )
            nxt.extend(v)
        level = nxt
    _check_leaves(level, kind, where, "data")
    return level


def _check_leaves(items: list[Any], kind: str, where: str, path: str) -> None:
    if kind == "b":
        ok: tuple[type, ...] = (bool,)
    elif kind in "iu":
        ok = (int,)
    else:
        ok = (int, float)
    for i, v in enumerate(items):
        if type(v) not in ok:
            need = {"b": "true or false", "i": "integers", "u": "integers"}.get(kind, "numbers")
            what = "a fraction" if type(v) is float else json_kind(v)
            raise InputError(400, f"{where}{path} must be {need} (got {what} at element {i})")


def encode_response(
    model: str,
    version: str,
    request_id: str | None,
    outputs: Sequence[tuple[str, npt.NDArray[Any], bool]],
) -> tuple[bytes, dict[str, str]]:
    """The response body and its extra headers for ``outputs`` (name, array, binary)."""
    doc: dict[str, Any] = {"model_name": model, "model_version": version}
    if request_id is not None:
        doc["id"] = request_id
    tensors: list[bytes] = []  # each output's JSON; data written in bounded pieces
    blobs: list[bytes] = []
    for name, y, binary in outputs:
        t: dict[str, Any] = {"name": name, "datatype": datatype_of(y.dtype), "shape": list(y.shape)}
        if binary:
            blob = y.astype(y.dtype.newbyteorder("<"), copy=False).tobytes()
            t["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
            tensors.append(json.dumps(t).encode())
        else:  # {..., "data": [...]}: the list by dumps_array, so the GIL comes back between pieces
            tensors.append(
                json.dumps(t).encode()[:-1] + b', "data": ' + dumps_array(y.ravel()) + b"}"
            )
    head = json.dumps(doc).encode()[:-1] + b', "outputs": [' + b", ".join(tensors) + b"]}"
    if not blobs:
        return head, {}
    return b"".join([head, *blobs]), {"Inference-Header-Content-Length": str(len(head))}


class Packing:
    """Several tensors' rows as one row of bytes (one tensor: its own rows, unpacked)."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.specs = tuple(specs)
        self.sizes = [math.prod(s.sample_shape) * s.dtype.itemsize for s in self.specs]
        self.single = len(self.specs) == 1
        if self.single:
            self.row_shape: tuple[int, ...] = self.specs[0].sample_shape
            self.row_dtype: np.dtype[Any] = self.specs[0].dtype
        else:
            self.row_shape, self.row_dtype = (sum(self.sizes),), np.dtype(np.uint8)

    def join(self, xs: Arrays) -> npt.NDArray[Any]:
        """``n`` rows of each tensor as ``n`` packed rows."""
        if self.single:
            return xs[0]
        n = len(xs[0])
        rows = np.empty((n, sum(self.sizes)), np.uint8)
        at = 0
        for x, size in zip(xs, self.sizes, strict=True):
            rows[:, at : at + size] = np.ascontiguousarray(x).reshape(n, -1).view(np.uint8)
            at += size
        return rows

    def split(self, rows: npt.NDArray[Any]) -> Arrays:
        """Packed rows back to one array per tensor."""
        if self.single:
            return (rows,)
        n = len(rows)
        out, at = [], 0
        for s, size in zip(self.specs, self.sizes, strict=True):
            part = np.ascontiguousarray(rows[:, at : at + size])
            out.append(part.view(s.dtype).reshape(n, *s.sample_shape))
            at += size
        return tuple(out)
