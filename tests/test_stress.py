"""Stress, bounded for CI: random programs over 3 devices from many tasks against numpy,
100k commands through one queue, concurrent replays, and the timeline wrap under load.

The random programs are checked against a reference that replays the *submission log*: every
enqueue is synchronous (it returns a Fence at once), so the order in which tasks happened to
submit is a total order, and buffer hazards must make the devices' result equal to running
the log sequentially, whatever the interleaving of tasks, queues and devices.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hcqa
from hcqa import Signal, Variable

U32 = np.uint32
L = 32  # elements per buffer
BUFS = 3  # buffers per device
DEVICES = ("cpu:0", "cpu:1", "cpu:2")
PARTS = {"all": (0, L), "lo": (0, L // 2), "hi": (L // 2, L)}
SAFE = 30.0

AXPK = """
void axpk(unsigned int *out, const unsigned int *a, int n, int k) {
    for (int i = 0; i < n; i++) out[i] = a[i] * 3u + (unsigned int)k;
}
"""
INC = """
#include <stdint.h>
void inc(uint64_t *c) { c[0] += 1; }
"""

# -- random programs over 3 devices -----------------------------------------------------------

Ref = Callable[[], None]
Place = tuple[int, int, str]  # device, buffer, part

places = st.tuples(
    st.integers(0, len(DEVICES) - 1), st.integers(0, BUFS - 1), st.sampled_from(list(PARTS))
)
ops = st.one_of(
    st.tuples(
        st.just("kernel"), places, st.integers(0, BUFS - 1), st.booleans(), st.integers(0, 99)
    ),
    st.tuples(st.just("copy"), places, st.integers(0, BUFS - 1)),
    st.tuples(st.just("transfer"), places, places),
    st.tuples(st.just("copyin"), places, st.integers(0, 2**16)),
    st.tuples(st.just("await")),
)
tasks = st.lists(st.lists(ops, min_size=1, max_size=25), min_size=2, max_size=8)


class World:
    """Three devices' buffers (and their views) plus the numpy reference of the same."""

    def __init__(self, devices: tuple[hcqa.Device, ...]) -> None:
        self.devices = devices
        self.bufs = [[d.alloc(shape=(L,), dtype=U32) for _ in range(BUFS)] for d in devices]
        self.views: dict[Place, hcqa.Buffer] = {}
        for di, row in enumerate(self.bufs):
            for bi, b in enumerate(row):
                for part, (lo, hi) in PARTS.items():
                    v = b if part == "all" else b.view(lo * 4, (hi - lo) * 4, dtype=U32)
                    self.views[(di, bi, part)] = v
        self.ref = np.zeros((len(devices), BUFS, L), dtype=U32)
        self.py = [d.program("axpk_py", _axpk_py) for d in devices]
        self.c = [d.program("axpk", AXPK) for d in devices]

    def sl(self, place: Place) -> npt.NDArray[np.uint32]:
        di, bi, part = place
        lo, hi = PARTS[part]
        return self.ref[di, bi, lo:hi]

    def submit(self, op: tuple[Any, ...]) -> hcqa.Fence | None:
        """Enqueue ``op`` and apply it to the reference, in that same order."""
        kind = op[0]
        if kind == "kernel":
            _, dst, src_buf, use_c, k = op
            src = (dst[0], src_buf, dst[2])
            out, a = self.views[dst], self.views[src]
            n = PARTS[dst[2]][1] - PARTS[dst[2]][0]
            fence: hcqa.Fence
            if use_c:
                fence = self.c[dst[0]](out, a, vals=(n, k))
            else:
                fence = self.py[dst[0]](out, a, vals=(k,))
            self.sl(dst)[:] = self.sl(src) * U32(3) + U32(k)
            return fence
        if kind == "copy":
            _, dst, src_buf = op
            src = (dst[0], src_buf, dst[2])
            q: hcqa.Queue = self.devices[dst[0]].copy_queue()
            fence = q.copy(self.views[dst], self.views[src], self.views[dst].nbytes).submit()
            self.sl(dst)[:] = self.sl(src)
            return fence
        if kind == "transfer":
            _, dst, src = op
            src = (src[0], src[1], dst[2])  # equal sizes: the same part on both sides
            fence = hcqa.transfer(self.views[dst], self.views[src])
            self.sl(dst)[:] = self.sl(src)
            return fence
        if kind == "copyin":
            _, dst, seed = op
            n = PARTS[dst[2]][1] - PARTS[dst[2]][0]
            data = np.arange(seed, seed + n, dtype=U32) * U32(2654435761)
            fence = self.views[dst].copyin(data)
            self.sl(dst)[:] = data
            return fence
        return None


