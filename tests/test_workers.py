"""Cross-process signals, buffers and pipelines (hcqa.processes)."""

from __future__ import annotations

import array
import gc
import json
import os
import signal as os_signal
import socket
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import trio

import hcqa
from hcqa.processes import open_process_pipeline
from hcqa.processes.ipc import attach_signal, check_peer, offer_signal, recv_message, send_message
from hcqa.signals import Signal

TESTS = os.path.dirname(os.path.abspath(__file__))  # _stages.py: given to workers as path=


def fd_count() -> int:
    """Open fds, after warming what is created once per process (the signal slot page)."""
    Signal().close()
    return len(os.listdir("/proc/self/fd"))


async def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped (a group stop is
    not instant: the thread that takes the signal must run first)."""
    os.kill(pid, os_signal.SIGSTOP)
    with trio.fail_after(10):
        while True:
            tasks = os.listdir(f"/proc/{pid}/task")
            states = []
            for t in tasks:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    stat = f.read()
                states.append(stat[stat.rindex(")") + 2])
            if all(s == "T" for s in states):
                return
            await trio.sleep(0.001)  # polling another process's state, not syncing tasks


def _child_attach_and_set(sock: socket.socket) -> None:
    """Child process body (no trio after fork): attach to the offered signal, set it,
    then wait -- sleeping in wait_sync -- for the parent's value."""
    data, ancdata, _, _ = sock.recvmsg(4, socket.CMSG_SPACE(16))
    fds = array.array("i")
    for _level, _kind, payload in ancdata:
        fds.frombytes(payload[: len(payload) - len(payload) % 4])
    (length,) = struct.unpack("!I", data)
    meta = json.loads(sock.recv(length))
    sig = attach_signal(meta, list(fds))
    body = b"{}"
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [sig.fd]).tobytes())]
    sock.sendmsg([struct.pack("!I", len(body)) + body], rights)
    sig.value = 5  # wakes the parent's waiter through the peer eventfd
    sig.wait_sync(7, timeout=10)  # set by the parent: wakes us through our own eventfd
    sig.value = 8


async def test_signal_shared_with_a_child_process_wakes_both_ways() -> None:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 0
        try:
            parent.close()
            _child_attach_and_set(child)
        except BaseException:
            code = 1
        os._exit(code)
    child.close()
    sock = trio.socket.from_stdlib_socket(parent)
    check_peer(sock)  # same user (a socketpair reports its creator's credentials)
    sig = Signal(name="shared")
    meta, fds = offer_signal(sig)
    await send_message(sock, meta, fds)
    _, (peer_fd,) = await recv_message(sock)
    sig.add_peer(peer_fd)
    with trio.fail_after(10):
        await sig.wait(5)
        sig.value = 7
        await sig.wait(8)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    sock.close()
    sig.close()


async def test_shared_buffer_is_the_same_memory_in_another_process() -> None:
    async with hcqa.open_device("cpu:0") as dev:
        buf = dev.alloc(shape=(1024,), dtype="float64", shared=True)
        await buf.copyin(np.arange(1024, dtype=np.float64))
        fd, meta = buf.export()
        assert meta["nbytes"] == 8192 and meta["dtype"] == np.dtype("float64").str
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            arr = np.frombuffer(memoryview(__import__("mmap").mmap(fd, 8192)), np.float64)
            arr *= 2  # the parent sees this
            os._exit(0)
        os.waitpid(pid, 0)
        out = np.empty(1024, np.float64)
        await buf.copyout(out)
        np.testing.assert_array_equal(out, np.arange(1024) * 2.0)
        # importing through a duplicated fd gives a buffer on the same memory
        other = dev.import_buffer(os.dup(fd), meta["nbytes"], dtype=meta["dtype"], shape=(1024,))
        res = np.empty(1024, np.float64)
        await other.copyout(res)
        np.testing.assert_array_equal(res, out)


async def test_only_shared_allocations_can_be_exported() -> None:
    async with hcqa.open_device("cpu:0") as dev:
        with pytest.raises(hcqa.InvalidCommand, match="shared=True"):
            dev.alloc(64).export()


async def test_process_pipeline_results_and_clean_teardown() -> None:
    before = fd_count()
    x = np.arange(16, dtype=np.float32)
    async with open_process_pipeline(
        ["hcqa.workers:add_one", "hcqa.workers:add_one"], in_shape=(16,), depth=3
    ) as pipe:
        pids = [w.pid for w in pipe.workers]
        with trio.fail_after(30):
            results = []
            async with trio.open_nursery() as nursery:
                for i in range(12):

                    async def one(i: int = i) -> None:
                        results.append((i, await pipe(x + i)))

                    nursery.start_soon(one)
        for i, y in results:
            np.testing.assert_array_equal(y, x + i + 2)
        assert pipe.completed == 12
    for pid in pids:  # every worker has exited and was reaped
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    assert fd_count() == before


