"""A process-pipeline stage that computes with OpenCL in its worker (the tests put this directory
on the workers' path). Its context is made on first use, in the worker: never inherited."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

_state: list[Any] = []

SOURCE = "__kernel void plus_one(__global float *x) { x[get_global_id(0)] += 1.0f; }"


def plus_one(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    """``out = inp + 1``, by an OpenCL kernel on the worker's own context."""
    import pyopencl as cl

    if not _state:
        ctx = cl.Context([cl.get_platforms()[0].get_devices()[0]])
        _state.extend([ctx, cl.CommandQueue(ctx), cl.Program(ctx, SOURCE).build()])
    ctx, queue, program = _state
    host = np.ascontiguousarray(inp, dtype=np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)
    program.plus_one(queue, (host.size,), None, buf)
    result = np.empty_like(host)
    cl.enqueue_copy(queue, result, buf).wait()
    np.copyto(out, result.reshape(out.shape))
