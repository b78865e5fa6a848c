"""Sample stages for process pipelines (``"hcqa.processes.stages:add_one"``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["add_one", "identity"]


def identity(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """A sample stage: copy the input."""
    np.copyto(out, inp)


def add_one(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """A sample stage: ``out = inp + 1``."""
    np.add(inp, 1, out=out)
