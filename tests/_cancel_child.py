"""Child interpreter of tests/test_cancel_close.py: one block opener, cancelled everywhere.

``python _cancel_child.py OPENER HARD_LIMIT`` opens the block of ``OPENER`` (``devices``,
``devices_read``, ``opencl``, ``process``, ``ray``, ``batcher``, ``serve``) again and again under a
cancel scope that a cancellation reaches

- at set-up: at the n-th task step after the opener was entered, for every n until the
  body is reached (``SPARSE`` openers, whose set-up forks processes, take every step up
  to 12 and then a growing stride);
- in the body: a ``move_on_after`` deadline expiring while work is in flight;
- at exit: the body ends with work still in flight and the cancellation reaches the n-th
  task step of the close (the first few n);
- by Ctrl-C: SIGINT raised in the body (trio's KeyboardInterrupt).

Each leave is timed from the cancellation; the child prints one JSON line per run and a
final ``{"done": ...}`` line. A run that does not end is a hang: faulthandler dumps every
thread's stack and exits (status 1) once ``HARD_LIMIT`` seconds have passed.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any

import numpy as np
import trio
import trio.testing

import hcqa

TESTS = os.path.dirname(os.path.abspath(__file__))
GRACE = 1.0  # the openers' grace period where they have one
SPARSE = {"process", "ray"}


class StepCanceller(trio.abc.Instrument):
    """Cancels ``scope`` just before the ``n``-th task step (any task) from now."""

    def __init__(self, scope: trio.CancelScope, n: int) -> None:
        self.scope, self.left, self.when = scope, n, math.nan
        self.added = True
        trio.lowlevel.add_instrument(self)

    def remove(self) -> None:
        if self.added:
            self.added = False
            trio.lowlevel.remove_instrument(self)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.left -= 1
        if self.left == 0:
            self.scope.cancel()
            self.when = time.monotonic()


# -- the openers: each yields (an async "work" callable that puts work in flight, a thing to
# -- check after the close); the work returns when something is in flight ----------------


@asynccontextmanager
async def devices() -> AsyncIterator[Callable[[], Awaitable[None]]]:
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):

        def slow(out: Any) -> None:
            time.sleep(0.1)
            out[:] += 1

        prog = d0.program("slow", slow)
        a = d0.alloc(shape=(64,), dtype="float32")
        b = d1.alloc(shape=(64,), dtype="float32")

        async def work() -> None:
            for _ in range(100):  # 10 s of work queued: a close must not wait for it
                prog(a)
            hcqa.transfer(b, a)

        yield work


READER: list[hcqa.Device] = []  # devices_read's cpu:1, open for the whole child


@asynccontextmanager
async def devices_read() -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """A device block whose memory another device (open outside the cancelled scope)
    still reads when it closes: the close must wait for those reads, however it is
    cancelled -- else the reader's engine copies from unmapped memory."""
    n = 32 << 20
    (d1,) = READER
    a, b, dst = d1.alloc(n), d1.alloc(n), d1.alloc(n)
    try:
        async with hcqa.open_devices("cpu:0") as (d0,):
            src = d0.alloc(n)
            src.numpy_view()[:] = 7

            async def work() -> None:
                for _ in range(4):
                    hcqa.transfer(b, a)  # cpu:1's copy queue busy ...
                hcqa.transfer(dst, src)  # ... then reading cpu:0's memory

            yield work
    finally:
        with trio.CancelScope(shield=True):
            await d1.synchronize()
        for buf in (a, b, dst):
            buf.free()


SLOW_CL = """
__kernel void slow(__global float *out, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += sin((float)i);
    out[get_global_id(0)] = acc;
}
"""


@asynccontextmanager
async def opencl() -> AsyncIterator[Callable[[], Awaitable[Any]]]:
    """Two hcqa devices on one OpenCL device and a cpu one: kernels queued, transfers
    across all three in flight (``work`` returns the last one's fence)."""
    async with hcqa.open_devices("opencl:0", "opencl:0", "cpu:0") as (g0, g1, c0):
        prog = g0.program("slow", SLOW_CL, entry="slow")
        a = g0.alloc(shape=(64,), dtype="float32")
        b = g1.alloc(shape=(64,), dtype="float32")
        c = c0.alloc(shape=(64,), dtype="float32")

        async def work() -> Any:
            for _ in range(10):
                prog(a, vals=(10000,), global_size=(1, 1, 1), local_size=(64, 1, 1))
            hcqa.transfer(b, a)
            return hcqa.transfer(c, b)

        yield work


