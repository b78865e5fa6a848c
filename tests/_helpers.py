"""Small helpers shared by several test files (imported as ``_helpers``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

import hcqa


async def read(buf: hcqa.Buffer) -> npt.NDArray[Any]:
    """A typed buffer's contents, copied out through its device."""
    assert buf.dtype is not None and buf.shape is not None
    out = np.empty(buf.shape, dtype=buf.dtype)
    await buf.copyout(out)
    return out


class Counter:
    """A Python kernel that counts its runs."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any) -> None:
        self.calls += 1
