"""OpenCL's known traps, each run in a child interpreter with a hard time limit (a trap that
springs hangs or kills the process it happens in, and must not take the test run with it).

* fork after OpenCL is up: a bare-forked child cannot use OpenCL (PoCL's worker threads are not
  in the child; it hangs). hcqa's process-pipeline workers are fork+exec: they must keep working,
  OpenCL stages included, while OpenCL is busy in the coordinator.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("pyopencl")

TESTS = os.path.dirname(os.path.abspath(__file__))


def _child(code: str, timeout: float = 120.0, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; a hang is killed at ``timeout`` and fails the test."""
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **env},
            cwd=TESTS,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child hung past {timeout} s; its output: {exc.stdout!r} {exc.stderr!r}")


# OpenCL up and busy in the coordinator: PoCL's threads started, a kernel running in a loop on
# a thread of the coordinator all along.
BUSY_OPENCL = """
import threading
import numpy as np
import pyopencl as cl
from hcqa.devices.opencl import platforms

ctx = cl.Context([platforms.cl_device(0)])
queue = cl.CommandQueue(ctx)
spin = cl.Program(ctx, "__kernel void spin(__global int *x) { for (int i = 0; i < 20000; i++)"
                        " x[0] += i & 1; }").build().spin
counter = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4)
stop = threading.Event()
launched = [0]

def busy():
    while not stop.is_set():
        spin(queue, (1,), (1,), counter).wait()
        launched[0] += 1

thread = threading.Thread(target=busy)
thread.start()
"""


def test_process_pipeline_workers_run_while_opencl_is_busy_in_the_coordinator() -> None:
    proc = _child(
        BUSY_OPENCL
        + f"""
import trio
from hcqa.processes import open_process_pipeline

async def main():
    x = np.arange(64, dtype=np.float32)
    async with open_process_pipeline(
        ["_cl_stages:plus_one", "hcqa.workers:add_one", "_cl_stages:plus_one"],
        in_shape=(64,), path=[{TESTS!r}], hang_limit=30,
    ) as pipe:
        with trio.fail_after(60):
            for i in range(8):
                y = await pipe(x + i)
                assert (y == x + i + 3).all(), (i, y[:4])
    return pipe.completed

try:
    done = trio.run(main)
finally:
    stop.set()
    thread.join()
print("items", done, "coordinator kernels", launched[0])
"""
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert words[:2] == ["items", "8"], proc.stdout
    assert int(words[-1]) > 0, "OpenCL was not busy in the coordinator meanwhile"


def test_a_bare_forked_child_cannot_use_opencl() -> None:
    """The trap itself, so the test above is known to be where it springs: the same busy
    coordinator, a bare ``os.fork()``, and the child's first kernel never completes."""
    proc = _child(
        BUSY_OPENCL
        + """
import os, signal
pid = os.fork()
if pid == 0:
    signal.alarm(3)  # the child's own limit: a hang ends as SIGALRM
    c2 = cl.Context([platforms.cl_device(0)])
    q2 = cl.CommandQueue(c2)
    b2 = cl.Buffer(c2, cl.mem_flags.READ_WRITE, 4)
    k2 = cl.Program(c2, "__kernel void k(__global int *x) { x[0] = 1; }").build().k
    k2(q2, (1,), (1,), b2).wait()
    os._exit(0)
_, status = os.waitpid(pid, 0)
stop.set()
thread.join()
print("child", status)
""",
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = int(proc.stdout.split()[-1])
    assert status != 0, "a bare-forked child ran OpenCL: the fork trap is gone from this PoCL"
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM, status  # it hung
