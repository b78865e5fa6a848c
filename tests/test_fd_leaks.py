"""No fd outlives a failed or cancelled set-up.

* A device open that fails for want of file descriptors (``RLIMIT_NOFILE`` reached part-way
  through building a device: a signal's eventfd, an engine's doorbell, a native lane) closes
  everything it had made -- at once, not when the garbage collector finds the cycle. Run in
  a child process with the collector off, at every limit from "nothing fits" to "it opens".
* A process pipeline whose set-up is cancelled (at every stage: forking, the handshake, the
  mesh) leaves no fd and no signal slot behind.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
import trio
from _kinds import opencl_missing

from hcqa._signals import slots
from hcqa.processes import open_process_pipeline

ADD = "hcqa.processes.stages:add_one"

FAILED_OPENS = textwrap.dedent(
    """
    import gc, os, resource, sys, trio, hcqa

    specs = sys.argv[1:]

    def fds():
        return len(os.listdir("/proc/self/fd")) - 1

    async def main():
        async with hcqa.open_devices(*specs) as ds:  # everything loaded once
            await ds[0].alloc(8).copyin(bytes(8))
        gc.collect()
        gc.disable()  # a leak must show, not wait for the collector
        base = fds()
        failures = 0
        for extra in range(200):
            resource.setrlimit(resource.RLIMIT_NOFILE, (base + extra, 4096))
            try:
                async with hcqa.open_devices(*specs) as ds:
                    await ds[-1].alloc(8).copyin(bytes(8))
                opened = True
            except OSError as exc:
                opened = False
                failures += 1
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
            left = fds()
            if left != base:
                raise SystemExit(f"{left - base} fds left after an open at limit +{extra}")
            if opened:
                print("failures", failures, "then opened at +", extra)
                return
        raise SystemExit("never opened")

    trio.run(main)
    """
)


@pytest.mark.parametrize("kind", ["cpu", "opencl"])
def test_an_open_that_runs_out_of_fds_leaves_none(kind: str) -> None:
    if kind == "opencl" and (why := opencl_missing()) is not None:
        pytest.skip(why)
    specs = ["cpu:0", "cpu:1"] if kind == "cpu" else ["opencl:0", "opencl:0"]
    proc = subprocess.run(
        [sys.executable, "-c", FAILED_OPENS, *specs], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    failures = int(proc.stdout.split()[1])
    assert failures >= 5  # the limit was hit at many points of the build


def _slots_used() -> int:
    return sum(slots.PAGE // slots.SLOT - len(p.free) for p in slots.pool._pages)


async def test_cancelled_process_pipeline_set_ups_leave_no_fd(
    fd_count: Callable[[], int],
) -> None:
    async with open_process_pipeline([ADD, ADD], in_shape=(16,), depth=1):
        pass  # the signal pages exist from here on (process-wide, reused)
    before, used = fd_count(), _slots_used()
    cancelled = 0
    for i in range(16):
        # cancelled at a checkpoint count first, then at later and later moments
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel(n: int = i) -> None:
                    for _ in range(n * 5):
                        await trio.lowlevel.checkpoint()
                    if n >= 8:
                        await trio.sleep(0.02 * (n - 8))  # into the fork and the handshake
                    scope.cancel()

                nursery.start_soon(cancel)
                async with open_process_pipeline([ADD, ADD], in_shape=(16,), depth=1):
                    await trio.sleep_forever()
        cancelled += scope.cancelled_caught
        assert fd_count() == before, f"set-up {i}: {fd_count() - before} fds left"
        assert _slots_used() == used, f"set-up {i}: signal slots left"
    assert cancelled == 16