def _stages() -> list[Any]:
    return [hcqa.ProcessStage(fn="hcqa.workers:add_one"), hcqa.ProcessStage(fn="_stages:stuck")]


async def _feed(pipe: Any, nursery: trio.Nursery) -> None:
    """Items in flight: one stuck in the last stage, callers waiting for slots."""
    for i in range(3):
        nursery.start_soon(pipe, np.full(pipe.in_shape, i + 1, np.float32))
    await trio.testing.wait_all_tasks_blocked()


@asynccontextmanager
async def process() -> AsyncIterator[Callable[[], Awaitable[None]]]:
    async with (
        hcqa.open_process_pipeline(_stages(), in_shape=(4,), grace=GRACE, path=[TESTS]) as pipe,
        trio.open_nursery() as nursery,
    ):
        yield partial(_feed, pipe, nursery)
        nursery.cancel_scope.cancel()  # the callers leave: their items stay in flight


@asynccontextmanager
async def ray() -> AsyncIterator[Callable[[], Awaitable[None]]]:
    import ray as ray_

    here = ray_.get_runtime_context().get_node_id()
    from hcqa.ray import open_ray_pipeline

    async with (
        open_ray_pipeline(
            _stages(), placement=[here, here], in_shape=(4,), grace=GRACE, path=[TESTS]
        ) as pipe,
        trio.open_nursery() as nursery,
    ):
        yield partial(_feed, pipe, nursery)
        nursery.cancel_scope.cancel()  # the callers leave: their items stay in flight


@asynccontextmanager
async def batcher() -> AsyncIterator[Callable[[], Awaitable[None]]]:
    async def target(x: Any) -> Any:
        await trio.sleep(0.5)  # a slow batch
        return x

    async with (
        hcqa.open_batcher(target, max_batch=4, sample_shape=(2,), dtype="float32") as batch,
        trio.open_nursery() as nursery,
    ):

        async def work() -> None:
            for _ in range(6):
                nursery.start_soon(batch, np.zeros(2, np.float32))
            await trio.testing.wait_all_tasks_blocked()

        yield work
        nursery.cancel_scope.cancel()  # the callers leave: the batch stays in flight


@asynccontextmanager
async def serve() -> AsyncIterator[Callable[[], Awaitable[None]]]:
    import httpx

    from hcqa.serve import serve as serve_

    def stuck(out: Any, x: Any) -> None:
        time.sleep(0.3)
        np.copyto(out, x)

    async with hcqa.open_devices("cpu:0") as (d0,):
        pipe = hcqa.Pipeline(
            [hcqa.Stage(device=d0, program=stuck)], in_shape=(2, 2), depth=2, check=False
        )
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                partial(serve_, pipe, port=0, grace_period=GRACE, shutdown_trigger=stop.wait)
            )

            async def request() -> None:
                async with httpx.AsyncClient() as client:
                    await client.post(
                        f"http://127.0.0.1:{port}/infer", json=[[1.0, 2.0], [3.0, 4.0]]
                    )

            async def work() -> None:
                for _ in range(3):
                    nursery.start_soon(request)
                await trio.sleep(0.1)  # the requests reach the server (real sockets)

            yield work
            stop.set()  # the exit: a drain with requests in flight


OPENERS: dict[str, Callable[[], AbstractAsyncContextManager[Callable[[], Awaitable[Any]]]]] = {
    "devices": devices,
    "devices_read": devices_read,
    "opencl": opencl,
    "process": process,
    "ray": ray,
    "batcher": batcher,
    "serve": serve,
}


# -- the runs --------------------------------------------------------------------------


# Openers whose work in flight can't be withdrawn: an OpenCL driver runs every launch it
# was handed, so even a cancelled close waits for them. Their runs also time a "drain" (the
# work left to finish), before and after the exit runs, for the test's bound.
UNCANCELLABLE = {"opencl"}


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def at_setup(opener: Any, n: int) -> bool:
    """Cancel at the n-th step of the set-up; True if the body was reached first."""
    reached = False
    with trio.CancelScope() as scope:
        canceller = StepCanceller(scope, n)
        try:
            async with opener():
                if not scope.cancel_called:
                    reached = True
                    canceller.remove()
                    scope.cancel()
                    canceller.when = time.monotonic()
                await trio.sleep_forever()
        finally:
            canceller.remove()
    report(run=f"setup-{n}", leave=time.monotonic() - canceller.when, reached=reached)
    return reached


