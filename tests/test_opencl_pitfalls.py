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
from _kinds import opencl_missing

pytest.importorskip("pyopencl")

TESTS = os.path.dirname(os.path.abspath(__file__))
NEEDS_DEVICE = pytest.mark.skipif(opencl_missing() is not None, reason=str(opencl_missing()))


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


# -- a host copy's event dropped before it completes -------------------------------------------

NANNY = """
import time
import numpy as np
import trio
import hcqa

SPIN = (
    "__kernel void spin(__global float *x, int n) {"
    "    float a = x[0];"
    "    for (int i = 0; i < n; i++) a = a * 0.9999999f + 1e-7f;"
    "    x[0] = a;"
    "}"
)
N = 1 << 20
BIG = 512 << 20


async def main():
    lags = []

    async def heartbeat():
        while True:
            t = time.perf_counter()
            await trio.sleep(0.005)
            lags.append(time.perf_counter() - t - 0.005)

    async with hcqa.open_device("opencl:0", hang_limit=60) as d:
        k = d.program("spin", SPIN, entry="spin")
        buf = d.alloc(shape=(N,), dtype="float32")
        await buf.copyin(np.ones(N, np.float32))
        n = 1 << 16
        while (kernel := await k.timed(buf, vals=(n,))) < 0.4 and n < 1 << 30:
            n *= 2
        big = d.alloc(BIG)
        host = np.ones(BIG, np.uint8)
        await big.copyin(host)
        t = time.perf_counter()
        await big.copyin(host)
        copy = time.perf_counter() - t
        worst = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(heartbeat)
            await trio.sleep(0.02)
            for case in ("kernel", "copy"):
                lags.clear()
                for _ in range(2):
                    if case == "kernel":
                        k(buf, vals=(n,))  # a long kernel writes buf ...
                    else:
                        big.copyin(host)  # ... or a long copy runs ahead on the copy queue
                    buf.copyin(np.full(N, 2, np.float32))  # a host copy behind it (array and
                    out = np.empty(N, np.float32)  # fence not kept by the caller)
                    fence = buf.copyout(out)  # and a host copy out behind that
                    await fence
                    assert (out == 2).all(), out[:4]
                worst[case] = max(lags)
            nursery.cancel_scope.cancel()
    print(kernel, worst["kernel"], copy, worst["copy"])


trio.run(main)
"""


@NEEDS_DEVICE
def test_host_copies_behind_long_work_never_freeze_the_loop() -> None:
    """A host copy's PyOpenCL event, dropped before the copy completes, waits for it in its
    destructor with the GIL held: the loop's heartbeat then misses the whole of the work ahead
    of the copy (a 0.54 s gap behind a 0.6 s copy, measured with such a drop). Queued behind a
    long kernel, and behind a long copy on the same queue, the heartbeat must stay far below."""
    proc = _child(NANNY, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernel, worst_kernel, copy, worst_copy = map(float, proc.stdout.split())
    assert kernel >= 0.4
    assert worst_kernel < kernel / 2, (worst_kernel, kernel)
    assert worst_copy < copy / 2, (worst_copy, copy)


# -- no linker on PATH --------------------------------------------------------------------------

NO_LD_RAW = """
import os, numpy as np, pyopencl as cl
ctx = cl.Context([cl.get_platforms()[0].get_devices()[0]])
q = cl.CommandQueue(ctx)
src = "__kernel void k(__global int *x) { x[0] = %d; }" % (os.getpid() * 7919)  # never cached
k = cl.Program(ctx, src).build().k
b = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4)
k(q, (1,), (1,), b).wait()
print("ran")
"""

NO_LD_HCQA = """
import trio, hcqa

async def main():
    try:
        async with hcqa.open_device("opencl:0") as d:
            k = d.program("k", "__kernel void k(__global int *x) { x[0] = 1; }", entry="k")
            await k(d.alloc(4))
    except (hcqa.InvalidCommand, hcqa.DeviceFault) as exc:
        print(type(exc).__name__, exc)
    else:
        print("ran")

trio.run(main)
"""


@NEEDS_DEVICE
def test_without_ld_hcqa_refuses_where_pocl_would_abort() -> None:
    from hcqa.devices.opencl import platforms

    if "Portable Computing" not in platforms.cl_device(0).platform.name:
        pytest.skip("opencl:0 is not PoCL: no linker needed")
    path = os.path.dirname(sys.executable)  # the venv's bin: python, no binutils
    raw = _child(NO_LD_RAW, timeout=120, PATH=path)
    assert raw.returncode == -signal.SIGABRT, (raw.returncode, raw.stdout, raw.stderr[-500:])
    proc = _child(NO_LD_HCQA, timeout=120, PATH=path)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.startswith(("InvalidCommand", "DeviceFault")), proc.stdout
    assert "'ld'" in proc.stdout and "PATH" in proc.stdout, proc.stdout
