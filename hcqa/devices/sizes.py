"""Sizes, shapes and dtypes: the checks every allocation, view and array argument goes through.

Theory of operation
-------------------
Whatever hcqa takes as a size, a shape or a dtype -- ``alloc``, ``view``, ``import_buffer``,
a pipeline's ``in_shape``, a batcher's samples -- is checked here, on the caller's task,
with the house error messages (``'nbytes' must be >= 1 (got 0)``): sizes are ints (numpy
ints too, never bools), shapes an int or a sequence of positive ints, dtypes plain data of a
fixed size (an object dtype would hand raw pointers to engines and kernels). ``typed_size``
turns ``alloc``'s arguments into (nbytes, dtype, shape); ``check_sample`` says how to convert
an array of the wrong dtype."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from hcqa.errors import InvalidCommand

__all__ = [
    "check_int",
    "check_plain_dtype",
    "check_sample",
    "check_shape",
    "check_size",
    "dtype_expr",
    "typed_size",
]


def check_size(name: str, value: object, *, minimum: int = 0) -> int:
    """``value`` as an int >= minimum, with the house error messages."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidCommand(f"{name!r} must be an int (got {type(value).__name__})")
    if value < minimum:
        raise InvalidCommand(f"{name!r} must be >= {minimum} (got {value})")
    return int(value)


def check_int(name: str, value: object, *, minimum: int) -> int:
    """``value``, a plain int >= minimum (no bools, no numpy ints), with the house error
    messages: for counts and settings, where :func:`check_size` takes sizes."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidCommand(f"{name!r} must be an int (got {type(value).__name__})")
    if value < minimum:
        raise InvalidCommand(f"{name!r} must be >= {minimum} (got {value})")
    return value


def check_plain_dtype(what: str, dt: np.dtype[Any]) -> None:
    """Refuse dtypes whose bytes are not plain data: Python objects (alone or inside a
    structured dtype) would hand raw pointers to engines and kernels."""
    if dt.hasobject:
        raise InvalidCommand(f"{what} must be a plain, non-object dtype (got {dt})")
    if dt.itemsize == 0:
        raise InvalidCommand(f"{what} must be a fixed-size dtype (got {dt}, of 0 bytes)")


def check_sample(
    what: str, x: object, shape: tuple[int, ...], dtype: np.dtype[Any]
) -> npt.NDArray[Any]:
    """``x`` as an array, if it is ``dtype`` of ``shape``; else an ``InvalidCommand`` that says
    what was expected, what was seen, and how to convert it (a Python list of floats becomes
    float64, of ints int64: ``np.asarray(x, dtype=...)`` makes the dtype expected)."""
    arr = np.asarray(x)
    if arr.shape == shape and arr.dtype == dtype:
        return arr
    got = f"{arr.dtype}{list(arr.shape)}"
    if isinstance(x, (list, tuple)):
        got += f" from a Python {type(x).__name__}"
    message = f"{what} must be {dtype}{list(shape)} (got {got})"
    if arr.dtype != dtype:
        message += f"; convert it with np.asarray(x, dtype={dtype_expr(dtype)})"
    raise InvalidCommand(message)


def dtype_expr(dtype: np.dtype[Any]) -> str:
    """How to write ``dtype`` in Python: ``np.float32``, or its string where numpy has no name."""
    named = getattr(np, dtype.name, None)
    if named is dtype.type and np.dtype(named) == dtype:
        return f"np.{dtype.name}"
    return repr(str(dtype))


def check_shape(shape: object, what: str = "'shape'") -> tuple[int, ...]:
    """``shape`` as a tuple: an int, or a sequence (tuple, list, 1-d array) of ints, each
    > 0 (numpy integers too; never a bool or a str). Every shape hcqa takes follows this
    rule (``alloc``, ``view``, a pipeline's ``in_shape`` and ``out_shape``, a batcher's
    ``sample_shape``)."""
    if isinstance(shape, int | np.integer) and not isinstance(shape, bool):
        dims: tuple[Any, ...] = (shape,)
    elif isinstance(shape, Sequence) and not isinstance(shape, str | bytes):
        dims = tuple(shape)
    elif isinstance(shape, np.ndarray) and shape.ndim == 1:
        dims = tuple(shape.tolist())
    else:
        dims = (None,)
    if not all(isinstance(d, int | np.integer) and not isinstance(d, bool) and d > 0 for d in dims):
        raise InvalidCommand(
            f"{what} must be an int or a sequence of positive ints (got {shape!r})"
        )
    return tuple(int(d) for d in dims)


def _typed(
    nbytes: int | None, dtype: npt.DTypeLike | None, shape: Sequence[int] | int | None
) -> tuple[np.dtype[Any] | None, tuple[int, ...] | None]:
    """Check ``dtype`` / ``shape`` against ``nbytes``; the dtype and shape to keep."""
    if dtype is None:
        if shape is not None:
            raise InvalidCommand("'shape' needs a 'dtype' (got shape without dtype)")
        return None, None
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise InvalidCommand(f"'dtype' must be a numpy dtype (got {dtype!r})") from exc
    check_plain_dtype("'dtype'", dt)
    if shape is None:
        if nbytes is None or nbytes % dt.itemsize:
            raise InvalidCommand(
                f"'nbytes' must be a multiple of {dt} itemsize {dt.itemsize} (got {nbytes})"
            )
        return dt, (nbytes // dt.itemsize,)
    shape = check_shape(shape)
    need = math.prod(shape) * dt.itemsize
    if nbytes is not None and nbytes != need:
        raise InvalidCommand(
            f"'nbytes' must equal shape {shape} x {dt} = {need} bytes (got {nbytes})"
        )
    return dt, shape


def typed_size(
    nbytes: int | None, dtype: npt.DTypeLike | None, shape: Sequence[int] | int | None
) -> tuple[int, np.dtype[Any] | None, tuple[int, ...] | None]:
    """Resolve ``alloc``'s arguments into (nbytes, dtype, shape)."""
    if nbytes is not None:
        nbytes = check_size("nbytes", nbytes, minimum=1)
    dt, shp = _typed(nbytes, dtype, shape)
    if nbytes is None:
        if dt is None or shp is None:
            raise InvalidCommand("alloc() needs 'nbytes' or 'shape' and 'dtype' (got neither)")
        nbytes = math.prod(shp) * dt.itemsize
    return nbytes, dt, shp
