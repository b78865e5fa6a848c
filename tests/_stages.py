"""Stages for process-pipeline tests: worker processes import ``_stages:fn`` (the tests
put this directory on the workers' path: ``open_process_pipeline(..., path=[TESTS])``)."""

from __future__ import annotations

import ctypes
import os
import time
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


def sleepy(seconds: float) -> Callable[[npt.NDArray[Any], npt.NDArray[Any]], None]:
    """A stage factory: ``out = inp + 1`` after sleeping ``seconds`` (slow, progressing)."""

    def stage(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
        time.sleep(seconds)
        np.add(inp, 1, out=out)

    return stage


def stuck(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """A stage that never returns when ``inp[0] != 0`` (items of zeros pass through)."""
    if inp.flat[0] != 0:
        while True:
            time.sleep(3600)
    np.copyto(out, inp)


def truncate_memfds(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """A hostile stage: truncate every hcqa memfd this worker holds to 0 bytes."""
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("/memfd:hcqa"):
            os.ftruncate(int(name), 0)  # sealed: PermissionError, never a SIGBUS elsewhere
    np.copyto(out, inp)


def die_in_factory(code: int) -> Callable[[npt.NDArray[Any], npt.NDArray[Any]], None]:
    """A factory that kills its worker during set-up."""
    os._exit(code)


def dumpable(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """``out[:] = prctl(PR_GET_DUMPABLE)`` of this worker."""
    libc = ctypes.CDLL(None)
    out[:] = libc.prctl(3, 0, 0, 0, 0)