def _axpk_py(out: npt.NDArray[np.uint32], a: npt.NDArray[np.uint32], k: int) -> None:
    np.multiply(a, U32(3), out=out)
    out += U32(k)


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(programs=tasks)
async def test_random_programs_over_three_devices_match_numpy(
    programs: list[list[tuple[Any, ...]]],
) -> None:
    async with hcqa.open_devices(*DEVICES, hang_limit=SAFE) as devices:
        world = World(devices)

        async def run(task_ops: list[tuple[Any, ...]]) -> None:
            last: hcqa.Fence | None = None
            for op in task_ops:
                if op[0] == "await":
                    if last is not None:
                        await last
                    continue
                last = world.submit(op)
                await trio.lowlevel.checkpoint()  # let the other tasks interleave

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for task_ops in programs:
                    nursery.start_soon(run, task_ops)
            for d in devices:
                await d.synchronize()
            for di, row in enumerate(world.bufs):
                for bi, b in enumerate(row):
                    got = np.empty(L, dtype=U32)
                    await b.copyout(got)
                    np.testing.assert_array_equal(got, world.ref[di, bi], err_msg=f"{di}/{bi}")


# -- 100k commands through one queue ----------------------------------------------------------


async def test_100k_commands_through_one_queue() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        counter = d.alloc(shape=(1,), dtype=np.uint64)
        await counter.copyin(np.zeros(1, np.uint64))
        inc = d.program("inc", INC)
        q = d.compute_queue()
        for _ in range(100):
            q.exec(inc, (counter,))
        fences: list[hcqa.Fence] = []
        start = trio.current_time()
        with trio.fail_after(60):
            for _ in range(1000):
                fences.append(await q.submit_async())
            await d.synchronize()
        took = trio.current_time() - start
        got = np.empty(1, np.uint64)
        await counter.copyout(got)
        assert int(got[0]) == 100_000
        assert all(f.reached for f in fences)
        assert [f.value for f in fences] == list(range(fences[0].value, fences[0].value + 1000))
        stats = d.statistics().queues[0]
        assert stats.submitted == stats.completed and stats.pending_batches == 0
        print(f"100k commands through one queue: {took:.2f} s ({took * 10:.2f} µs each)")


async def test_resubmitting_a_symbolic_queue_many_times() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=SAFE) as d:
        counter = d.alloc(shape=(1,), dtype=np.uint64)
        await counter.copyin(np.zeros(1, np.uint64))
        inc = d.program("inc", INC)
        done = Signal(name="batches done")
        v = Variable("v", 1, 2000)
        q = d.compute_queue()
        for _ in range(9):
            q.exec(inc, (counter,))
        q.signal(done, v * 2 - 1)  # patched per submit
        with trio.fail_after(60):
            for k in range(1, 2001):
                await q.submit_async(var_vals={v: k})
            await done.wait(2 * 2000 - 1)
            await d.synchronize()
        got = np.empty(1, np.uint64)
        await counter.copyout(got)
        assert int(got[0]) == 9 * 2000
        done.close()


# -- concurrent replays of one graph ----------------------------------------------------------


async def test_concurrent_replays_of_one_graph_serialize_in_submission_order() -> None:
    rng = random.Random(7)
    async with hcqa.open_devices(*DEVICES, hang_limit=SAFE) as (d0, d1, d2):
        x = d0.alloc(shape=(L,), dtype=U32)
        y = d1.alloc(shape=(L,), dtype=U32)
        z = d2.alloc(shape=(L,), dtype=U32)
        w = d0.alloc(shape=(L,), dtype=U32)
        start = np.arange(L, dtype=U32)
        await x.copyin(start)
        k = Variable("k", 0, 1000)
        f0, f1, f2 = (d.program("axpk", AXPK) for d in (d0, d1, d2))
        with hcqa.capture() as g:
            f0(x, x, vals=(L, k))
            hcqa.transfer(y, x)
            f1(y, y, vals=(L, k + 1))
            hcqa.transfer(z, y)
            f2(z, z, vals=(L, k * 2))
            hcqa.transfer(w, z)
        ref = {"x": start.copy()}
        log: list[int] = []

        def step(kv: int) -> None:
            xr = ref["x"] * U32(3) + U32(kv)
            yr = xr * U32(3) + U32(kv + 1)
            zr = yr * U32(3) + U32(kv * 2)
            ref.update(x=xr, y=yr, z=zr, w=zr)

        async def replayer(seed: int) -> None:
            r = random.Random(seed)
            for _ in range(15):
                kv = r.randrange(0, 1000)
                fence = g.submit(k=kv)
                log.append(kv)
                step(kv)
                if r.random() < 0.3:
                    await fence
                elif r.random() < 0.3:
                    log.append(kv)  # the async form submits before its first checkpoint
                    step(kv)
                    await g(k=kv)
                else:
                    await trio.lowlevel.checkpoint()

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(replayer, rng.randrange(1 << 30))
            for d in (d0, d1, d2):
                await d.synchronize()
        for name, buf in (("x", x), ("y", y), ("z", z), ("w", w)):
            got = np.empty(L, dtype=U32)
            await buf.copyout(got)
            np.testing.assert_array_equal(got, ref[name], err_msg=name)
        assert g.statistics().replays == len(log)


