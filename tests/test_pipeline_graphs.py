"""Pipeline stages that are captured Graphs, and graphs recorded inside other captures.

A Graph stage is a graph captured with its own input and output buffers; each microbatch slot
records it on buffers of its own (``g.submit(buffers=...)`` inside the slot's capture), while the
graph's other buffers (weights, scratch) stay shared. The answers are checked against numpy; the
slots' independence with more microbatches in flight than one graph's buffers could hold.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing

import hcqa
from hcqa import InvalidCommand, Pipeline, Stage

F32 = npt.NDArray[np.float32]


def affine(out: F32, a: F32, w: F32) -> None:
    np.add(a * 2, w, out=out)


def square(out: F32, a: F32) -> None:
    np.multiply(a, a, out=out)


def halve(out: F32, a: F32) -> None:
    np.multiply(a, 0.5, out=out)


def _graph(dev: hcqa.Device, shape: tuple[int, ...], w: float) -> tuple[hcqa.Graph, Any, Any]:
    """out = ((x * 2 + w) ** 2): two kernels through a scratch buffer, a weight buffer."""
    inp = dev.alloc(shape=shape, dtype=np.float32)
    tmp = dev.alloc(shape=shape, dtype=np.float32)
    out = dev.alloc(shape=shape, dtype=np.float32)
    weight = dev.alloc(shape=shape, dtype=np.float32)
    weight.copyin(np.full(shape, w, np.float32))
    k1 = dev.program("affine", affine)
    k2 = dev.program("square", square)
    with hcqa.capture() as g:
        k1(tmp, inp, weight)
        k2(out, tmp)
    return g, inp, out


def _want(x: F32, w: float) -> F32:
    y: F32 = (x * 2 + w) ** 2
    return y


async def test_graph_stages_on_two_devices_answer_per_microbatch() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        g0, i0, o0 = _graph(d0, (6,), 1.0)
        g1, i1, o1 = _graph(d1, (6,), -3.0)
        pipe = Pipeline(
            [
                Stage(device=d0, program=g0, in_buffer=i0, out_buffer=o0),
                Stage(device=d1, program=halve),
                Stage(device=d1, program=g1, in_buffer=i1, out_buffer=o1),
            ],
            in_shape=(6,),
            depth=3,
        )
        assert pipe.out_shape == (6,) and pipe.out_dtype == np.float32
        xs = [np.arange(6, dtype=np.float32) + k for k in range(12)]
        ys = await pipe.map(xs)
        for x, y in zip(xs, ys, strict=True):
            np.testing.assert_array_equal(y, _want(_want(x, 1.0) * 0.5, -3.0))
        np.testing.assert_array_equal(await pipe(xs[3]), ys[3])
        assert pipe.statistics().completed == 13
        # the graphs ran on the slots' buffers, not on the ones they were captured with
        assert g0.statistics().replays == 0


async def test_a_graph_recorded_in_a_capture_runs_there_on_the_given_buffers() -> None:
    async with hcqa.open_devices("cpu:0") as (d0,):
        g, inp, out = _graph(d0, (3,), 2.0)
        a = d0.alloc(shape=(3,), dtype=np.float32)
        b = d0.alloc(shape=(3,), dtype=np.float32)
        c = d0.alloc(shape=(3,), dtype=np.float32)
        with hcqa.capture() as outer:
            g.submit(buffers={inp: a, out: b})
            g.submit(buffers={inp: b, out: c})
        assert outer.statistics().nodes == 4
        x = np.array([1, 2, 3], np.float32)
        await a.copyin(x)
        await outer()
        got = np.zeros(3, np.float32)
        await c.copyout(got)
        np.testing.assert_array_equal(got, _want(_want(x, 2.0), 2.0))
        with hcqa.capture():
            with pytest.raises(InvalidCommand, match="can't be awaited inside a capture"):
                await g()
            with pytest.raises(InvalidCommand, match=r"keeps its variables.*\['n'\]"):
                g.submit(n=1)


async def test_a_recorded_graph_waits_for_what_writes_its_new_buffers() -> None:
    """The rebound input is written on another device, behind a kernel held at a gate: the
    graph's kernel must wait for that transfer (its hazards are on the new buffers)."""
    gate, done = threading.Event(), threading.Event()
    seen: list[bool] = []

    def held(out: F32, a: F32) -> None:
        assert gate.wait(10.0)
        out[...] = a + 1
        done.set()

    def check(out: F32, a: F32) -> None:
        seen.append(done.is_set())
        out[...] = a * 3

    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        inp, out = (d1.alloc(shape=(2,), dtype=np.float32) for _ in range(2))
        with hcqa.capture() as g:
            d1.program("check", check)(out, inp)
        src, a, b, c = (d.alloc(shape=(2,), dtype=np.float32) for d in (d0, d0, d1, d1))
        await src.copyin(np.array([1, 2], np.float32))
        with hcqa.capture() as outer:
            d0.program("held", held)(a, src)
            hcqa.transfer(b, a)
            g.submit(buffers={inp: b, out: c})
        fence = outer.submit()
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
        await fence
        got = np.zeros(2, np.float32)
        await c.copyout(got)
        np.testing.assert_array_equal(got, [6, 9])
        assert seen == [True]


