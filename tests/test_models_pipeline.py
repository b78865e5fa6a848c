"""hcqa.models.pipeline: a model cut across devices, one stage per device.

The answers are compared with the model's own on one device, bit for bit (the same sources,
the same flags, on cpu:N); the cuts with the front end's cost estimates; what crosses a cut with
a byte-by-byte replay of the kernels' reads and writes (an oracle independent of the interval
maps the planner keeps).
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from _kinds import specs

import hcqa

pytest.importorskip("tinygrad")
from hcqa import aio, models
from hcqa.models import cut
from hcqa.models.lifted import Lifted


def _mlp(where: str, seed: int = 0) -> tuple[Any, np.ndarray]:
    """A matmul of 64x96 followed by a small matmul and a softmax's four small kernels: few
    kernels carry most of the cost."""
    from tinygrad import Tensor

    rng = np.random.default_rng(seed)
    w1 = Tensor(rng.standard_normal((64, 96)).astype(np.float32), device=where).realize()
    b1 = Tensor(rng.standard_normal(96).astype(np.float32), device=where).realize()
    w2 = Tensor(rng.standard_normal((96, 10)).astype(np.float32), device=where).realize()

    def forward(x: Any) -> Any:
        return ((x @ w1 + b1).relu() @ w2).softmax(-1)

    return forward, rng.standard_normal((8, 64)).astype(np.float32)


def _xs(n: int, shape: tuple[int, ...] = (8, 64)) -> list[np.ndarray]:
    return [
        np.random.default_rng(50 + i).standard_normal(shape).astype(np.float32) for i in range(n)
    ]


def _lifted(m: models.Model) -> Lifted:
    got = m._largest.lifted
    assert got is not None
    return got


def _crossing(lifted: Lifted, cuts: list[int]) -> set[tuple[int, int, int]]:
    """(base, byte, dst stage) of every byte a later stage reads that another stage wrote last:
    a byte-by-byte replay of the kernels, independent of the planner's interval maps."""
    stage_of = [sum(i >= c for c in cuts) for i in range(len(lifted.kernels))]
    last: dict[tuple[int, int], set[int]] = {}  # (base, byte) -> stages holding its value
    out: set[tuple[int, int, int]] = set()
    for i, k in enumerate(lifted.kernels):
        s = stage_of[i]
        for j in k.reads:
            a = k.args[j]
            for byte in range(a.offset, a.offset + a.nbytes):
                held = last.get((a.base, byte))
                if held and s not in held:
                    out.add((a.base, byte, s))
                    held.add(s)
        for j in k.writes:
            a = k.args[j]
            for byte in range(a.offset, a.offset + a.nbytes):
                last[(a.base, byte)] = {s}
    return out


def _moved(moves: tuple[cut.Move, ...]) -> set[tuple[int, int, int]]:
    return {(m.base, b, m.dst) for m in moves for b in range(m.offset, m.offset + m.nbytes)}


async def test_a_pipelined_mlp_answers_as_the_model_does_bit_for_bit(kind: str) -> None:
    """On cpu:0/cpu:1, and on two hcqa devices of the one OpenCL device (PoCL)."""
    async with hcqa.open_devices(*specs(kind, 2)) as (d0, d1):
        forward, x = _mlp(models.tinygrad_device(d0))
        m = await models.from_tinygrad(forward, [x], device=d0)
        pipe = models.pipeline(m, devices=[d0, d1], depth=3)
        assert [s.device for s in pipe.stages] == [d0, d1]
        await pipe.build()
        own = m._largest.buffers  # the model's own allocations, by base
        for i, stage in enumerate(pipe._plan.stages):  # d0 reads the model's weights; d1 a copy
            uses = pipe.graphs[0][i]._plan.allocations
            assert stage.weights
            assert all((id(own[b]._hazards) in uses) == (i == 0) for b in stage.weights)
        xs = _xs(9)
        ys = await pipe.map(xs)
        assert await pipe(xs[0]) is not ys[0]
        for a, y in zip(xs, ys, strict=True):
            assert y.shape == (8, 10) and y.dtype == np.float32
            np.testing.assert_array_equal(y, await m(a))
        st = pipe.statistics()
        assert (st.completed, st.in_flight, st.cancelled, st.depth) == (10, 0, 0, 3)
        assert len(pipe.graphs) == 3  # per slot, a captured graph per stage on its device
        for slot in pipe.graphs:
            assert [g.statistics().devices for g in slot] == [1, 1]
            assert {p.actor.device for g in slot for p in g._plan.parts} == {d0, d1}


