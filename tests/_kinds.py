"""Both kinds of device for the tests that are about the model, not about cpu specifics.

A test takes the ``kind`` fixture (``conftest.py``: ``"cpu"`` and ``"opencl"``; the OpenCL run is
skipped where PyOpenCL or an OpenCL device is missing) and opens ``specs(kind, n)``. Kernels come
per kind: a Python callable or C on cpu, OpenCL C on opencl, with the same arguments, so the test
body is the same on both.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import numpy as np

import hcqa

KINDS = ("cpu", "opencl")


@functools.cache
def opencl_missing() -> str | None:
    """Why the OpenCL runs are skipped here (None: they run)."""
    if importlib.util.find_spec("pyopencl") is None:
        return "needs PyOpenCL and PoCL (pip install -e '.[opencl]')"
    from hcqa.devices.opening import _parse

    try:
        _parse("opencl:0")
    except hcqa.InvalidCommand:
        return "this hcqa opens no opencl:N device"
    from hcqa.devices.opencl import platforms

    try:
        if not platforms.list_devices():
            return "no OpenCL device here ('hcqa info' says why)"
    except Exception as exc:  # a loader without a driver, a broken install
        return f"OpenCL did not answer: {exc}"
    if platforms.missing_ld():
        return "PoCL needs the linker 'ld' on PATH"
    return None


def specs(kind: str, n: int = 1) -> tuple[str, ...]:
    """``n`` device specs of ``kind``: cpu:0, cpu:1, ...; opencl:0 n times (hcqa devices of their
    own on the one OpenCL device every machine with the extra has)."""
    return tuple(f"cpu:{i}" for i in range(n)) if kind == "cpu" else ("opencl:0",) * n


def spec(kind: str) -> str:
    return specs(kind)[0]


ADD1 = {
    "cpu": """
void add1(float *out, const float *a, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + 1.0f;
}
""",
    "opencl": """
__kernel void add1(__global float *out, __global const float *a, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + 1.0f;
}
""",
}

COUNT_CL = "__kernel void count(__global int *out) { out[0] += 1; }"


def add1(device: hcqa.Device) -> hcqa.Program:
    """``add1(out, a, vals=(n,))``: ``out[:n] = a[:n] + 1`` (float32), one work-item."""
    return device.program("add1", ADD1[device.kind], entry="add1")


class Count:
    """A kernel that counts its launches in ``out`` (at least 4 bytes): a Python callable on cpu
    (counting in Python, as the cpu tests always did), an OpenCL kernel incrementing the first
    int32 of ``out`` on opencl. ``await calls(out)`` reads the count."""

    def __init__(self) -> None:
        self.python_calls = 0

    def __call__(self, *args: Any) -> None:
        self.python_calls += 1

    def program(self, device: hcqa.Device) -> hcqa.Program:
        if device.kind == "cpu":
            return device.program("count", self)
        return device.program("count", COUNT_CL, entry="count")

    async def zero(self, out: hcqa.Buffer) -> None:
        """Start ``out`` at zero (device memory starts undefined on opencl)."""
        if out.device.kind != "cpu":
            await out.copyin(np.zeros(out.nbytes, np.uint8))

    async def calls(self, out: hcqa.Buffer) -> int:
        if out.device.kind == "cpu":
            return self.python_calls
        word = np.zeros(1, np.int32)
        await out.view(0, 4).copyout(word)
        return int(word[0])
