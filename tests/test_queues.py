"""The HCQ-style Queue builder: verbs, resubmission with variables, errors, backpressure."""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing
from _kinds import Count, add1, spec, specs

import hcqa
from hcqa import InvalidCommand, QueueFull, Signal, Variable

ADD1 = """
void add1(float *out, const float *a, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + 1.0f;
}
"""

N = 16


def _f32(n: int = N) -> npt.NDArray[np.float32]:
    return np.arange(n, dtype=np.float32) * 1.5


async def _read(buf: hcqa.Buffer) -> npt.NDArray[Any]:
    assert buf.dtype is not None
    out = np.empty(buf.nbytes // buf.dtype.itemsize, dtype=buf.dtype)
    await buf.copyout(out)
    return out


class Counter:
    """A Python kernel that counts its runs and records what it saw."""

    def __init__(self, seen: Signal | None = None) -> None:
        self.calls = 0
        self.seen_values: list[int] = []
        self._seen = seen

    def __call__(self, out: npt.NDArray[Any]) -> None:
        self.calls += 1
        if self._seen is not None:
            self.seen_values.append(self._seen.value)


# -- verbs -------------------------------------------------------------------------------


async def test_verbs_chain_wait_exec_signal(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = add1(d)
        a = d.alloc(shape=(N,), dtype="float32")
        out = d.alloc(shape=(N,), dtype="float32")
        x = _f32()
        await a.copyin(x)
        s = Signal()
        q = d.compute_queue()
        assert q.wait(s, 1).exec(prog, (out, a), vals=(N,)).signal(s, 2) is q
        assert len(q) == 3
        fence = q.submit()
        await trio.testing.wait_all_tasks_blocked()
        assert s.value == 0
        assert not fence.reached
        assert d.statistics().queues[0].waiting
        s.value = 1
        with trio.fail_after(5):
            await s.wait(2)
            await fence
        assert s.value == 2
        np.testing.assert_array_equal(await _read(out), x + 1)


async def test_memory_barrier_runs_on_both_queues(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        s = Signal()
        f1 = d.compute_queue().memory_barrier().signal(s, 1).submit()
        f2 = d.copy_queue().wait(s, 1).memory_barrier().signal(s, 2).submit()
        with trio.fail_after(5):
            await s.wait(2)
            await f1
            await f2


async def test_timestamp_writes_host_clock_microseconds(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        s, done = Signal(), Signal()
        t0 = time.monotonic_ns() / 1000
        fence = d.copy_queue().timestamp(s).signal(done, 1).submit()
        with trio.fail_after(5):
            await done.wait(1)
        t1 = time.monotonic_ns() / 1000
        assert t0 <= s.timestamp <= t1
        assert s.value == 0  # a timestamp leaves the value alone
        await fence


async def test_timed_measures_the_kernel() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:

        def slow(out: npt.NDArray[Any]) -> None:
            time.sleep(0.02)
            out[:] = 7

        prog = d.program("slow", slow)
        out = d.alloc(64)
        with trio.fail_after(5):
            secs = await prog.timed(out)
        assert isinstance(secs, float)
        assert 0.015 <= secs < 2.0
        assert (out.numpy_view() == 7).all()


async def test_queue_statistics_count_batches(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        count = Count()
        prog = count.program(d)
        out = d.alloc(16)
        await count.zero(out)
        q = d.compute_queue().exec(prog, (out,))
        for _ in range(3):
            q.submit()
        await d.synchronize()
        stats = d.statistics().queues[0]
        assert isinstance(stats, hcqa.actors.QueueStatistics)
        assert (stats.name, stats.kind) == (f"{d.name} compute", "compute")
        assert (stats.submitted, stats.completed, stats.pending_batches) == (3, 3, 0)
        assert stats.capacity == 1024
        assert not stats.waiting
        assert await count.calls(out) == 3


# -- variables ---------------------------------------------------------------------------


async def test_resubmit_100_times_with_signal_values() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=5) as d:
        s = Signal()
        counter = Counter(seen=s)
        prog = d.program("count", counter)
        out = d.alloc(16)
        v = Variable("v", 0, 2**32 - 1)
        q2 = d.compute_queue().exec(prog, (out,)).signal(s, v)
        assert q2.variables == {v}
        fences = []
        for k in range(3, 103):
            vals: dict[Variable | str, int] = {v: k} if k % 2 else {"v": k}
            fences.append(q2.submit(var_vals=vals))
        with trio.fail_after(5):
            await s.wait(102)
            await fences[-1]
        assert s.value == 102
        assert counter.calls == 100
        # each run saw the value the run before it signalled: in order, none lost
        assert counter.seen_values == [0, *range(3, 102)]
        assert all(f.reached for f in fences)


async def test_wait_and_signal_expressions(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        s = Signal()
        v = Variable("v", 1, 100)
        q = d.compute_queue().wait(s, v - 1).signal(s, v * 2 + 1)
        q.submit(var_vals={v: 5})
        await trio.testing.wait_all_tasks_blocked()
        assert s.value == 0
        s.value = 4
        with trio.fail_after(5):
            await s.wait(11)
        assert s.value == 11


async def test_variable_in_c_kernel_vals(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = add1(d)
        a = d.alloc(shape=(N,), dtype="float32")
        out = d.alloc(shape=(N,), dtype="float32")
        x = _f32()
        await a.copyin(x)
        await out.copyin(np.zeros(N, np.float32))
        n = Variable("n", 1, N)
        q = d.compute_queue().exec(prog, (out, a), vals=(n,))
        await q.submit(var_vals={n: 5})
        got = await _read(out)
        np.testing.assert_array_equal(got[:5], x[:5] + 1)
        np.testing.assert_array_equal(got[5:], 0)
        q2 = d.compute_queue().exec(prog, (out, a), vals=(n * 2,))
        await q2.submit(var_vals={"n": 6})
        got = await _read(out)
        np.testing.assert_array_equal(got[:12], x[:12] + 1)
        np.testing.assert_array_equal(got[12:], 0)


async def test_variable_in_copy_size(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        src = d.alloc(64)
        dst = d.alloc(64)
        await src.copyin(bytes(range(64)))
        await dst.copyin(bytes(64))
        nb = Variable("nb", 1, 16)
        q = d.copy_queue().copy(dst, src, nb * 4)
        await q.submit(var_vals={nb: 4})
        got = bytearray(64)
        await dst.copyout(got)
        assert got == bytes(range(16)) + bytes(48)
        await q.submit(var_vals={nb: 16})
        await dst.copyout(got)
        assert got == bytes(range(64))


def _bad_bindings() -> list[Any]:
    return [None, {}, {"w": 3}, {"v": 0}, {"v": 11}]


@pytest.mark.parametrize("var_vals", _bad_bindings())
async def test_unbound_or_out_of_range_queues_nothing(var_vals: Any, kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        count = Count()
        prog = count.program(d)
        out = d.alloc(16)
        await count.zero(out)
        s = Signal()
        v = Variable("v", 1, 10)
        q = d.compute_queue().exec(prog, (out,)).signal(s, v)
        await d.synchronize()
        await trio.testing.wait_all_tasks_blocked()
        before = d.statistics()
        with pytest.raises(InvalidCommand, match="'v'"):
            q.submit(var_vals=var_vals)
        with pytest.raises(InvalidCommand, match="'v'"):
            await q.submit_async(var_vals=var_vals)
        await trio.testing.wait_all_tasks_blocked()
        assert d.statistics() == before
        assert await count.calls(out) == 0  # (on opencl, a copyout: one more on the timeline)
        assert s.value == 0
        # the queue itself is still good
        reserved = d.statistics().timeline_reserved
        await q.submit(var_vals={v: 7})
        assert d.statistics().timeline_reserved == reserved + 1
        assert (await count.calls(out), s.value) == (1, 7)


async def test_bad_resolved_values_queue_nothing(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = add1(d)
        a = d.alloc(shape=(N,), dtype="float32")
        out = d.alloc(shape=(N,), dtype="float32")
        s = Signal()
        v = Variable("v", 0, 2**40)
        bad: list[tuple[hcqa.Queue, dict[Variable | str, int]]] = [
            # a C int val out of the int range
            (d.compute_queue().exec(prog, (out, a), vals=(v,)), {v: 2**31}),
            # a signal value below 0
            (d.compute_queue().signal(s, v - 1), {v: 0}),
            # a copy past the end of the buffers
            (d.copy_queue().copy(out, a, v), {v: out.nbytes + 1}),
            # a copy of 0 bytes
            (d.copy_queue().copy(out, a, v), {v: 0}),
        ]
        await d.synchronize()
        before = d.statistics()
        for q, vals in bad:
            with pytest.raises(InvalidCommand):
                q.submit(var_vals=vals)
        assert d.statistics() == before


async def test_c_kernel_variable_out_of_c_range_message(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = add1(d)
        a = d.alloc(shape=(N,), dtype="float32")
        out = d.alloc(shape=(N,), dtype="float32")
        n = Variable("n", -(2**40), 2**40)
        q = d.compute_queue().exec(prog, (out, a), vals=(n,))
        with pytest.raises(InvalidCommand, match=r"'n'.*2147483647.*got 2147483648"):
            q.submit(var_vals={n: 2**31})


# -- wrong queue, wrong types ------------------------------------------------------------


async def test_exec_on_copy_queue_and_copy_on_compute_queue(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = Count().program(d)
        a, b = d.alloc(16), d.alloc(16)
        with pytest.raises(InvalidCommand, match="compute queue"):
            d.copy_queue().exec(prog, (a,))
        with pytest.raises(InvalidCommand, match="copy queue"):
            d.compute_queue().copy(a, b, 16)


async def test_cross_device_exec_and_copy_refused(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind, 2), hang_limit=5) as (d0, d1):
        prog0 = Count().program(d0)
        a0, a1, b1 = d0.alloc(16), d1.alloc(16), d1.alloc(16)
        with pytest.raises(InvalidCommand, match=re.escape(d1.name)):
            d1.compute_queue().exec(prog0, (a1,))
        with pytest.raises(InvalidCommand, match=re.escape(d0.name)):
            d0.compute_queue().exec(prog0, (a1,))
        with pytest.raises(InvalidCommand, match="transfer"):
            d1.copy_queue().copy(b1, a0, 16)


async def test_copy_size_checked_at_build(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        a, b = d.alloc(16), d.alloc(32)
        q = d.copy_queue()
        for n in (0, -1, 17):
            with pytest.raises(InvalidCommand, match="nbytes"):
                q.copy(b, a, n)
        assert len(q) == 0


async def test_wrong_types(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        prog = Count().program(d)
        a = d.alloc(16)
        s = Signal()
        cq, kq = d.compute_queue(), d.copy_queue()
        with pytest.raises(TypeError):
            cq.wait("s", 1)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            cq.wait(s, 1.0)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            cq.signal(s, True)
        with pytest.raises(TypeError):
            cq.signal(d.timeline.value, 1)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            cq.timestamp(None)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            cq.exec(lambda out: None, (a,))  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            cq.exec(prog, a)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            cq.exec(prog, (np.zeros(4),))  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            cq.exec(prog, (a,), vals=(1.5,))  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            kq.copy(np.zeros(16, np.uint8), a, 16)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            kq.copy(a, a, "16")  # type: ignore[arg-type]
        with pytest.raises(InvalidCommand):
            cq.wait(s, -1)
        with pytest.raises(InvalidCommand):
            cq.signal(s, 2**64)
        assert len(cq) == 0
        assert len(kq) == 0


async def test_queue_of_closed_device(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        s = Signal()
        q = d.compute_queue().signal(s, 1)
    with pytest.raises(hcqa.DeviceClosed):
        q.submit()
    with pytest.raises(hcqa.DeviceClosed):
        q.signal(s, 2)


# -- backpressure ------------------------------------------------------------------------


async def _fill(d: hcqa.Device, q: hcqa.Queue, gate: Signal) -> list[hcqa.Fence]:
    """Block the compute queue on ``gate`` and submit ``q`` until QueueFull."""
    d.compute_queue().wait(gate, 1).submit()
    await trio.testing.wait_all_tasks_blocked()  # the actor took the batch and waits
    fences: list[hcqa.Fence] = []
    with pytest.raises(QueueFull, match=re.escape(f"{d.name} compute")):
        for _ in range(10):
            fences.append(q.submit())
    return fences


async def test_submit_raises_queue_full(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5, queue_depth=2) as d:
        count = Count()
        prog = count.program(d)
        out = d.alloc(16)
        await count.zero(out)
        reserved = d.statistics().timeline_reserved
        gate = Signal()
        q = d.compute_queue().exec(prog, (out,))
        fences = await _fill(d, q, gate)
        assert len(fences) == 2
        before = d.statistics()
        assert before.queues[0].pending_batches == 2
        with pytest.raises(QueueFull):
            q.submit()
        with pytest.raises(QueueFull):
            prog(out)
        assert d.statistics() == before
        gate.value = 1
        with trio.fail_after(5):
            for f in fences:
                await f
            await d.synchronize()
        assert d.statistics().timeline_reserved == reserved + 3
        assert await count.calls(out) == 2
        # room again
        await q.submit()
        assert await count.calls(out) == 3


async def test_submit_async_waits_for_room(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5, queue_depth=2) as d:
        count = Count()
        prog = count.program(d)
        out = d.alloc(16)
        await count.zero(out)
        reserved = d.statistics().timeline_reserved
        gate = Signal()
        q = d.compute_queue().exec(prog, (out,))
        fences = await _fill(d, q, gate)
        late: list[hcqa.Fence] = []

        async def submit_late() -> None:
            late.append(await q.submit_async())

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(submit_late)
                await trio.testing.wait_all_tasks_blocked()
                assert late == []  # held back, nothing queued
                assert d.statistics().timeline_reserved == reserved + 3
                gate.value = 1
            await late[0]
            for f in fences:
                assert f.reached
        assert await count.calls(out) == 3


async def test_submit_async_on_room_is_immediate(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=5) as d:
        count = Count()
        prog = count.program(d)
        out = d.alloc(16)
        await count.zero(out)
        fence = await d.compute_queue().exec(prog, (out,)).submit_async()
        await fence
        assert await count.calls(out) == 1
