"""Who is blamed for a device fault in hcqa.serve: only the run whose own work faulted.

A fault is sticky, so every run in flight on the device sees the same error, and the
order in which their failures are handled is the scheduler's. These tests force the order
that once blamed an innocent request (its failure handled first) and check that the
device names the run whose batch failed (``DeviceFault.owner``)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing

import hcqa
from hcqa.errors import DeviceFault, work_owner
from hcqa.serve import Model
from hcqa.serve.hosted import Hosted

VOCAB = 10
INNOCENT = 4  # the row co-batched with the culprit (warming runs zeros: not it)
HOLD = VOCAB - 1  # a row whose first id is this holds in the kernel until hold_gate


@pytest.fixture(autouse=True)
def _no_owner() -> None:
    assert work_owner.get() is None


class Racing:
    """An embedding (``out = ids * 1.5``) whose kernel raises on an id out of the vocabulary,
    shaped like ``hcqa.models.Model`` and run by Pipelines on ``cpu:0``. Armed, it forces the
    race: the culprit's single-row run holds in the kernel until an innocent single-row run
    has queued behind it on the same device; the innocent's failure is handled first."""

    name = "embed"
    batch_sizes = (1, 2)

    def __init__(self) -> None:
        self.inputs = (("ids", (None, 4), np.dtype(np.int32)),)
        self.outputs = (("out", (None, 4), np.dtype(np.float32)),)
        self.armed = False  # by the first batch of two that faults
        self.hold_in, self.hold_gate = threading.Event(), threading.Event()
        self.holding = threading.Event()  # the culprit's kernel holds (engine thread)
        self.gate = threading.Event()
        self.innocent_queued = trio.Event()
        self.innocent_failed = trio.Event()
        self.builds: list[hcqa.Device] = []
        self.pipes: dict[int, hcqa.Pipeline] = {}
        self.device: Any = None

    def kernel(self, out: npt.NDArray[Any], ids: npt.NDArray[Any]) -> None:
        if ids[0, 0] == HOLD:
            self.hold_in.set()
            self.hold_gate.wait(30)
        bad = ids[(ids < 0) | (ids >= VOCAB)]
        if bad.size and len(ids) == 1 and self.armed:
            self.holding.set()
            self.gate.wait(30)
        if bad.size:
            raise IndexError(f"token id {int(bad[0])} is out of the vocabulary")
        out[...] = ids * 1.5

    @asynccontextmanager
    async def build(self) -> AsyncIterator[Any]:
        async with hcqa.open_device("cpu:0") as d:
            self.builds.append(d)
            self.device = d
            program = d.program("embed", self.kernel)
            stage = hcqa.Stage(device=d, program=program, out_dtype="float32")
            self.pipes = {
                b: hcqa.Pipeline([stage], in_shape=(b, 4), dtype="int32", depth=2)
                for b in self.batch_sizes
            }
            yield self

    async def __call__(self, ids: npt.NDArray[Any]) -> npt.NDArray[Any]:
        bad = bool(((ids < 0) | (ids >= VOCAB)).any())
        innocent = self.armed and ids[0, 0] == INNOCENT and not self.innocent_queued.is_set()
        if innocent:  # queue behind the culprit's held kernel
            await trio.to_thread.run_sync(self.holding.wait, abandon_on_cancel=True)
            self.innocent_queued.set()
        try:
            return await self.pipes[len(ids)](ids)
        except DeviceFault:
            if len(ids) == 2:
                self.armed = True
            elif innocent:
                self.innocent_failed.set()  # its _failed runs before the culprit's
            elif self.armed and bad and len(ids) == 1:
                await self.innocent_failed.wait()
            raise


@asynccontextmanager
async def hosted(model: Model) -> AsyncIterator[Hosted]:
    h = Hosted(model)
    async with trio.open_nursery() as nursery:
        await nursery.start(h.keep)
        yield h
        nursery.cancel_scope.cancel()


def _row(first: int) -> tuple[npt.NDArray[Any]]:
    return (np.array([[first, 1, 2, 3]], np.int32),)