async def in_body(opener: Any) -> None:
    with trio.move_on_after(math.inf) as scope:
        async with opener() as work:
            await work()
            scope.deadline = trio.current_time()  # the deadline passes now
            when = time.monotonic()
            await trio.sleep_forever()
    report(run="body", leave=time.monotonic() - when)


async def at_exit(opener: Any, n: int) -> None:
    canceller: StepCanceller | None = None
    end = math.nan
    with trio.CancelScope() as scope:
        async with opener() as work:
            await work()
            canceller = StepCanceller(scope, n)
            end = time.monotonic()
    assert canceller is not None
    canceller.remove()
    # from the cancellation; from the body's end when the close took fewer steps
    when = canceller.when if canceller.left <= 0 else end
    report(run=f"exit-{n}", leave=time.monotonic() - when, cancelled=scope.cancelled_caught)


async def drained(opener: Any) -> None:
    """The same work left to finish, timed from its last enqueue to its last fence (the
    time the work in flight takes on this host, now; the close is not in it)."""
    async with opener() as work:
        last = await work()
        when = time.monotonic()
        await last
        report(run="drain", leave=time.monotonic() - when)


def _only_ki(exc: BaseException) -> bool:
    """A KeyboardInterrupt, perhaps in groups (this file's own nurseries wrap it)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_ki(e) for e in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)


async def ctrl_c(opener: Any) -> None:
    try:
        async with opener() as work:
            await work()
            when = time.monotonic()
            signal.raise_signal(signal.SIGINT)
            await trio.sleep_forever()
    except BaseException as exc:
        if not _only_ki(exc):
            raise
        report(run="sigint", leave=time.monotonic() - when)
    else:
        raise AssertionError("SIGINT did not end the block")


async def main(name: str) -> None:
    opener = OPENERS[name]
    n, stride = 1, 1
    while not await at_setup(opener, n):
        n += stride
        if name in SPARSE and n > 12:
            stride += 2
    await in_body(opener)
    if name in UNCANCELLABLE:
        await drained(opener)
    for n in (1, 3, 8) if name in SPARSE else (1, 2, 3, 5, 8, 13, 21):
        await at_exit(opener, n)
    if name in UNCANCELLABLE:
        await drained(opener)
    await ctrl_c(opener)


def dump_tasks() -> None:
    """Every trio task's await stack, to stderr (the hang's where, which faulthandler's
    thread stacks do not show)."""

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        print("  " * depth + f"task {task.name}", file=sys.stderr)
        for frame, line in task.iter_await_frames():
            code = frame.f_code
            print("  " * depth + f"  {code.co_filename}:{line} {code.co_name}", file=sys.stderr)
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child, depth + 1)

    root = trio.lowlevel.current_root_task()
    if root is not None:
        walk(root, 0)
    sys.stderr.flush()


def watch(token: trio.lowlevel.TrioToken, after: float) -> None:
    """A thread: after ``after`` seconds, the trio tasks' stacks (the run is stuck)."""
    time.sleep(after)
    token.run_sync_soon(dump_tasks)


async def run(name: str, limit: float) -> None:
    token = trio.lowlevel.current_trio_token()
    threading.Thread(target=watch, args=(token, limit - 3), daemon=True).start()
    if name == "devices_read":
        async with hcqa.open_devices("cpu:1") as devices:
            READER[:] = devices
            await main(name)
    else:
        await main(name)
    report(done=name, threads=sorted(t.name for t in threading.enumerate()))


if __name__ == "__main__":
    faulthandler.enable()  # a crash (SIGSEGV) shows where
    faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)
    sys.path.insert(0, TESTS)
    if sys.argv[1] == "ray":
        import ray as ray_

        ray_.init(
            address="local",  # a cluster of its own, whatever else runs on the host
            num_cpus=1,
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=False,
            object_store_memory=80 * 1024 * 1024,
        )
    trio.run(run, sys.argv[1], float(sys.argv[2]))
