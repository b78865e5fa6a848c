"""What a front end hands hcqa: kernels, buffers and tensors as plain data (no tinygrad here).

Theory of operation
-------------------
``hcqa.models._tinygrad`` reads tinygrad's captured jit and writes it down in these frozen
records; ``hcqa.models.model`` builds an hcqa Graph from them. Nothing here refers to a
front end's objects, so the reader stays the one module that knows tinygrad's internals.

* A :class:`Base` is one allocation: an input (filled per call), a weight or state buffer (its
  bytes copied once at load: ``data``), or scratch (allocated, never copied).
* An :class:`Arg` is a kernel's buffer argument: a byte range of a base, with its dtype.
* A :class:`Kernel` is one program and its launches: source, entry, flags, geometry and vals,
  each a :data:`Sym` -- an int, a Variable's name, or ``(op, lhs, rhs)`` with op one of
  ``+ - * //`` -- and ``core_id``, the position of a val that counts ``0 .. launches-1``;
  ``ops`` and ``mem`` are the front end's own cost estimates for all its launches (operations,
  and bytes of memory touched once), which :func:`hcqa.models.pipeline` balances stages by.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import attrs
import numpy as np

__all__ = ["Arg", "Base", "Kernel", "Lifted", "Sym", "TensorSpec"]

Sym: TypeAlias = "int | str | tuple[str, Sym, Sym]"


def _dims(shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
    return tuple(None if d is None else int(d) for d in shape)


@attrs.frozen
class TensorSpec:
    """A model's input or output: its name, shape (``None`` marks the batch dimension, when
    the model takes several batch sizes) and numpy dtype."""

    name: str
    shape: tuple[int | None, ...] = attrs.field(converter=_dims)
    dtype: np.dtype[Any] = attrs.field(converter=np.dtype)


@attrs.frozen(kw_only=True)
class Base:
    """One allocation of the lifted model."""

    nbytes: int
    role: Literal["input", "weight", "state", "scratch", "output"]
    slot: int | None = None  # the input's position, for role "input"
    data: bytes | None = None  # the bytes copied at load (weights and state)


@attrs.frozen(kw_only=True)
class Arg:
    """A kernel's buffer argument: ``nbytes`` bytes of base ``base`` from ``offset``."""

    base: int
    offset: int
    nbytes: int
    dtype: np.dtype[Any]


@attrs.frozen(kw_only=True)
class Kernel:
    """One program launch (``launches`` of them when the kernel counts ``core_id``)."""

    name: str
    entry: str
    source: str
    args: tuple[Arg, ...]
    vals: tuple[Sym, ...]
    writes: tuple[int, ...]
    reads: tuple[int, ...]
    global_size: tuple[Sym, ...] = (1, 1, 1)
    local_size: tuple[Sym, ...] = (1, 1, 1)
    core_id: int | None = None
    launches: int = 1
    ops: int = 0  # the front end's estimate of the operations of all launches
    mem: int = 0  # and of the bytes they touch (each byte once)


@attrs.frozen(kw_only=True)
class Lifted:
    """A captured function: what to allocate, what to run, where inputs and outputs live."""

    language: Literal["c", "opencl"]
    flags: tuple[str, ...]
    bases: tuple[Base, ...]
    kernels: tuple[Kernel, ...]
    inputs: tuple[tuple[TensorSpec, Arg], ...]
    outputs: tuple[tuple[TensorSpec, Arg], ...]
    variables: tuple[tuple[str, int, int], ...] = ()