async def test_the_cut_balances_the_front_ends_costs_not_kernel_counts() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        forward, x = _mlp(models.tinygrad_device(d0))
        m = await models.from_tinygrad(forward, [x], device=d0)
        kernels = _lifted(m).kernels
        costs = [cut.cost(k) for k in kernels]
        assert all(k.ops > 0 and k.mem > 0 for k in kernels)  # tinygrad's estimates, read

        def worst(c: int) -> int:
            return max(sum(costs[:c]), sum(costs[c:]))

        best = min(range(1, len(kernels)), key=worst)
        by_count = len(kernels) // 2
        assert worst(best) < worst(by_count)  # here the two ways of balancing differ
        pipe = models.pipeline(m, devices=[d0, d1])
        assert pipe.stages[0].stop == best != by_count
        assert [s.cost for s in pipe.stages] == [sum(costs[:best]), sum(costs[best:])]
        counted = models.pipeline(m, devices=[d0, d1], cuts=[by_count])
        assert counted.stages[0].stop == by_count
        for a in _xs(2):
            np.testing.assert_array_equal(await counted(a), await m(a))


def test_balance_minimises_the_costliest_stage() -> None:
    assert cut.balance([10, 1, 1, 1, 1], 2) == [1]
    assert cut.balance([1, 1, 1, 1, 10], 2) == [4]
    assert cut.balance([3, 3, 3, 3, 3, 3], 3) == [2, 4]
    assert cut.balance([5, 1, 1, 5, 1, 1], 3) == [2, 4]  # 6, 6, 2: not 5, 2, 7
    assert cut.balance([1, 2], 2) == [1]


async def test_only_the_bytes_a_later_stage_reads_cross_at_any_cut() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1", "cpu:2") as (d0, d1, d2):
        forward, x = _mlp(models.tinygrad_device(d0), seed=2)
        m = await models.from_tinygrad(forward, [x], device=d0)
        lifted = _lifted(m)
        n = len(lifted.kernels)
        arena = max(b.nbytes for b in lifted.bases if b.role == "scratch")
        xs = _xs(2)
        want = [await m(a) for a in xs]
        for c in range(1, n):
            pipe = models.pipeline(m, devices=[d0, d1], cuts=[c])
            assert _moved(pipe.moves) == _crossing(lifted, [c])
            assert all(mv.src == 0 and mv.dst == 1 for mv in pipe.moves)
            assert sum(mv.nbytes for mv in pipe.moves) < arena  # ranges, not the arena
            for a, w in zip(xs, want, strict=True):
                np.testing.assert_array_equal(await pipe(a), w)
        three = models.pipeline(m, devices=[d0, d1, d2], cuts=[1, n - 1])
        assert _moved(three.moves) == _crossing(lifted, [1, n - 1])
        np.testing.assert_array_equal(await three(xs[0]), want[0])
        # after the first matmul only its output (8 x 96 floats) crosses
        first = models.pipeline(m, devices=[d0, d1], cuts=[1])
        assert [mv.nbytes for mv in first.moves] == [8 * 96 * 4]


