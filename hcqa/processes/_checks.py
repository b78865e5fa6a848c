"""Checking ``open_process_pipeline``'s arguments before any worker is spawned.

Theory of operation
-------------------
A process pipeline costs processes, fds and shared memory, and a stage can only be
named (a worker imports it), never passed as an object. So every argument is checked
here, on the caller's task, and refused with :class:`~hcqa.errors.InvalidCommand` (or
:class:`~hcqa.errors.OutOfMemory` when the fds it needs are not there) before anything
is allocated or started; messages say what was expected and what was seen.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from hcqa.errors import InvalidCommand, OutOfMemory

__all__ = ["MAX_DEPTH", "ProcessStage", "check_arguments", "check_fds", "out_shape", "plain_dtype"]

MAX_DEPTH = 64  # items in flight; also keeps one worker's set-up within one fd message
_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@attrs.frozen(kw_only=True)
class ProcessStage:
    """A stage run in its own process: ``fn(out, inp)`` named as ``"module:function"``.

    With ``args`` (JSON-serializable), ``fn`` names a *factory* instead: the worker
    calls ``factory(**args)`` once and runs the callable it returns -- the place to
    load a stage's weights in the worker."""

    fn: str
    out_shape: Sequence[int] | int | None = None
    out_dtype: str | None = None
    args: dict[str, Any] | None = None


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def plain_dtype(dtype: object, what: str) -> np.dtype[Any]:
    """``dtype`` as a numpy dtype of plain numbers (shared between processes as bytes)."""
    try:
        dt: np.dtype[Any] = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise InvalidCommand(f"{what} must be a numpy dtype (got {dtype!r})") from exc
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None or dt.itemsize == 0:
        raise InvalidCommand(
            f"{what} must be a plain numeric or bool dtype: items cross processes as bytes "
            f"(got {dt})"
        )
    return dt


def out_shape(stage: ProcessStage) -> tuple[int, ...] | None:
    """A checked stage's ``out_shape`` as a tuple (None: the stage keeps its input's)."""
    return None if stage.out_shape is None else _shape(stage.out_shape, "'out_shape'")


def _shape(shape: object, what: str) -> tuple[int, ...]:
    """An int or a sequence of ints >= 1 (at least one), as everywhere in hcqa."""
    if _is_int(shape):
        shape = (shape,)
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise InvalidCommand(f"{what} must be an int or a tuple of ints >= 1 (got {shape!r})")
    if not shape or not all(_is_int(n) and n >= 1 for n in shape):
        raise InvalidCommand(
            f"{what} must be an int or a tuple of ints >= 1 (got {tuple(shape)!r})"
        )
    return tuple(int(n) for n in shape)


def _stage(i: int, s: object) -> ProcessStage:
    if isinstance(s, str):
        s = ProcessStage(fn=s)
    if not isinstance(s, ProcessStage):
        if callable(s):
            name = getattr(s, "__qualname__", type(s).__name__)
            mod = getattr(s, "__module__", "module")
            raise InvalidCommand(
                f"stage {i} must be named as a 'module:function' string or a ProcessStage, "
                f"since a worker process imports it (got the callable {name!r}; "
                f"e.g. '{mod}:{name}')"
            )
        raise InvalidCommand(
            f"stage {i} must be a 'module:function' string or a ProcessStage "
            f"(got {type(s).__name__} {s!r})"
        )
    if not isinstance(s.fn, str) or not _NAME.match(s.fn):
        raise InvalidCommand(f"stage {i} must be named 'module:function' (got {s.fn!r})")
    out_shape = None if s.out_shape is None else _shape(s.out_shape, f"stage {i}'s out_shape")
    out_dtype = None
    if s.out_dtype is not None:
        out_dtype = str(plain_dtype(s.out_dtype, f"stage {i}'s out_dtype"))
    if s.args is not None:
        if not isinstance(s.args, dict) or not all(isinstance(k, str) for k in s.args):
            raise InvalidCommand(f"stage {i}'s args must be a dict with str keys (got {s.args!r})")
        try:
            json.dumps(s.args, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidCommand(f"stage {i}'s args must be JSON-serializable ({exc})") from exc
    return attrs.evolve(s, out_shape=out_shape, out_dtype=out_dtype)


def check_arguments(
    stages: object,
    *,
    in_shape: object,
    dtype: object,
    depth: object,
    grace: object,
    hang_limit: object,
    blas_threads: object,
    path: object,
) -> tuple[list[ProcessStage], tuple[int, ...], np.dtype[Any]]:
    """Every argument of ``open_process_pipeline``, checked; the stages as ProcessStages."""
    if isinstance(stages, (str, bytes, ProcessStage)):
        raise InvalidCommand(
            "'stages' must be a list of stages ('module:function' strings or ProcessStages) "
            f"(got one {type(stages).__name__}: {stages!r}; write [{stages!r}])"
        )
    if not isinstance(stages, (list, tuple)):
        raise InvalidCommand(
            f"'stages' must be a list of stages (got {type(stages).__name__} {stages!r})"
        )
    if not stages:
        raise InvalidCommand("a process pipeline needs at least one stage (got none)")
    specs = [_stage(i, s) for i, s in enumerate(stages)]
    shape = _shape(in_shape, "'in_shape'")
    dt = plain_dtype(dtype, "'dtype'")
    if not _is_int(depth) or not 1 <= depth <= MAX_DEPTH:  # type: ignore[operator]
        raise InvalidCommand(f"'depth' must be an int in 1..{MAX_DEPTH} (got {depth!r})")
    if not _is_real(grace) or not math.isfinite(grace) or grace < 0:  # type: ignore[arg-type,operator]
        raise InvalidCommand(f"'grace' must be a finite number of seconds >= 0 (got {grace!r})")
    if not _is_real(hang_limit) or not hang_limit > 0:  # type: ignore[operator]
        raise InvalidCommand(
            f"'hang_limit' must be a number of seconds > 0 (inf: none) (got {hang_limit!r})"
        )
    if blas_threads is not None and (not _is_int(blas_threads) or blas_threads < 1):  # type: ignore[operator]
        raise InvalidCommand(f"'blas_threads' must be None or an int >= 1 (got {blas_threads!r})")
    if (
        isinstance(path, (str, bytes))
        or not isinstance(path, (list, tuple))
        or not all(isinstance(p, str) and p for p in path)
    ):
        raise InvalidCommand(f"'path' must be a list of directory names (got {path!r})")
    return specs, shape, dt


def check_fds(buffers: int, stages: int) -> None:
    """Refuse a pipeline whose fds would not fit under ``RLIMIT_NOFILE``: ``buffers``
    memfds, a signal (eventfd and its peers) per stage and more, a socket and a pidfd
    per worker."""
    needed = buffers + 6 * (stages + 1) + 16
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    free = soft - len(os.listdir("/proc/self/fd"))
    if needed > free:
        raise OutOfMemory(
            f"the process pipeline needs about {needed} file descriptors, but only {free} "
            f"of this process's limit of {soft} are free (lower 'depth', or raise the limit: "
            "ulimit -n / resource.setrlimit)"
        )
