"""Shared test helpers: leak checks for file descriptors and threads.

Use the fixtures, e.g.::

    def test_no_leak(fd_count: Callable[[], int]) -> None:
        before = fd_count()
        ...
        assert fd_count() == before
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest
from _kinds import KINDS, opencl_missing


def count_fds() -> int:
    """How many file descriptors this process has open (from /proc/self/fd)."""
    # listdir opens one fd of its own while it reads; it is listed, so subtract it.
    return len(os.listdir("/proc/self/fd")) - 1


def live_thread_names() -> set[str]:
    """Names of the threads alive in this process right now."""
    return {t.name for t in threading.enumerate()}


@pytest.fixture
def fd_count() -> Callable[[], int]:
    """A callable returning the process's current open-fd count."""
    return count_fds


@pytest.fixture
def thread_names() -> Callable[[], set[str]]:
    """A callable returning the names of the live threads."""
    return live_thread_names


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """The kind of device a test about the model runs on: ``"cpu"``, then ``"opencl"`` (skipped
    where PyOpenCL or an OpenCL device is missing). See ``_kinds.py``."""
    if request.param == "opencl":
        why = opencl_missing()
        if why is not None:
            pytest.skip(why)
    return str(request.param)
