"""Getting a process pipeline's items into and out of shared slots (``hcqa.processes``).

Theory of operation
-------------------
This is the one place where the coordinator's event loop copies data. A hop to the copy
engine's thread and back costs ~100-200 us on 2 vCPUs and a trio checkpoint ~10 us, so
an item's input is copied on the caller's task -- in one go when small, in steps with a
checkpoint between when larger, so the loop never stalls longer than one step -- and
only items too big for that go to the copy engine.

The result is *lent* rather than copied when it is large: the last stage wrote it into
a spare output slot, and the caller gets an array over that slot itself. The array is
built on a fresh ``ctypes`` anchor over the mapping (``HostMemory.anchor``); every view
of the array keeps the anchor alive, and the anchor keeps the mapping alive, so a
finalizer on the anchor says exactly when the last array over the slot is gone -- then
the slot goes back to the pool. A lent array stays valid after the pipeline closes.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from hcqa.devices.buffer import Buffer

__all__ = [
    "COPY_STEP",
    "INLINE_COPY",
    "LOAN_BUDGET",
    "STEPPED_COPY",
    "copy",
    "copy_in_steps",
    "lend",
]

# An item's input, by size:
# * up to INLINE_COPY: one memcpy on the caller's task (a few us);
# * up to STEPPED_COPY: memcpys of COPY_STEP bytes on the caller's task, a checkpoint
#   between them, so the loop never stalls longer than one step (~25-50 us);
# * larger: the copy engine, where the copy itself outweighs the hop.
INLINE_COPY = 64 << 10
STEPPED_COPY = 8 << 20
COPY_STEP = 1 << 20
# Results over INLINE_COPY are lent while a spare output slot is free (else copied out
# the same way inputs come in): up to ``depth`` spare slots, and at most this many bytes
# of them (but always one).
LOAN_BUDGET = 64 << 20


async def copy(
    dest: npt.NDArray[Any], src: npt.NDArray[Any], by_engine: Callable[[], Awaitable[Any]]
) -> None:
    """``dest[...] = src`` by the size policy above; ``by_engine()`` makes the same copy
    on the copy engine (a slot buffer's ``copyin`` / ``copyout``) for the largest items."""
    if src.nbytes <= INLINE_COPY:
        np.copyto(dest, src)
    elif src.nbytes <= STEPPED_COPY and src.flags.c_contiguous:
        await copy_in_steps(dest, src)
    else:
        await by_engine()


async def copy_in_steps(dest: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
    """``dest[...] = src`` (both C-contiguous) on this task, COPY_STEP bytes at a time
    with a checkpoint between steps. Cancelled midway, ``dest`` is left partly written."""
    d, s = dest.reshape(-1), src.reshape(-1)
    step = max(1, COPY_STEP // s.itemsize)
    for i in range(0, s.size, step):
        if i:
            await trio.lowlevel.checkpoint()
        np.copyto(d[i : i + step], s[i : i + step])


def lend(buf: Buffer, on_return: Callable[[], None]) -> npt.NDArray[Any]:
    """``buf``'s contents as an array over its memory (no copy), of its shape and dtype;
    ``on_return()`` runs (in any thread) once that array and every view of it are gone."""
    anchor = buf._mem.anchor(buf.offset, buf.nbytes)
    weakref.finalize(anchor, on_return)
    arr = np.frombuffer(memoryview(anchor), buf.dtype if buf.dtype is not None else np.uint8)
    return arr.reshape(buf.shape) if buf.shape is not None else arr