async def test_wrong_graph_stages_are_refused_before_anything_is_queued() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        g, inp, out = _graph(d0, (4,), 0.0)
        other = d0.alloc(shape=(4,), dtype=np.float32)
        n = hcqa.Variable("n", 1, 4)
        k = d0.program("square", square)
        with hcqa.capture() as gv:
            k(out, inp, global_size=(n, 1, 1))
        arena = d0.alloc(32)
        whole = arena.view(0, 32, dtype=np.float32, shape=(8,))
        half = arena.view(0, 16, dtype=np.float32, shape=(4,))
        with hcqa.capture() as gs:
            k(whole, whole)
            k(half, half)
        before = d0.statistics()
        cases: list[tuple[Any, str]] = [
            ([(d0, g)], r"stage 0: a Graph stage needs its in_buffer"),
            ([Stage(device=d0, program=g, in_buffer=other, out_buffer=out)],
             "in_buffer .* must be a buffer the graph captured"),
            ([Stage(device=d1, program=g, in_buffer=inp, out_buffer=out)],
             "in_buffer must be on cpu:1, the stage's device"),
            ([Stage(device=d0, program=gv, in_buffer=inp, out_buffer=out)],
             r"the graph has variables \['n'\]"),
            ([Stage(device=d0, program=g, in_buffer=inp, out_buffer=out, out_shape=(2,))],
             "out_shape and out_dtype are a program stage's"),
            ([Stage(device=d0, program=g, in_buffer=inp, out_buffer=out, vals=(1,))],
             "params, vals, out_shape"),
            ([Stage(device=d0, program=square, in_buffer=inp)],
             "in_buffer / out_buffer are for a Graph stage"),
            ([Stage(device=d0, program=gs, in_buffer=half, out_buffer=half)],
             r"stage 0: .*can't be rebound: the graph also uses its memory"),
        ]  # fmt: skip
        for stages, match in cases:
            with pytest.raises(InvalidCommand, match=match):
                Pipeline(stages, in_shape=(4,))
        with pytest.raises(InvalidCommand, match=r"in_buffer must be float32\[8\]"):
            Pipeline([Stage(device=d0, program=g, in_buffer=inp, out_buffer=out)], in_shape=(8,))
        with hcqa.capture() as open_graph:
            with pytest.raises(InvalidCommand, match="capture block must have ended"):
                Pipeline(
                    [Stage(device=d0, program=open_graph, in_buffer=inp, out_buffer=out)],
                    in_shape=(4,),
                )
            k(out, inp)
        assert d0.statistics().queues == before.queues
        await trio.lowlevel.checkpoint()
