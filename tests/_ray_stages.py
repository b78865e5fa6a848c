"""Stages for the Ray pipeline tests (the workers import ``_ray_stages:fn``; the tests put
this directory on their path)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt


def tagged(slot: int, tags: int) -> Callable[[npt.NDArray[Any], npt.NDArray[Any]], None]:
    """A stage factory over a 1-d input: ``out[:tags] = 2 * inp[:tags] + 1``, the tags
    ``out[tags:]`` passed on, and ``out[slot]`` = the pid of the process that started this
    worker (the segment's host: a Ray actor, or the driver)."""

    def stage(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
        np.multiply(inp[:tags], 2, out=out[:tags])
        np.add(out[:tags], 1, out=out[:tags])
        out[tags:] = inp[tags:]
        out[slot] = os.getppid()

    return stage


def fail_on_negative(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """``out = inp``, but an input whose first value is negative raises."""
    if inp.flat[0] < 0:
        raise ValueError(f"negative input {inp.flat[0]}")
    np.copyto(out, inp)


def slow(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """``out = inp``, after half a second (a stage that keeps making progress)."""
    time.sleep(0.5)
    np.copyto(out, inp)


def stuck(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """A stage that never finishes (until its process is killed)."""
    time.sleep(3600)


def held(fifo: str) -> Callable[[npt.NDArray[Any], npt.NDArray[Any]], None]:
    """A stage factory: ``out = 2 * inp + 1`` once it has read one byte from the FIFO
    ``fifo`` (the test lets items through one byte each; the read blocks, nothing polls)."""
    fd = os.open(fifo, os.O_RDONLY)

    def stage(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
        os.read(fd, 1)
        np.multiply(inp, 2, out=out)
        np.add(out, 1, out=out)

    return stage


def fold(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """``out`` (any shape and dtype, no larger than ``inp``) = the sums of ``inp``'s
    first and second halves, as far as ``out`` reaches (a stage that changes shape)."""
    flat, half = inp.reshape(-1), inp.size // 2
    np.add(flat[: out.size], flat[half : half + out.size], out=out.reshape(-1), casting="unsafe")
