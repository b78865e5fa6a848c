"""Stages for process-pipeline tests: worker processes import ``_stages:fn`` (the tests
put this directory on the workers' PYTHONPATH)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt


def scaled(factor: float) -> Callable[[npt.NDArray[Any], npt.NDArray[Any]], None]:
    """A stage factory: ``out = inp * factor``."""

    def stage(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
        np.multiply(inp, factor, out=out)

    return stage


def row_sums(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """``out[i] = inp[i].sum()`` (a stage whose output has another shape)."""
    np.sum(inp, axis=1, out=out)


def widen(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """``out = inp`` in out's (wider) dtype."""
    np.copyto(out, inp, casting="same_kind")