async def test_an_input_every_stage_reads_is_copied_in_to_each_not_moved() -> None:
    from tinygrad import Tensor

    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        where = models.tinygrad_device(d0)
        w = Tensor(np.random.default_rng(1).standard_normal((32, 32)).astype(np.float32),
                   device=where).realize()  # fmt: skip

        def residual(x: Any) -> Any:
            h = (x @ w).relu()
            return (h @ w).relu() + x  # the input again, at the end

        x = _xs(1, (4, 32))[0]
        m = await models.from_tinygrad(residual, [x], device=d0)
        lifted = _lifted(m)
        pipe = models.pipeline(m, devices=[d0, d1], cuts=[1])
        plan = pipe._plan
        assert plan.stages[0].inputs == (0,) and plan.stages[1].inputs == (0,)
        inputs = {a.base for _, a in lifted.inputs}
        assert not any(mv.base in inputs for mv in pipe.moves)
        for a in _xs(3, (4, 32)):
            np.testing.assert_array_equal(await pipe(a), await m(a))


def _onnx_mlp(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    inits = [
        numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
        for n, s in (("W1", (16, 48)), ("B1", (48,)), ("W2", (48, 6)), ("B2", (6,)))
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "B1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "W2", "B2"], ["z"]),
        helper.make_node("Softmax", ["z"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


async def test_an_onnx_model_on_tinygrads_kernels_pipelines_and_onnxruntimes_is_refused(
    tmp_path: Path,
) -> None:
    path = _onnx_mlp(tmp_path / "mlp.onnx")
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        m = await models.load_onnx(path, device=d0, batch_sizes=(2, 4))
        pipe = models.pipeline(m, devices=[d0, d1], depth=2)
        for rows in (4, 3, 1):  # padded into the largest size, its own rows returned
            a = _xs(1, (rows, 16))[0]
            got = await pipe(a)
            assert got.shape == (rows, 6)
            np.testing.assert_array_equal(got, await m(a))
        alone = models.pipeline(m, devices=[d1])  # one stage, on another device
        assert alone.moves == () and alone.stages[0].start == 0 and len(alone.stages) == 1
        np.testing.assert_array_equal(await alone(a), await m(a))
        small = models.pipeline(m, devices=[d0, d1], batch_size=2)
        a = _xs(1, (2, 16))[0]
        np.testing.assert_array_equal(await small(a), await m(a))
        with pytest.raises(hcqa.InvalidCommand, match=r"at most 2 rows \(got 4\)"):
            await small(_xs(1, (4, 16))[0])
        with pytest.raises(hcqa.InvalidCommand, match=r"'batch_size' must be one of"):
            models.pipeline(m, devices=[d0, d1], batch_size=3)
        r = await models.load_onnx(path, device=d0, backend="onnxruntime", batch_sizes=(2,))
        with pytest.raises(hcqa.InvalidCommand, match=r"one opaque kernel.*can.t be cut"):
            models.pipeline(r, devices=[d0, d1])


async def test_bad_arguments_are_refused_before_anything_is_queued() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        forward, x = _mlp(models.tinygrad_device(d0))
        m = await models.from_tinygrad(forward, [x], device=d0)
        n = len(_lifted(m).kernels)
        before = (d0.statistics(), d1.statistics())
        cases: list[tuple[dict[str, Any], str]] = [
            ({"devices": []}, r"at least one device \(got none\)"),
            ({"devices": [d0, d0]}, r"devices\[1\] \(cpu:0\) appears twice"),
            ({"devices": d0}, "must be a list of hcqa Devices"),
            ({"devices": [d0, "cpu:1"]}, r"devices\[1\] must be a hcqa Device \(got str\)"),
            ({"devices": [d0, d1], "depth": 0}, r"'depth' must be >= 1 \(got 0\)"),
            ({"devices": [d0, d1], "cuts": [0]}, r"'cuts' must be increasing"),
            ({"devices": [d0, d1], "cuts": [1, 2]}, r"'cuts' must hold 1 index"),
        ]
        for kw, match in cases:
            with pytest.raises(hcqa.InvalidCommand, match=match):
                models.pipeline(m, **kw)
        with pytest.raises(hcqa.InvalidCommand, match=r"must be a hcqa\.models\.Model"):
            models.pipeline(forward, devices=[d0, d1])  # type: ignore[arg-type]
        async with hcqa.open_devices(*(f"cpu:{i}" for i in range(2, n + 3))) as many:
            with pytest.raises(hcqa.InvalidCommand, match=rf"at most the model's {n} kernels"):
                models.pipeline(m, devices=list(many))
        pipe = models.pipeline(m, devices=[d0, d1])
        with pytest.raises(hcqa.InvalidCommand, match=r"must have shape \(8, 64\)"):
            await pipe(np.zeros((4, 64), np.float32))
        with pytest.raises(hcqa.InvalidCommand, match="takes 1 input"):
            await pipe.map([(x, x)])
        assert (d0.statistics(), d1.statistics()) == before
    async with hcqa.open_devices("cpu:2") as (gone,):
        pass
    async with hcqa.open_devices("cpu:0") as (d0,):
        with pytest.raises(hcqa.InvalidCommand, match=r"devices\[1\] \(cpu:2\) must be open"):
            models.pipeline(m, devices=[d0, gone])


async def test_cancelling_a_map_midway_leaves_the_pipeline_and_devices_answering() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        forward, x = _mlp(models.tinygrad_device(d0))
        m = await models.from_tinygrad(forward, [x], device=d0)
        pipe = models.pipeline(m, devices=[d0, d1], depth=2)
        await pipe.build()
        xs = _xs(24)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipe.map, xs)
            await pipe(xs[0])  # competes with the map for the two slots
            assert pipe.statistics().in_flight >= 1  # the map is mid-way
            nursery.cancel_scope.cancel()
        assert pipe.statistics().cancelled >= 1
        ys = await pipe.map(xs[:6])  # every slot comes back once its queued work is done
        for a, y in zip(xs[:6], ys, strict=True):
            np.testing.assert_array_equal(y, await m(a))
        assert pipe.statistics().in_flight == 0
        assert d0.faulted is None and d1.faulted is None


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_no_fd_or_thread_outlives_a_pipeline() -> None:
    async def once() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            forward, x = _mlp(models.tinygrad_device(d0))
            m = await models.from_tinygrad(forward, [x], device=d0)
            pipe = models.pipeline(m, devices=[d0, d1], depth=2)
            await pipe.map(_xs(4))

    await once()  # what stays loaded (compilers, caches) is loaded now
    gc.collect()
    fds, threads = _fds(), threading.active_count()
    await once()
    gc.collect()
    assert _fds() == fds
    assert threading.active_count() == threads


async def test_a_decoder_keeps_its_kv_cache_on_one_stage_and_generates_the_models_tokens() -> None:
    """Variables pass through per call; the cache the kernels write at ``start_pos`` (a part
    of their argument) stays on one stage, shared by the slots; a cut through it is refused."""
    from tinygrad import Tensor

    vocab, dim, ctx = 32, 16, 12
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        where = models.tinygrad_device(d0)
        rng = np.random.default_rng(7)
        emb, wq, wk, wv, wo = (
            Tensor(rng.standard_normal(s).astype(np.float32) * 0.5, device=where).realize()
            for s in ((vocab, dim), (dim, dim), (dim, dim), (dim, dim), (dim, vocab))
        )
        ck = Tensor.zeros(ctx, dim, device=where).contiguous().realize()
        cv = Tensor.zeros(ctx, dim, device=where).contiguous().realize()

        def step(tok: Any, start_pos: Any) -> Any:
            h = emb[tok]
            ck[start_pos : start_pos + 1].assign(h @ wk).realize()
            cv[start_pos : start_pos + 1].assign(h @ wv).realize()
            att = ((h @ wq) @ ck[: start_pos + 1].T / dim**0.5).softmax(-1)
            return ((h + att @ cv[: start_pos + 1]) @ wo).argmax(-1).cast("int32")

        m = await models.from_tinygrad(
            step, [np.array([0], np.int32)], device=d0, variables={"start_pos": (0, ctx - 1)}
        )
        lifted = _lifted(m)
        together = cut.kept(lifted)
        assert len(together) >= 2  # the two caches
        pipe = models.pipeline(m, devices=[d0, d1], depth=2)
        assert set(pipe._plan.state) == set(together)  # one copy each, on their stage
        for lo, hi in together.values():
            assert not any(lo < s.start <= hi for s in pipe.stages)
        ours, theirs = [3], [3]
        for pos in range(ctx - 1):
            ours.append(int((await pipe(np.array([ours[-1]], np.int32), start_pos=pos))[0]))
            theirs.append(int((await m(np.array([theirs[-1]], np.int32), start_pos=pos))[0]))
        assert ours == theirs and len(set(ours)) > 2
        with pytest.raises(hcqa.InvalidCommand, match=r"takes variables \['start_pos'\]"):
            await pipe(np.array([1], np.int32))
        lo, hi = next(iter(together.values()))
        with pytest.raises(hcqa.InvalidCommand, match="must stay on one stage"):
            models.pipeline(m, devices=[d0, d1], cuts=[hi])


async def _running(dev: hcqa.Device) -> models.ModelPipeline:
    """A model with state, ``s = x - s``, pipelined on ``dev`` with depth 2, built."""
    from tinygrad import Tensor

    where = models.tinygrad_device(dev)
    s = Tensor.zeros(4, device=where).contiguous().realize()
    ones = Tensor(np.ones(4, np.float32), device=where).realize()

    def step(x: Any) -> Any:
        s.assign(x - s).realize()
        return (s * ones).contiguous()

    m = await models.from_tinygrad(step, [np.zeros(4, np.float32)], device=dev)
    pipe = models.pipeline(m, [dev], depth=2)
    await pipe.build()
    return pipe


async def test_callers_woken_together_for_free_slots_still_run_in_call_order() -> None:
    """A model with state (``s = x - s``) pipelined with depth 2: calls 3 and 4 wait for a
    slot; both slots come free in one round of the event loop (here: the two units the test
    held), and trio runs a round's woken tasks in either order. 4 must still reach the device
    after 3 (trial after trial: each trial, half the time 4 is woken first)."""
    async with hcqa.open_devices("cpu:0") as (dev,):
        pipe = await _running(dev)
        state = 0.0
        for _ in range(12):
            got: dict[float, float] = {}

            async def call(x: float, got: dict[float, float] = got) -> None:
                got[x] = float((await pipe(np.full(4, x, np.float32)))[0])

            for _ in range(2):  # as two calls in flight would
                await pipe._pool._limit.acquire()
            async with trio.open_nursery() as nursery:
                for x in (5.0, 1.0):
                    nursery.start_soon(call, x)
                    await trio.testing.wait_all_tasks_blocked()
                pipe._pool._limit.release()  # both slots free in this round
                pipe._pool._limit.release()
            first = 5.0 - state
            state = 1.0 - first
            assert got == {5.0: first, 1.0: state}


def test_asyncio_callers_handed_to_the_host_together_run_in_call_order() -> None:
    """Two asyncio calls wait for a slot, each as a task of the trio host; trio starts both
    tasks in one round, in either order. 1 must still reach the device after 5."""

    async def main() -> None:
        async with hcqa.open_devices("cpu:0") as (dev,):
            pipe = await _running(dev)
            units = pipe._pool._limit

            async def free_both() -> None:  # (a trio task of the host)
                await trio.testing.wait_all_tasks_blocked()  # both calls wait
                units.release()
                units.release()

            state = 0.0
            for _ in range(12):
                units.acquire_nowait()
                units.acquire_nowait()
                calls = [asyncio.ensure_future(pipe(np.full(4, x, np.float32))) for x in (5, 1)]
                await aio.call(free_both)
                got = [float(y[0]) for y in await asyncio.gather(*calls)]
                first = 5.0 - state
                state = 1.0 - first
                assert got == [first, state]

    asyncio.run(main())