async def test_teardown_with_4mib_batches_in_flight() -> None:
    before = fd_count()
    n = (4 << 20) // 4
    x = np.ones(n, dtype=np.float32)
    with trio.fail_after(30):
        async with open_process_pipeline(
            ["hcqa.workers:add_one", "hcqa.workers:identity"], in_shape=(n,), depth=2
        ) as pipe:
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(pipe, x)
                await trio.sleep(0)  # leave the block with batches in flight
                nursery.cancel_scope.cancel()
        start = trio.current_time()
    assert trio.current_time() - start < 1.0
    assert fd_count() == before


async def test_a_killed_worker_becomes_a_device_fault_not_a_hang() -> None:
    x = np.zeros(16, dtype=np.float32)
    async with open_process_pipeline(
        ["hcqa.workers:identity", "hcqa.workers:identity"], in_shape=(16,), depth=2
    ) as pipe:
        with trio.fail_after(10):
            await pipe(x)
        os.kill(pipe.workers[1].pid, os_signal.SIGKILL)
        with trio.fail_after(10), pytest.raises(hcqa.DeviceFault, match="worker 1"):
            await pipe(x)
        with pytest.raises(hcqa.DeviceFault):  # sticky
            await pipe(x)


def test_memory_is_not_reachable_without_the_fds(tmp_path: object) -> None:
    """Shared memory is anonymous (memfd) and close-on-exec: a process that was not
    handed the fds has no name to open and inherits nothing."""

    async def main() -> list[str]:
        async with hcqa.open_device("cpu:0") as dev:
            buf = dev.alloc(4096, shared=True)
            fd, _ = buf.export()
            target = os.readlink(f"/proc/self/fd/{fd}")
            assert target.startswith("/memfd:hcqa-buffer")
            code = (
                "import os\n"
                "for f in os.listdir('/proc/self/fd'):\n"
                "    try: print(os.readlink('/proc/self/fd/' + f))\n"
                "    except OSError: pass\n"
            )
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            )
            return out.stdout.splitlines()

    links = trio.run(main)
    assert not any("memfd:" in link for link in links), links
    assert not any(name.startswith("hcqa") for name in os.listdir("/dev/shm"))


async def test_bad_stage_names_are_reported() -> None:
    with pytest.raises(hcqa.InvalidCommand):
        async with open_process_pipeline([], in_shape=(4,)):
            pass  # pragma: no cover
    with trio.fail_after(20), pytest.raises(hcqa.DeviceFault, match="failed to set up"):
        async with open_process_pipeline(["no_such_module:fn"], in_shape=(4,)):
            pass  # pragma: no cover


async def test_bad_pipeline_arguments_are_refused_before_any_process_starts() -> None:
    with pytest.raises(hcqa.InvalidCommand, match=r"'depth' must be an int in 1\.\.64 \(got 0\)"):
        async with open_process_pipeline(["hcqa.workers:identity"], in_shape=(4,), depth=0):
            pass  # pragma: no cover
    async with open_process_pipeline(["hcqa.workers:identity"], in_shape=(4,)) as pipe:
        with pytest.raises(hcqa.InvalidCommand, match=r"float32\[4\] \(got float64\[4\]\)"):
            await pipe(np.zeros(4))
        with pytest.raises(hcqa.InvalidCommand, match=r"\(got float32\[5\]\)"):
            await pipe(np.zeros(5, np.float32))
        assert pipe.completed == 0


async def test_zero_copy_items_and_cancellation_keep_the_pipeline_moving() -> None:
    n = (1 << 20) // 4
    async with open_process_pipeline(
        ["hcqa.workers:add_one", "hcqa.workers:add_one"], in_shape=(n,), depth=2
    ) as pipe:
        with trio.fail_after(20):
            async with pipe.item() as item:
                item.input[:] = 5.0  # written in place: no copy-in
                out = await item.run()
                assert out.shape == (n,) and float(out[0]) == 7.0 and float(out[-1]) == 7.0
                with pytest.raises(hcqa.InvalidCommand, match="already run"):
                    await item.run()
            with pytest.raises(hcqa.InvalidCommand, match="released"):
                item.input  # noqa: B018 - the slot is gone
            # an item left without run() and a caller cancelled mid-wait must not stall
            # the items behind them
            async with pipe.item():
                pass
            with trio.move_on_after(0):
                await pipe(np.zeros(n, np.float32))
            y = await pipe(np.full(n, 1.0, np.float32))
            assert float(y[0]) == 3.0