# -- the timeline wrap under load -------------------------------------------------------------


async def test_timeline_wrap_under_concurrent_load() -> None:
    start = 2**31 - 1000
    tasks_n, ops_per_task = 10, 500  # 5000 enqueues on d0
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=SAFE, timeline_start=start) as (
        d0,
        d1,
    ):
        first0, first1 = d0.timeline, d1.timeline
        inc = d0.program("inc", INC)
        counters = [d0.alloc(shape=(1,), dtype=np.uint64) for _ in range(tasks_n)]
        mirrors = [d1.alloc(shape=(1,), dtype=np.uint64) for _ in range(tasks_n)]
        scratch = [d0.alloc(64) for _ in range(tasks_n)]
        for c in counters:
            c.copyin(np.zeros(1, np.uint64))
        await d0.synchronize()
        base0, base1 = d0.statistics().timeline_reserved, d1.statistics().timeline_reserved
        fences: list[hcqa.Fence] = []
        incs = [0] * tasks_n
        mirrored: list[int | None] = [None] * tasks_n
        d1_steps = 0

        async def worker(t: int) -> None:
            nonlocal d1_steps
            r = random.Random(t)
            for i in range(ops_per_task):
                roll = r.random()
                if roll < 0.7:
                    fences.append(inc(counters[t]))
                    incs[t] += 1
                elif roll < 0.85:
                    fences.append(scratch[t].copyin(bytes([i % 256]) * 64))
                else:
                    fences.append(hcqa.transfer(mirrors[t], counters[t]))  # steps d1 and d0
                    mirrored[t] = incs[t]
                    d1_steps += 1
                if i % 50 == 49:
                    await fences[-1]  # park across the wrap now and then
                else:
                    await trio.lowlevel.checkpoint()

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for t in range(tasks_n):
                    nursery.start_soon(worker, t)
            await d0.synchronize()
            await d1.synchronize()
            for f in fences:
                await f
        total = tasks_n * ops_per_task
        assert all(f.reached for f in fences)
        assert d0.statistics().timeline_reserved == base0 + total
        assert d1.statistics().timeline_reserved == base1 + d1_steps
        assert d0.timeline is not first0  # d0 wrapped onto its shadow signal
        assert d0.timeline.value == base0 + total - 2**31
        assert first0.value == 2**31
        wrapped1 = base1 + d1_steps > 2**31
        assert (d1.timeline is not first1) == wrapped1
        for t in range(tasks_n):
            got = np.empty(1, np.uint64)
            await counters[t].copyout(got)
            assert int(got[0]) == incs[t]
            if mirrored[t] is not None:
                await mirrors[t].copyout(got)
                assert int(got[0]) == mirrored[t]


@pytest.mark.parametrize("host_visible", [True, False])
async def test_many_tasks_hammer_one_device_with_mixed_work(host_visible: bool) -> None:
    """200 tasks x 20 enqueues over both queues, awaiting as they go."""
    async with hcqa.open_device("cpu:0", hang_limit=SAFE, host_visible=host_visible) as d:
        inc = d.program("inc", INC)
        counters = [d.alloc(shape=(1,), dtype=np.uint64) for _ in range(200)]
        for c in counters:
            c.copyin(np.zeros(1, np.uint64))

        async def worker(t: int) -> None:
            for i in range(20):
                fence = inc(counters[t])
                if i % 5 == 4:
                    got = np.empty(1, np.uint64)
                    await counters[t].copyout(got)
                    assert int(got[0]) == i + 1
                else:
                    await fence

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for t in range(200):
                    nursery.start_soon(worker, t)
        await d.synchronize()
