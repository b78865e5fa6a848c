"""A Model keeps ``depth`` calls in flight: call k + 1 is queued on the device while call k runs.

The model here is built the way ``load_onnx(backend="onnxruntime")`` builds one (one Python
kernel per slot over the bucket's buffers, ``hcqa.models.onnx._ort_bucket``), around a stand-in
session whose ``run`` can hold on a ``threading.Event``: so the tests decide when the device
finishes a call, and need no onnxruntime."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import hcqa
from hcqa.errors import InvalidCommand
from hcqa.models import Model
from hcqa.models.lifted import TensorSpec
from hcqa.models.onnx import _ort_bucket
from hcqa.serve.targets import as_target

ROWS, WIDTH = 4, 3
BAD = -1.0  # a first value the session refuses, as onnxruntime refuses an id out of range
WAIT = 10.0  # seconds a thread waits for an event before the test fails (never the normal path)


class Session:
    """``y = 2 * x``; once armed, the first run holds until ``release`` and every run after it
    notes that it began in ``followed``."""

    def __init__(self) -> None:
        self.armed = False
        self.runs = 0
        self.holding, self.release = threading.Event(), threading.Event()
        self.followed = threading.Event()

    def get_outputs(self) -> list[Any]:
        return [TensorSpec("y", (None, WIDTH), np.dtype(np.float32))]

    def run(self, _: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        x = feeds["x"]
        if self.armed:
            self.runs += 1
            if self.runs == 1:
                self.holding.set()
                assert self.release.wait(WAIT)
            else:
                self.followed.set()
        if x[0, 0] == BAD:
            raise ValueError("index -1 is out of bounds")
        return [2 * x]


async def _model(dev: hcqa.Device, session: Session, depth: int) -> Model:
    spec = TensorSpec("x", (None, WIDTH), np.dtype(np.float32))
    bucket, outputs = await _ort_bucket(dev, session, [spec], ROWS, depth)
    out = TensorSpec(outputs[0].name, (None, WIDTH), outputs[0].dtype)
    return Model(
        name="double", device=dev, inputs=(spec,), outputs=(out,), buckets={ROWS: bucket},
        batched=True, backend="onnxruntime",
    )  # fmt: skip


def _rows(first: float) -> np.ndarray:
    x = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH) + 100 * first
    x[0, 0] = first
    return x


async def _two_calls(model: Model, session: Session, a: float, b: float) -> dict[float, Any]:
    """Call ``a`` (held in the kernel), then ``b``; returns each one's answer or error."""
    got: dict[float, Any] = {}

    async def call(first: float) -> None:
        try:
            got[first] = await model(_rows(first))
        except InvalidCommand as exc:
            got[first] = exc

    session.armed = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, a)
        assert await trio.to_thread.run_sync(session.holding.wait, WAIT)
        nursery.start_soon(call, b)
        await trio.testing.wait_all_tasks_blocked()
        session.release.set()
        # On purpose, the loop is blocked now: no loop turn can queue call b. It runs as soon
        # as a finishes only if it was queued on the device while a ran.
        assert session.followed.wait(WAIT), "call b was not queued while call a ran"
    return got


async def test_the_next_call_is_queued_on_the_device_while_one_runs() -> None:
    session = Session()
    async with hcqa.open_device("cpu:0") as dev:
        model = await _model(dev, session, depth=2)
        assert model.depth == 2 and as_target(model).depth == 2  # serve batches 2 at once
        got = await _two_calls(model, session, 1.0, 2.0)
        for first in (1.0, 2.0):  # each call its own rows, though they shared the buffers
            np.testing.assert_array_equal(got[first], 2 * _rows(first))
        assert model.statistics().calls == 2


@pytest.mark.parametrize("bad_first", [True, False])
async def test_a_refused_input_fails_only_its_own_call_of_two_in_flight(bad_first: bool) -> None:
    session = Session()
    async with hcqa.open_device("cpu:0") as dev:
        model = await _model(dev, session, depth=2)
        got = await _two_calls(model, session, *((BAD, 3.0) if bad_first else (3.0, BAD)))
        assert isinstance(got[BAD], InvalidCommand)
        assert "could not run this input: onnxruntime: ValueError" in str(got[BAD])
        np.testing.assert_array_equal(got[3.0], 2 * _rows(3.0))
        session.armed = False  # and the model goes on answering
        np.testing.assert_array_equal(await model(_rows(4.0)), 2 * _rows(4.0))