async def test_the_culprits_alone_retry_does_not_blame_an_innocent_beside_it() -> None:
    """A batch of two faults; both are retried alone, overlapping on the rebuilt device: the
    culprit's retry holds in the kernel while the innocent's queues behind it, then faults,
    and the innocent's failure (the same sticky fault) is handled first. The innocent still
    gets its answer (rerun on the next build), the culprit its own error."""
    race = Racing()
    model = Model(name="embed", build=race.build, max_batch=2, max_wait=30)
    async with hosted(model) as h:
        answers: dict[int, Any] = {}

        async def ask(first: int) -> None:
            try:
                answers[first] = await h.run(_row(first))
            except Exception as exc:
                answers[first] = exc

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, HOLD)  # runs alone (nothing else in flight) and holds
                await trio.to_thread.run_sync(race.hold_in.wait, abandon_on_cancel=True)
                nursery.start_soon(ask, 99)
                nursery.start_soon(ask, INNOCENT)  # the batch of two, dispatched after HOLD's
                await trio.testing.wait_all_tasks_blocked()
                race.hold_gate.set()
                await race.innocent_queued.wait()
                await trio.testing.wait_all_tasks_blocked()
                race.gate.set()
        assert race.innocent_failed.is_set()  # the race happened, in that order
        np.testing.assert_array_equal(answers.pop(HOLD)[0], [[HOLD * 1.5, 1.5, 3.0, 4.5]])
        culprit = answers.pop(99)
        assert isinstance(culprit, DeviceFault), culprit
        assert "token id 99 is out of the vocabulary" in str(culprit)
        np.testing.assert_array_equal(answers[INNOCENT][0], [[6.0, 1.5, 3.0, 4.5]])
        assert h.state == "ready"
        ys = await h.run(_row(2))
        np.testing.assert_array_equal(ys[0], [[3.0, 1.5, 3.0, 4.5]])
    # the batch's fault, the culprit's alone retry's: two rebuilds
    assert len(race.builds) == 3


async def test_a_fault_names_the_owner_of_the_batch_that_failed() -> None:
    """The device notes who queued each batch (``work_owner``); the fault of a kernel names
    the owner of its batch, not of a batch queued behind it."""
    seen: list[int] = []
    holding, gate = threading.Event(), threading.Event()

    def kernel(out: npt.NDArray[Any], x: npt.NDArray[Any]) -> None:
        seen.append(int(x[0]))
        if x[0] < 0:
            holding.set()
            gate.wait(30)
            raise ValueError("negative")
        out[...] = x

    async with hcqa.open_device("cpu:0") as d:
        prog = d.program("k", kernel)
        stage = hcqa.Stage(device=d, program=prog, out_dtype="float32")
        pipe = hcqa.Pipeline([stage], in_shape=(1,), dtype="float32", depth=2)
        seen.clear()
        culprit, innocent = object(), object()
        errors: dict[object, BaseException] = {}

        async def call(owner: object, x: float) -> None:
            work_owner.set(owner)  # this task's own context
            try:
                await pipe(np.array([x], np.float32))
            except DeviceFault as exc:
                errors[owner] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, culprit, -1.0)
            await trio.to_thread.run_sync(holding.wait)
            nursery.start_soon(call, innocent, 1.0)  # queued behind the culprit's kernel
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        assert seen == [-1]
        assert errors[culprit] is errors[innocent]  # sticky: one instance for both
        assert getattr(errors[culprit], "owner", None) is culprit


