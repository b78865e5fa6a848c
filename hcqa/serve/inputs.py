"""Request bodies to arrays for ``hcqa.serve``: plain-language errors, never a 500.

Theory of operation
-------------------
A body is either raw little-endian bytes or JSON ``{"inputs": ...}``. Raw bytes are one
sample when they are exactly one sample's size, else a batch of ``n`` samples when they
are a multiple of it. JSON is parsed by :func:`hcqa.serve.bodies.loads_json` (in bounded
pieces; it refuses ``NaN``, ``Infinity``, numbers past a double's range and deep nesting),
then :func:`to_array` -- which other protocols use for their nested lists too -- has
:func:`_check_nesting` walk the lists without recursion to check the shape -- one sample
(``sample_shape``) or a batch (``[n, *sample_shape]``) -- and the type of every number
(a scalar sample's too): booleans, strings, objects and nulls are refused by name and
position before numpy sees them (numpy would turn ``True`` into ``1`` and ``"1"`` into a
string array). Only then is the array made, a sample at a time, and a number that does not
fit the dtype (``1e39`` for float32, ``2**40`` for int32) is refused with its position.

Every refusal is an :class:`InputError` with an HTTP status and a message saying what was
expected and what came.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from hcqa.serve.bodies import InputError, as_array, loads_json

__all__ = ["InputError", "Shape", "from_json", "from_raw", "json_kind", "to_array"]


class Shape:
    """What a sample is: its shape and dtype, and the text that names it in messages."""

    def __init__(self, sample_shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.sample_shape = sample_shape
        self.dtype = dtype
        self.nbytes = math.prod(sample_shape) * dtype.itemsize
        self.one = f"{dtype}{list(sample_shape)}"
        self.many = f"{dtype}{['n', *sample_shape]}".replace("'n'", "n")
        self.expected = f"one sample {self.one} or a batch {self.many}"


def from_raw(body: bytes, shape: Shape) -> tuple[npt.NDArray[Any], bool]:
    """(array, single): one sample if ``body`` is one sample's size, else a batch."""
    if not body or len(body) % shape.nbytes:
        raise InputError(
            400,
            f"expected raw little-endian {shape.expected}: a multiple of {shape.nbytes} bytes "
            f"(got {len(body)} bytes)",
        )
    n = len(body) // shape.nbytes
    x = np.frombuffer(body, dtype=shape.dtype.newbyteorder("<"))
    x = x.astype(shape.dtype)  # native byte order, writable, owned
    if n == 1:
        return x.reshape(shape.sample_shape), True
    return x.reshape((n, *shape.sample_shape)), False


def from_json(body: bytes, shape: Shape) -> tuple[npt.NDArray[Any], bool]:
    """(array, single) from ``{"inputs": ...}``; :class:`InputError` for anything else.

    Parses in bounded pieces (:func:`hcqa.serve.bodies.loads_json`): call it in a worker
    thread for a large body and the event loop keeps running meanwhile."""
    doc = loads_json(body)
    if not isinstance(doc, dict):
        raise InputError(400, f'expected a JSON object {{"inputs": ...}} (got {json_kind(doc)})')
    if "inputs" not in doc:
        keys = ", ".join(repr(k) for k in list(doc)[:5]) or "no keys"
        raise InputError(400, f'expected a JSON object with an "inputs" key (got {keys})')
    return to_array(doc["inputs"], shape, "inputs")


def to_array(inputs: Any, shape: Shape, where: str) -> tuple[npt.NDArray[Any], bool]:
    """(array, single) from nested lists of numbers that are one sample or a batch of
    ``shape``; :class:`InputError` naming the position (``where[i][j]``) of what is wrong."""
    depth = len(shape.sample_shape)
    dims = _check_nesting(inputs, shape, depth, where)
    single = len(dims) == depth
    try:
        x = as_array(inputs, shape.dtype)
    except (OverflowError, ValueError) as exc:
        raise InputError(
            400, f"{where} must fit in {shape.dtype} (got one that does not: {exc})"
        ) from None
    if x.shape != (shape.sample_shape if single else (dims[0], *shape.sample_shape)):
        raise InputError(400, f"expected {shape.expected} (got shape {list(x.shape)})")
    if shape.dtype.kind in "fc" and not np.isfinite(x).all():
        index = tuple(int(i) for i in np.argwhere(~np.isfinite(x))[0])
        value = inputs
        for i in index:
            value = value[i]
        at = where + "".join(f"[{i}]" for i in index)
        raise InputError(
            400, f"{where} must fit in {shape.dtype} (got {value!r} at {at}, too large)"
        )
    return x, single


def json_kind(value: Any) -> str:
    """What a decoded JSON value is, for an error message: 'a list', 'null', 'a number'..."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "an object"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list"
    return "a number"


def _check_nesting(inputs: Any, shape: Shape, depth: int, where: str) -> tuple[int, ...]:
    """The dims of ``inputs`` (``depth`` or ``depth + 1`` of them) after checking that every
    list at one level has the same length and every leaf is a number of the right kind."""
    dims: list[int] = []
    value = inputs
    while isinstance(value, list):  # guess the dims from the first elements
        if len(dims) > depth:
            raise InputError(
                400, f"expected {shape.expected} (got lists nested more than {depth + 1} deep)"
            )
        dims.append(len(value))
        if not value:
            break
        value = value[0]
    if len(dims) not in (depth, depth + 1) or 0 in dims:
        got = f"shape {dims}" if dims else json_kind(inputs)
        raise InputError(400, f"expected {shape.expected} (got {got})")
    ints_only = shape.dtype.kind in "iu"
    if not dims:  # a scalar sample
        _check_leaf(inputs, ints_only, where)
    # walk level by level: each level is a list of (path, value) pairs
    level: list[tuple[str, Any]] = [(where, inputs)]
    for d, n in enumerate(dims):
        nxt: list[tuple[str, Any]] = []
        for path, v in level:
            if not isinstance(v, list):
                raise InputError(400, f"expected {shape.expected} (got {json_kind(v)} at {path})")
            if len(v) != n:
                raise InputError(
                    400,
                    f"expected {shape.expected}: lists at one level must have the same length "
                    f"(got {len(v)} at {path}, {n} before it)",
                )
            if d == len(dims) - 1:
                for i, leaf in enumerate(v):
                    t = type(leaf)
                    if t is int or (t is float and not ints_only):
                        continue
                    _check_leaf(leaf, ints_only, f"{path}[{i}]")
            else:
                nxt.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
        level = nxt
    return tuple(dims)


def _check_leaf(leaf: Any, ints_only: bool, at: str) -> None:
    t = type(leaf)
    if t is int or (t is float and not ints_only):
        return
    what = "a fraction" if t is float else json_kind(leaf)
    need = "integers" if ints_only else "numbers"
    raise InputError(400, f"inputs must be {need} (got {what} at {at})")
