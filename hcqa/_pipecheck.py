"""Dry runs: a Pipeline's Python stages called once at build time (``hcqa/pipeline.py``).

Theory of operation
-------------------
Building a :class:`~hcqa.Pipeline` calls each Python stage once, on this thread, on zeros of
the shapes and dtypes it will get (its slot's buffers' views, as the engine hands them), so
that a wrong or missing ``out_shape``, a stage that fails on its arguments or one that returns
its result instead of writing ``out`` is an ``InvalidCommand`` when the pipeline is built,
not a sticky ``DeviceFault`` at the first microbatch. C and OpenCL programs, and stages whose
vals or launch sizes are Variables, are not dry-run.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from hcqa.devices.buffer import Buffer
from hcqa.devices.program import Program, check_return
from hcqa.errors import InvalidCommand

__all__ = ["StageArgs", "dry_run"]


class StageArgs(Protocol):
    """What a dry run reads of a stage (a :class:`~hcqa.pipeline.Stage`)."""

    @property
    def params(self) -> Sequence[Buffer]: ...

    @property
    def vals(self) -> Sequence[object]: ...


def dry_run(index: int, stage: StageArgs, prog: Program, out: Buffer, inp: Buffer) -> None:
    """Call a Python stage once on zeros of its declared shapes and dtypes, on this thread,
    so a wrong or missing ``out_shape`` (numpy's "could not broadcast"), a stage that fails
    on its arguments, or one that returns its result instead of writing ``out`` is an
    ``InvalidCommand`` now, not a sticky ``DeviceFault`` at the first microbatch. C and
    OpenCL programs, and stages whose vals or sizes are Variables, are not dry-run."""
    fn = prog.fn
    if fn is None or prog.kernel is not None or type(prog) is not Program:
        return  # a C kernel, or a device's own program kind (OpenCL's)
    sizes = {n: _ints3(getattr(stage, n)) for n in prog.geometry}
    if not all(type(v) is int for v in stage.vals) or None in sizes.values():
        return
    bufs = (out, inp, *stage.params)
    arrays = [_scratch(b) for b in bufs]
    what = (
        f"stage {index} ({prog.name!r}) failed a dry run on zeros of its declared shapes "
        f"(input {_describe(inp)}, out {_describe(out)})"
    )
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            got = fn(*arrays, *stage.vals, **sizes)
        except Exception as exc:
            raise InvalidCommand(
                f"{what}: {type(exc).__name__}: {exc}; give the stage the out_shape / out_dtype "
                "it writes (Stage(..., out_shape=...)), or build with check=False for a stage "
                "that must not run outside the pipeline"
            ) from exc
    try:
        check_return(prog.name, got, [arrays[i] for i in prog.access(len(arrays))[0]])
    except InvalidCommand as exc:
        raise InvalidCommand(f"stage {index}: {exc}") from None


def _ints3(value: object) -> tuple[int, int, int] | None:
    """A stage's launch size as the kernel receives it, or None if a Variable is in it."""
    dims = (value,) if not isinstance(value, (tuple, list)) else tuple(value)
    if not all(type(d) is int for d in dims):
        return None
    full = (*dims, 1, 1, 1)
    return full[0], full[1], full[2]


def _scratch(buf: Buffer) -> npt.NDArray[Any]:
    """Zeros shaped as the kernel's view of ``buf`` (what the engine hands it)."""
    dtype = np.dtype(buf.dtype if buf.dtype is not None else np.uint8)
    shape = buf.shape if buf.shape is not None else (buf.nbytes // dtype.itemsize,)
    return np.zeros(shape, dtype)


def _describe(buf: Buffer) -> str:
    arr = _scratch(buf)
    return f"{arr.dtype}{list(arr.shape)}"
