"""The native engine lane: C commands on a thread of C, Python commands on the engine's
thread, in queue order (devices opened with ``inline_kernels=False``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import trio

import hcqa
import hcqa.testing as ht
from hcqa import commands as cmd
from hcqa._native.lane import library
from hcqa.actors.lane import LaneEngine
from hcqa.devices.timeline import Timeline
from hcqa.errors import DeviceClosed, DeviceFault, SignalTimeout
from hcqa.signals import Signal

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: no native lane")

# log[0] counts entries, log[1 + i] is the i-th value appended
LOG_C = "void logc(int *log, int v) { log[1 + log[0]] = v; log[0] += 1; }\n"
BLOCK_C = (
    "#include <stdint.h>\n#include <unistd.h>\n"
    "void block(unsigned char *b, int fd) { uint64_t x; ssize_t r = read(fd, &x, 8); (void)r; }\n"
)
SET_C = "void setv(int *out, int v) { out[0] = v; }\n"


def logp(log: Any, v: int) -> None:
    log[1 + log[0]] = v
    log[0] += 1


def _tasks() -> set[int]:
    """Threads of this process by kernel id, C threads included (``threading`` sees only
    Python's)."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextmanager
def no_leaks() -> Iterator[Callable[[], None]]:
    """No fd and no thread (Python's or the lane's C threads) left by the block.

    A Python thread's ``join`` returns once its Python state is gone, a moment before the
    kernel reaps the thread, so ``/proc`` may still list a thread that was joined (CI saw
    one, 4 == 3). The block calls the yielded function while its devices are open to note
    their Python threads; a noted thread that ``threading`` says has ended is on its way
    out, not left behind. A C thread must be gone from ``/proc`` (the lane's are joined
    with ``pthread_join``), and so must any thread nobody noted."""
    Signal().close()  # the slot pool's page, made once per process
    noted: set[int] = set()

    def note_threads() -> None:
        noted.update(t.native_id for t in threading.enumerate() if t.native_id is not None)

    before = (_fds(), _tasks())
    yield note_threads
    alive = {t.native_id for t in threading.enumerate()}
    ending = noted - alive - before[1]
    assert noted  # the block called note_threads (an empty set: it never did)
    assert (_fds(), _tasks() - ending) == before


def _log(buf: hcqa.Buffer) -> list[int]:
    view = buf.numpy_view()
    return [int(v) for v in view[1 : 1 + view[0]]]


async def test_cpu_devices_without_inline_kernels_run_c_kernels_on_the_lane() -> None:
    async with hcqa.open_device("cpu:0", inline_kernels=False) as d:
        assert isinstance(d.compute.engine, LaneEngine)
        assert isinstance(d.copy.engine, LaneEngine)
        log = d.alloc(shape=(64,), dtype="int32")
        k = d.program("logc", LOG_C)
        before = d.compute.engine.native_runs
        for v in range(5):
            await k(log, vals=(v,))
        assert _log(log) == [0, 1, 2, 3, 4]
        assert d.compute.engine.native_runs - before == 5  # each ran without Python
    async with hcqa.open_device("cpu:0", inline_kernels=True) as d:
        assert not isinstance(d.compute.engine, LaneEngine)  # the opt-in keeps its engine


async def test_native_and_python_commands_keep_queue_order() -> None:
    async with hcqa.open_device("cpu:0", inline_kernels=False) as d:
        log = d.alloc(shape=(1024,), dtype="int32")
        kc, kp = d.program("logc", LOG_C), d.program("logp", logp)
        want: list[int] = []
        fence = None
        for i in range(300):  # eager launches, not awaited: runs queue up on both threads
            fence = (kc if (i * 7) % 3 else kp)(log, vals=(i,))
            want.append(i)
        q = d.compute_queue()  # and one batch mixing both, submitted again and again
        for j in range(6):
            q.exec(kc if j % 2 else kp, (log,), vals=(1000 + j,))
        for _ in range(20):
            fence = q.submit()
            want.extend(1000 + j for j in range(6))
        assert fence is not None
        await fence
        assert _log(log) == want
        engine = d.compute.engine
        assert isinstance(engine, LaneEngine) and engine.native_runs > 0


async def test_copies_and_signals_run_on_the_lane_in_order() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1", inline_kernels=False) as (d0, d1):
        a = d0.alloc(shape=(4096,), dtype="float32")
        b, c = (d1.alloc(shape=(4096,), dtype="float32") for _ in range(2))
        x = np.arange(4096, dtype=np.float32)
        await a.copyin(x)
        await hcqa.transfer(b, a)  # a foreign step on d0, completed by d1's lane
        await d0.synchronize()
        assert d0._timeline.foreign_done.value == d0._timeline.foreign_reserved == 1
        s = Signal(name="after the copy")
        try:
            q = d1.copy_queue().copy(c, b, b.nbytes).signal(s, 7).timestamp(s)
            t0 = time.monotonic_ns()
            await q.submit()
            assert s.value == 7 and s.timestamp * 1000 >= t0
            out = np.empty_like(x)
            await c.copyout(out)
            np.testing.assert_array_equal(out, x)
            engine = d1.copy.engine
            assert (
                isinstance(engine, LaneEngine) and engine.native_runs >= 1
            )  # (short copies: inline)
        finally:
            s.close()


async def test_a_python_fault_stops_the_lane_and_breaks_what_was_queued_behind() -> None:
    s = Signal(name="behind the fault")
    try:
        async with hcqa.open_device("cpu:0", inline_kernels=False, hang_limit=10) as d:
            out = d.alloc(shape=(4,), dtype="int32")
            setv = d.program("setv", SET_C)
            bad = ht.failing_kernel(d)(out)
            behind = [setv(out, vals=(9,)), d.compute_queue().signal(s, 1).submit()]
            with pytest.raises(DeviceFault):
                await bad
            for fence in behind:
                with pytest.raises(DeviceFault):
                    await fence
            with pytest.raises(DeviceFault):
                await s.wait(1)
            assert out.numpy_view()[0] == 0  # the C kernel behind the fault never ran
    except DeviceFault:
        pass  # raised again at close only if unobserved; it was observed
    finally:
        s.close()


def test_a_stopped_lane_skips_its_records_the_python_way() -> None:
    """Unit level: a native run behind a Python run that is held; the error set meanwhile:
    the lane runs nothing more, the Python thread breaks the signal and completes the other
    device's step (that device did nothing wrong), never this device's own step."""
    lib = library()
    assert lib is not None
    held, go = threading.Event(), threading.Event()

    def python_exec(c: Any) -> None:
        held.set()
        go.wait(10)

    mine = Timeline("mine", hang_limit=10.0, owner=None)
    theirs = Timeline("theirs", hang_limit=10.0, owner=None)
    user = Signal(name="user")
    engine = LaneEngine(
        "lane test", {cmd.Exec: python_exec}, on_fault=lambda c, e: None, encoders={}, lib=lib
    )
    engine.timeline = mine
    try:
        engine.start()
        fake: Any = _FakeProgram()
        engine.put([cmd.Exec(program=fake, buffers=())])  # a Python run: held
        own, foreign = mine.reserve(), theirs.reserve_foreign()
        engine.put(
            [
                cmd.Signal(signal=user, value=1),
                cmd.Step(timeline=mine, seq=own),
                cmd.Step(timeline=theirs, seq=foreign),
            ]
        )
        assert held.wait(10)
        error = RuntimeError("stop")
        engine.error = error
        go.set()
        engine.stop()
        engine.exited.wait_sync(1, timeout=10)
        assert engine.join(10)
        assert user.value == 0 and user.statistics().broken
        assert theirs.signal.value == foreign and theirs.foreign_done.value == 1
        assert mine.signal.value == 0  # the faulted device's own step never completes
    finally:
        go.set()
        engine.stop()
        engine.join(10)
        user.close()
        mine.close()
        theirs.close()


class _FakeProgram:
    name = "fake"
    kernel = None


async def test_closing_by_an_exception_skips_pending_lane_work_and_leaks_nothing() -> None:
    with no_leaks() as note_threads:
        fences: list[hcqa.Fence] = []
        with pytest.raises(KeyError):
            async with hcqa.open_device("cpu:0", inline_kernels=False, hang_limit=10) as d:
                note_threads()
                out = d.alloc(shape=(4,), dtype="int32")
                setv = d.program("setv", SET_C)
                prog, gate = ht.hanging_kernel(d)
                with gate:
                    fences.append(prog(out))
                    await gate.started.wait(1)
                    fences += [setv(out, vals=(k,)) for k in range(1, 50)]
                    raise KeyError("left by an exception")
        gate.close()
        for fence in fences[1:]:
            with pytest.raises(DeviceClosed):
                await fence


async def test_a_stuck_c_kernel_hits_the_hang_limit() -> None:
    go = os.eventfd(0, os.EFD_CLOEXEC)
    try:
        async with hcqa.open_device("cpu:0", inline_kernels=False, hang_limit=0.3) as d:
            buf = d.alloc(8)
            block = d.program("block", BLOCK_C)
            t0 = time.monotonic()
            with pytest.raises(SignalTimeout):
                await block(buf, vals=(go,))
            assert 0.25 < time.monotonic() - t0 < 5
            os.eventfd_write(go, 1)  # the kernel returns: the device can close
    finally:
        os.eventfd_write(go, 1)
        os.close(go)


async def test_nothing_spins_while_a_lane_waits() -> None:
    async with hcqa.open_device("cpu:0", inline_kernels=False) as d:
        log = d.alloc(shape=(64,), dtype="int32")
        kc = d.program("logc", LOG_C)
        prog, gate = ht.hanging_kernel(d)
        with gate:
            await kc(log, vals=(1,))
            held = prog(log)  # the Python thread holds; the lane waits at its turn
            behind = kc(log, vals=(2,))
            await gate.started.wait(1)
            cpu0 = time.process_time()
            await trio.sleep(0.5)  # a real thread is involved: real time, not a mock clock
            used = time.process_time() - cpu0
            gate.release()
            await held
            await behind
        gate.close()
        assert used < 0.02, f"{used:.3f} s of CPU in 0.5 s while the lane waited"
        cpu0 = time.process_time()
        await trio.sleep(0.5)  # and an idle lane, asleep on its bell
        assert time.process_time() - cpu0 < 0.02
        assert _log(log) == [1, 2]


async def test_a_tracer_sends_runs_to_the_python_engine(tmp_path: Any) -> None:
    from hcqa.trace import Tracer

    path = tmp_path / "lane.json"
    async with hcqa.open_device("cpu:0", inline_kernels=False) as d:
        log = d.alloc(shape=(64,), dtype="int32")
        kc = d.program("logc", LOG_C)
        engine = d.compute.engine
        assert isinstance(engine, LaneEngine)
        await kc(log, vals=(1,))
        before = engine.native_runs
        with Tracer(path):
            for v in range(2, 5):
                await kc(log, vals=(v,))
        assert engine.native_runs == before  # traced: every run through the handlers
        await kc(log, vals=(5,))
        assert engine.native_runs == before + 1
        assert _log(log) == [1, 2, 3, 4, 5]
    import json

    events = json.loads(path.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("name") == "logc" and e.get("ph") == "X") == 3


async def test_many_open_close_cycles_leave_no_threads_or_fds() -> None:
    with no_leaks() as note_threads:
        for _ in range(5):
            async with hcqa.open_devices("cpu:0", "cpu:1", inline_kernels=False) as (d0, d1):
                note_threads()
                a, b = d0.alloc(4096), d1.alloc(4096)
                kc = d0.program("setv", SET_C)
                await kc(a, vals=(3,))
                await hcqa.transfer(b, a)
                s = Signal()
                d1.compute_queue().signal(s, 1).submit()
                s.close()  # closed with a lane record queued on it: released later


async def test_a_signal_closed_while_queued_keeps_its_slot_until_the_lane_is_past() -> None:
    async with hcqa.open_device("cpu:0", inline_kernels=False, hang_limit=10) as d:
        prog, gate = ht.hanging_kernel(d)
        s = Signal(name="closed early")
        with gate:
            prog(d.alloc(8))
            await gate.started.wait(1)
            fence = d.compute_queue().signal(s, 5).submit()  # native, behind the held run
            s.close()
            fresh = Signal(name="fresh")  # must not get the closed signal's slot yet
            assert fresh.address != s._addr
            gate.release()
            await fence
        fresh.close()
        gate.close()


CLOSE_WHILE_A_LANE_COMPLETES = """
import numpy as np, trio, hcqa
N = 32 << 20
async def main():
    async with hcqa.open_devices("cpu:1") as (d1,):  # its copy queue is a lane
        a, b, dst = d1.alloc(N), d1.alloc(N), d1.alloc(N)
        for _ in range(20):
            async with hcqa.open_devices("cpu:0", inline_kernels=True) as (d0,):
                src = d0.alloc(N)
                src.numpy_view()[:] = 7
                for _ in range(3):
                    hcqa.transfer(b, a)  # the lane busy ...
                hcqa.transfer(dst, src)  # ... then completing cpu:0's foreign step
            await d1.synchronize()
            assert (dst.numpy_view()[::4096] == 7).all()
trio.run(main)
"""


def test_a_timeline_closes_only_once_the_lane_completing_its_step_let_go() -> None:
    """A device block closes as soon as another device's lane has completed its foreign
    step (a transfer reading its memory); the lane still holds the C timeline then (the
    count is stored before it unlocks and writes the eventfd): the timeline and its
    signals are released only once the lane ran past the step. Freed at once, the heap
    was corrupted within a few rounds (glibc aborts: malloc(): ... corrupted). In a
    child interpreter: a corrupted heap takes the process down."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", CLOSE_WHILE_A_LANE_COMPLETES],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MALLOC_CHECK_": "3"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


async def test_a_resubmitted_python_command_is_encoded_once() -> None:
    async with hcqa.open_device("cpu:0", inline_kernels=False) as d:
        engine = d.compute.engine
        assert isinstance(engine, LaneEngine)
        log = d.alloc(shape=(64,), dtype="int32")
        kp = d.program("logp", logp)
        calls: list[Any] = []
        encode = engine._encoders[cmd.Exec]

        def counting(c: Any) -> Any:
            calls.append(c)
            return encode(c)

        engine._encoders[cmd.Exec] = counting
        q = d.compute_queue()
        q.exec(kp, (log,), vals=(1,))
        for _ in range(3):
            await q.submit()
        assert len(calls) == 1  # refused once: "needs Python" is kept on the command
        assert _log(log) == [1, 1, 1]  # and it still runs, on the Python thread, each time


async def test_weakly_ordered_hosts_fence_between_wake_word_and_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a lock's release is no full barrier (ARM, POWER), a waiter that lowered its
    slot's wake word fences natively before it reads the value again: signals made then
    carry the fence, every lowering calls it, and waits on lane-written values still end."""
    import hcqa.signals as signals

    lib = library()
    assert lib is not None
    calls = 0

    def fence() -> None:
        nonlocal calls
        calls += 1
        lib.full_fence()

    monkeypatch.setattr(signals, "_WEAK_ORDER", True)
    monkeypatch.setattr(signals, "_full_fence", lambda: fence)
    async with hcqa.open_device("cpu:0") as d:
        prog = d.program("inc", "void inc(long *x) { x[0] += 1; }")
        buf = d.alloc(shape=(1,), dtype="int64")
        await buf.copyin(np.zeros(1, np.int64))
        for _ in range(50):
            await prog(buf)
        out = np.empty(1, np.int64)
        await buf.copyout(out)
    assert out[0] == 50
    assert calls > 0  # the timeline fences' waits lowered the wake word
    plain = Signal()  # a signal of the user's carries it too
    try:
        assert plain._fence is fence
    finally:
        plain.close()
