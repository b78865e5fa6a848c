"""Trivial stages for ``bench.bench_workers``: worker processes import ``bench._stages:fn``."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt

KERNEL_SECONDS = 1.0


def sleep_1s(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """``out = inp``, after sleeping 1 s when ``inp[0] != 0`` (a long kernel on demand).

    Items whose first value is 0 pass straight through, so a pipeline can be warmed up
    without paying the second."""
    if inp.flat[0] != 0:
        time.sleep(KERNEL_SECONDS)
    np.copyto(out, inp)


def _stamped(out: npt.NDArray[Any], inp: npt.NDArray[Any], stage: int) -> None:
    start = time.monotonic_ns()
    np.add(inp, 1, out=out)
    end = time.monotonic_ns()
    out[: 2 * stage] = inp[: 2 * stage]  # earlier stages' stamps pass through
    out[2 * stage] = start
    out[2 * stage + 1] = end


def stamp0(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """``out = inp + 1`` (float64), then the kernel's start/end ns in ``out[0:2]``."""
    _stamped(out, inp, 0)


def stamp1(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """``out = inp + 1`` (float64), then the kernel's start/end ns in ``out[2:4]``."""
    _stamped(out, inp, 1)