async def test_each_copy_path_delivers_every_item_intact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Items are copied inline, in steps on the task, or by the copy engine by size:
    all three give each concurrent caller its own result, and a caller cancelled
    midway through a stepped copy neither stalls nor corrupts the items behind it."""
    import hcqa.processes._items as workers

    monkeypatch.setattr(workers, "INLINE_COPY", 1 << 10)
    monkeypatch.setattr(workers, "STEPPED_COPY", 64 << 10)
    monkeypatch.setattr(workers, "COPY_STEP", 4 << 10)
    for n in (128, 8 << 10, 32 << 10):  # float32: 512 B inline, 32 KiB stepped, 128 KiB engine
        async with open_process_pipeline(
            ["hcqa.workers:add_one", "hcqa.workers:add_one"], in_shape=(n,), depth=3
        ) as pipe:
            with trio.fail_after(30):
                results: dict[int, np.ndarray] = {}

                async def one(i: int, n: int = n, results: dict[int, np.ndarray] = results) -> None:
                    results[i] = await pipe(np.arange(n, dtype=np.float32) * i)

                async with trio.open_nursery() as nursery:
                    for i in range(8):
                        nursery.start_soon(one, i)
                    with trio.move_on_after(0):  # cancelled at its first checkpoint
                        await pipe(np.zeros(n, np.float32))
                for i, y in results.items():
                    np.testing.assert_array_equal(y, np.arange(n, dtype=np.float32) * i + 2)
                y = await pipe(np.full(n, 1.0, np.float32))
                assert float(y.min()) == float(y.max()) == 3.0


async def test_stepped_copies_give_the_loop_back_between_steps() -> None:
    from hcqa.processes._items import COPY_STEP, copy_in_steps

    steps = 0

    class CountSteps(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            nonlocal steps
            if task.name == "copier":
                steps += 1

    src = np.arange(4 * COPY_STEP // 4 + 3, dtype=np.float32)  # 4 full steps and a bit
    dest = np.zeros_like(src)
    trio.lowlevel.add_instrument(CountSteps())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(copy_in_steps, dest, src, name="copier")
    np.testing.assert_array_equal(dest, src)
    assert steps == 5  # scheduled once, then after each of the 4 checkpoints


async def test_a_closed_process_pipeline_refuses_items() -> None:
    async with trio.open_nursery() as nursery:
        async with open_process_pipeline(["hcqa.workers:identity"], in_shape=(4,)) as pipe:
            np.testing.assert_array_equal(await pipe(np.ones(4, np.float32)), np.ones(4))
            held = await nursery.start(_hold_item, pipe)  # an item() block outlives the pipe
    with pytest.raises(hcqa.DeviceClosed, match="closed"):
        await pipe(np.ones(4, np.float32))
    with pytest.raises(hcqa.DeviceClosed, match="closed"):
        held.input  # noqa: B018
    with pytest.raises(hcqa.DeviceClosed, match="closed"):
        await held.run()
    with pytest.raises(hcqa.DeviceClosed, match="closed"):
        async with pipe.item():
            pass  # pragma: no cover


async def _hold_item(pipe: hcqa.ProcessPipeline, task_status: Any) -> None:
    async with pipe.item() as item:
        task_status.started(item)
        await trio.lowlevel.checkpoint()


async def test_large_outputs_are_lent_not_copied_and_never_overwritten_while_held() -> None:
    n = (256 << 10) // 4  # 256 KiB outputs: over the inline copy, so lent
    x = np.arange(n, dtype=np.float32)
    async with open_process_pipeline(
        ["hcqa.workers:add_one", "hcqa.workers:add_one"], in_shape=(n,), depth=2
    ) as pipe:
        assert pipe.loans == 2
        with trio.fail_after(30):
            a = await pipe(x)
            b = await pipe(x + 10)
            assert pipe.loaned == 2
            view = b[5:]  # a view keeps its slot held after the array itself is gone
            del b
            gc.collect()
            held = [await pipe(x + 100 + i) for i in range(6)]  # no loan free: copies
            assert pipe.loaned == 2
            np.testing.assert_array_equal(a, x + 2)  # neither was overwritten
            np.testing.assert_array_equal(view, x[5:] + 12)
            for i, y in enumerate(held):
                np.testing.assert_array_equal(y, x + 102 + i)
            del a, view
            gc.collect()
            c = await pipe(x)  # a slot came back: lent again
            assert pipe.loaned == 3
            stats = pipe.statistics()
            assert (stats.loans, stats.lent, stats.loaned) == (2, 1, 3)
            assert stats.in_flight == 0 and stats.completed == 9 and not stats.faulted
            assert stats.workers == tuple(w.pid for w in pipe.workers)
            np.testing.assert_array_equal(c, x + 2)
            # a caller cancelled while it waits gives its loan back -- once its item has
            # left the last stage, which may still be writing that loan (stopped here)
            last = pipe.workers[-1].pid
            await stop_process(last)
            try:
                with trio.move_on_after(0.05):
                    await pipe(x)
                assert pipe.statistics().retired == 1
            finally:
                os.kill(last, os_signal.SIGCONT)
            d = await pipe(x + 1)  # no loan free while the item is retired: copied
            assert pipe.loaned == 3 and pipe.statistics().retired == 0
            e = await pipe(x + 2)
            assert pipe.loaned == 4
            np.testing.assert_array_equal(d, x + 3)
            np.testing.assert_array_equal(e, x + 4)
    # a lent array outlives the pipeline: its mapping stays until the array goes
    np.testing.assert_array_equal(c, x + 2)
    c[:] = 0
    assert float(c.sum()) == 0.0
    del c, d, e
    gc.collect()


async def test_stage_factories_and_stages_that_change_shape_and_dtype() -> None:
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    stages = [
        hcqa.ProcessStage(fn="_stages:scaled", args={"factor": 3.0}),
        hcqa.ProcessStage(fn="_stages:row_sums", out_shape=(4,), out_dtype="float64"),
    ]
    async with open_process_pipeline(
        stages, in_shape=(4, 8), dtype="float32", path=[TESTS]
    ) as pipe:
        assert pipe.loans == 0  # 32-byte results are copied, never lent
        with trio.fail_after(20):
            y = await pipe(x)
    assert y.shape == (4,) and y.dtype == np.float64
    np.testing.assert_allclose(y, (x * 3.0).sum(axis=1))


async def test_lent_results_have_the_last_stages_shape_and_dtype() -> None:
    x = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
    stages = [hcqa.ProcessStage(fn="_stages:widen", out_dtype="float64")]
    async with open_process_pipeline(stages, in_shape=(256, 128), depth=3, path=[TESTS]) as pipe:
        assert pipe.loans == 3  # 256 KiB results: lent, up to depth of them
        with trio.fail_after(20):
            ys = [await pipe(x + i) for i in range(3)]
        assert pipe.loaned == 3
    for i, y in enumerate(ys):  # held past the pipeline's end
        assert y.shape == (256, 128) and y.dtype == np.float64
        np.testing.assert_array_equal(y, (x + i).astype(np.float64))


async def test_lent_results_survive_a_worker_dying_and_the_pipeline_closing() -> None:
    n = (256 << 10) // 4
    x = np.arange(n, dtype=np.float32)
    with pytest.raises(hcqa.DeviceFault, match="worker 1"):
        async with open_process_pipeline(
            ["hcqa.workers:add_one", "hcqa.workers:add_one"], in_shape=(n,), depth=2
        ) as pipe:
            with trio.fail_after(20):
                y = await pipe(x)
            assert pipe.loaned == 1
            os.kill(pipe.workers[1].pid, os_signal.SIGKILL)
            with trio.fail_after(10):
                await pipe(x)
    assert pipe.statistics().faulted
    np.testing.assert_array_equal(y, x + 2)  # the mapping outlived the workers and device


_CHILD_TRANSFER = """
import sys, numpy as np, trio, hcqa
async def main(fd: int, n: int) -> None:
    async with hcqa.open_device("cpu:0") as dev:
        theirs = dev.import_buffer(fd, n * 8, dtype="float64", shape=(n,))
        mine = dev.alloc(shape=(n,), dtype="float64")
        await hcqa.transfer(mine, theirs)  # through the copy engine, like any transfer
        got = np.empty(n)
        await mine.copyout(got)
        assert (got == np.arange(n)).all(), got[:4]
        await mine.copyin(got * 3)
        await hcqa.transfer(theirs, mine)
trio.run(main, int(sys.argv[1]), int(sys.argv[2]))
"""


async def test_transfers_with_a_buffer_imported_in_another_process() -> None:
    n = 1 << 16
    async with hcqa.open_device("cpu:0") as dev:
        buf = dev.alloc(shape=(n,), dtype="float64", shared=True)
        await buf.copyin(np.arange(n, dtype=np.float64))
        fd, _ = buf.export()
        with trio.fail_after(60):
            done = await trio.run_process(
                [sys.executable, "-c", _CHILD_TRANSFER, str(fd), str(n)],
                pass_fds=(fd,),
                check=False,
                capture_stderr=True,
            )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        out = np.empty(n)
        await buf.copyout(out)
        np.testing.assert_array_equal(out, np.arange(n) * 3.0)