class Queued:
    """The embedding again, one row a run (``max_batch=1``). Round ``k``: the ``k``-th bad
    row's kernel holds until the innocent's ``k``-th run has queued behind it on the same
    device, then faults; so each fault reaches the innocent, and names the bad run."""

    name = "embed"
    batch_sizes = (1,)

    def __init__(self, rounds: int, *, innocent_first: bool = False) -> None:
        self.inputs = (("ids", (None, 4), np.dtype(np.int32)),)
        # innocent_first: the innocent's failure is handled before the bad run's, while the
        # model's generation is still the faulted one (else the scheduler picks the order)
        self.innocent_first = innocent_first
        self.innocent_failed = [trio.Event() for _ in range(rounds)]
        self.outputs = (("out", (None, 4), np.dtype(np.float32)),)
        self.holding = [threading.Event() for _ in range(rounds)]
        self.gate = [threading.Event() for _ in range(rounds)]
        self.queued = [trio.Event() for _ in range(rounds)]
        self.bad_runs = self.innocent_runs = 0
        self.builds: list[hcqa.Device] = []
        self.pipe: Any = None
        self.device: Any = None
        self.fault_seen = trio.Event()  # a bad run's fault, before it is handled
        self.handle = trio.Event()

    def kernel(self, out: npt.NDArray[Any], ids: npt.NDArray[Any]) -> None:
        if ((ids < 0) | (ids >= VOCAB)).any():
            k = self.bad_runs
            self.bad_runs += 1
            if k < len(self.holding):
                self.holding[k].set()
                self.gate[k].wait(30)
            raise IndexError(f"token id {int(ids.max())} is out of the vocabulary")
        out[...] = ids * 1.5

    @asynccontextmanager
    async def build(self) -> AsyncIterator[Any]:
        async with hcqa.open_device("cpu:0") as d:
            self.builds.append(d)
            self.device = d
            program = d.program("embed", self.kernel)
            stage = hcqa.Stage(device=d, program=program, out_dtype="float32")
            self.pipe = hcqa.Pipeline([stage], in_shape=(1, 4), dtype="int32", depth=2)
            yield self

    async def __call__(self, ids: npt.NDArray[Any]) -> npt.NDArray[Any]:
        k = self.innocent_runs
        innocent = ids[0, 0] == INNOCENT and k < len(self.holding)
        if innocent:
            self.innocent_runs += 1
            await trio.to_thread.run_sync(self.holding[k].wait, abandon_on_cancel=True)
            self.queued[k].set()
        try:
            return await self.pipe(ids)  # type: ignore[no-any-return]
        except DeviceFault as exc:
            if ids[0, 0] == VOCAB + 1:  # hold the fault unhandled until told
                self.fault_seen.set()
                await self.handle.wait()
            elif innocent:
                self.innocent_failed[k].set()  # (handled in this step, as it raises)
            elif self.innocent_first and f"token id {ids[0, 0]} is" in str(exc):
                await self.innocent_failed[ids[0, 0] - 90].wait()  # its own kernel's fault
            raise


@pytest.mark.parametrize("innocent_first", [False, True])
async def test_other_requests_faults_never_spend_an_innocents_retries(innocent_first: bool) -> None:
    """Four bad requests, one after another, each fault reaching the same innocent request
    queued behind the bad one: four rebuilds, more than a request's own tries, none of them
    the innocent's doing. It reruns on each new build and gets its answer; each bad request
    gets its own error. ``innocent_first``: each time the innocent's failure is handled
    first, so it is the one that finds the fault (named for the bad run) and starts the
    rebuild."""
    rounds = 4
    q = Queued(rounds, innocent_first=innocent_first)
    async with hosted(Model(name="embed", build=q.build, max_batch=1)) as h:
        answers: dict[int, Any] = {}

        answered = {k: trio.Event() for k in range(rounds)}

        async def ask(key: int, first: int) -> None:
            try:
                answers[key] = await h.run(_row(first))
            except Exception as exc:
                answers[key] = exc
            if key >= 0:
                answered[key].set()

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, -1, INNOCENT)
                for k in range(rounds):
                    nursery.start_soon(ask, k, 90 + k)
                    await q.queued[k].wait()
                    await trio.testing.wait_all_tasks_blocked()
                    q.gate[k].set()
                    await answered[k].wait()  # (so the next one runs on the next build)
        innocent = answers.pop(-1)
        assert not isinstance(innocent, Exception), innocent
        np.testing.assert_array_equal(innocent[0], [[6.0, 1.5, 3.0, 4.5]])
        assert q.innocent_runs == rounds and len(q.builds) == rounds + 1  # the race, each time
        assert all(e.is_set() for e in q.innocent_failed)
        for k in range(rounds):
            assert isinstance(answers[k], DeviceFault), answers[k]
            assert f"token id {90 + k} is out of the vocabulary" in str(answers[k])


async def test_a_request_arriving_before_a_fault_is_handled_waits_for_the_rebuild() -> None:
    """The device has faulted but the faulting run has not yet reported it (the model is
    still 'ready'): a request arriving then waits for the rebuild, not 503."""
    q = Queued(0)
    async with hosted(Model(name="embed", build=q.build, max_batch=1)) as h:
        answers: dict[int, Any] = {}

        async def ask(first: int) -> None:
            try:
                answers[first] = await h.run(_row(first))
            except Exception as exc:
                answers[first] = exc

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, VOCAB + 1)
                await q.fault_seen.wait()
                assert h.state == "ready" and h.unavailable()  # faulted, not yet handled
                nursery.start_soon(ask, 2)
                await trio.testing.wait_all_tasks_blocked()
                q.handle.set()
        assert isinstance(answers[VOCAB + 1], DeviceFault), answers[VOCAB + 1]
        assert not isinstance(answers[2], Exception), answers[2]
        np.testing.assert_array_equal(answers[2][0], [[3.0, 1.5, 3.0, 4.5]])
        assert len(q.builds) == 2