async def test_depth_one_runs_one_call_at_a_time_and_depth_is_checked() -> None:
    session = Session()
    async with hcqa.open_device("cpu:0") as dev:
        model = await _model(dev, session, depth=1)
        assert model.depth == 1
        got: dict[int, np.ndarray] = {}

        async def call(i: int) -> None:
            got[i] = await model(_rows(float(i)))

        async with trio.open_nursery() as nursery:
            for i in range(1, 6):
                nursery.start_soon(call, i)
        for i in range(1, 6):
            np.testing.assert_array_equal(got[i], 2 * _rows(float(i)))
        with pytest.raises(InvalidCommand, match=r"'depth' must be >= 1 \(got 0\)"):
            await hcqa.models.load_onnx("missing.onnx", device=dev, depth=0)


class Recording(Session):
    """A Session that also notes each run's first value, in the order the device ran them."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[float] = []

    def run(self, _: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.armed:
            self.order.append(float(feeds["x"][0, 0]))
        return super().run(_, feeds)


async def test_calls_reach_the_device_in_call_order_behind_a_cancelled_ones_replay() -> None:
    """A cancelled call leaves its replay on its slot; the next call to take that slot waits for
    it. A call after that one, taking the other (free) slot, must not overtake it: a model with
    state (a KV cache written at ``start_pos``) sees the calls in the order they were made."""
    session = Recording()
    async with hcqa.open_device("cpu:0") as dev:
        model = await _model(dev, session, depth=2)
        session.armed = True
        with trio.CancelScope() as scope:  # queued, then cancelled: its replay holds on
            scope.cancel()
            await model(_rows(1.0))
        assert await trio.to_thread.run_sync(session.holding.wait, WAIT)
        got: dict[float, Any] = {}

        async def call(first: float) -> None:
            got[first] = await model(_rows(first))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, 2.0)  # takes the cancelled call's slot: waits for its replay
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(call, 3.0)  # the other slot is free
            await trio.testing.wait_all_tasks_blocked()
            session.release.set()
        assert session.order == [1.0, 2.0, 3.0]
        for first in (2.0, 3.0):
            np.testing.assert_array_equal(got[first], 2 * _rows(first))


async def test_callers_woken_together_for_free_slots_still_submit_in_call_order() -> None:
    """Calls 3 and 4 wait for a slot while 1 (held in the kernel) and 2 are in flight; 1 and
    2 are cancelled in one round of the event loop, so 3 and 4 are woken together -- and trio
    runs a round's tasks in either order. 4 must still not submit before 3 (trial after
    trial: each trial, half the time 4 runs first)."""
    async with hcqa.open_device("cpu:0") as dev:
        for _ in range(12):
            session = Recording()
            model = await _model(dev, session, depth=2)
            session.armed = True
            got: dict[float, Any] = {}
            scopes = [trio.CancelScope(), trio.CancelScope()]

            async def call(first: float, model: Model = model, got: dict[float, Any] = got) -> None:
                got[first] = await model(_rows(first))

            async def cancelled(first: float, scope: trio.CancelScope) -> None:
                with scope:
                    await call(first)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancelled, 1.0, scopes[0])
                assert await trio.to_thread.run_sync(session.holding.wait, WAIT)
                nursery.start_soon(cancelled, 2.0, scopes[1])
                for first in (3.0, 4.0):
                    await trio.testing.wait_all_tasks_blocked()
                    nursery.start_soon(call, first)
                await trio.testing.wait_all_tasks_blocked()
                for scope in scopes:  # both slots come free in this round
                    scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                session.release.set()
            assert session.order == [1.0, 2.0, 3.0, 4.0]
            for first in (3.0, 4.0):
                np.testing.assert_array_equal(got[first], 2 * _rows(first))


def test_asyncio_callers_reach_the_device_in_call_order() -> None:
    """Calls made by asyncio tasks are handed to the trio host, where trio starts the tasks
    of one round in either order; their place in line is taken when the call is made, so
    the device still runs them in call order (trial after trial)."""
    import asyncio

    from hcqa import aio

    async def main() -> None:
        async with hcqa.open_device("cpu:0") as dev:
            for _ in range(12):
                session = Recording()
                model = await aio.call(_model, dev, session, 2)  # (a builder of the trio host)
                session.armed = True
                session.release.set()  # (nothing holds)
                firsts = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
                calls = [asyncio.ensure_future(model(_rows(f))) for f in firsts]
                got = await asyncio.gather(*calls)
                assert session.order == firsts
                for f, y in zip(firsts, got, strict=True):
                    np.testing.assert_array_equal(y, 2 * _rows(f))

    asyncio.run(main())
