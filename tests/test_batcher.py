"""Dynamic batching (hcqa.open_batcher): correctness, timing policy, cancellation, errors."""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing

import hcqa

SAMPLE = (3,)


def double(out: np.ndarray, x: np.ndarray) -> None:
    np.multiply(x, 2, out=out)


def row_sums(out: np.ndarray, x: np.ndarray) -> None:
    np.sum(x, axis=1, out=out)


def sample(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SAMPLE).astype(np.float32)


class Recorder:
    """An async batch target that records every batch it ran; ``gate`` holds it back."""

    def __init__(self, *, gated: bool = False) -> None:
        self.batches: list[np.ndarray] = []
        self.gate = trio.Event()
        self.entered = trio.Event()
        if not gated:
            self.gate.set()

    async def __call__(self, x: npt.NDArray[Any]) -> npt.NDArray[Any]:
        self.batches.append(x.copy())
        self.entered.set()
        await self.gate.wait()
        if np.isnan(x).any():
            raise ValueError(f"a batch of {len(x)} held a NaN")
        return x * 10


def opened(target: Any, **options: Any) -> Any:
    options = {"max_batch": 4, "max_wait": 60.0, "sample_shape": SAMPLE, "dtype": "float32"} | (
        options
    )
    return hcqa.open_batcher(target, **options)


async def test_64_concurrent_callers_each_get_their_own_row_from_a_pipeline() -> None:
    results: dict[int, np.ndarray] = {}
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        stages = [hcqa.Stage(device=d0, program=double), hcqa.Stage(device=d1, program=double)]
        pipe = hcqa.Pipeline(stages, in_shape=(16, *SAMPLE), depth=2)
        async with hcqa.open_batcher(pipe, max_wait=0.005) as batch:
            assert (batch.max_batch, batch.depth) == (16, 2)

            async def caller(k: int) -> None:
                for i in range(3):
                    results[100 * k + i] = await batch(sample(100 * k + i))

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for k in range(64):
                        nursery.start_soon(caller, k)
            stats = batch.statistics()
    assert len(results) == 192
    for key, row in results.items():
        np.testing.assert_array_equal(row, sample(key) * 4)
    assert stats.samples == 192
    assert stats.batches < 192 / 4  # really batched (64 callers arrive together)
    assert stats.mean_batch == 192 / stats.batches
    assert sum((k + 1) * n for k, n in enumerate(stats.batch_sizes)) == 192
    assert (stats.pending, stats.in_flight, stats.failed_batches, stats.cancelled) == (0, 0, 0, 0)
    assert 0 <= stats.queue_wait_p50 <= stats.queue_wait_p99


async def test_rows_are_sliced_from_a_padded_batch_and_outputs_may_change_shape() -> None:
    async with hcqa.open_devices("cpu:0") as (d0,):
        pipe = hcqa.Pipeline(
            [hcqa.Stage(device=d0, program=row_sums, out_shape=(8,))], in_shape=(8, *SAMPLE)
        )
        async with hcqa.open_batcher(pipe, max_batch=5, max_wait=0.001) as batch:
            got: dict[int, Any] = {}

            async def one(k: int) -> None:
                got[k] = await batch(sample(k))

            async with trio.open_nursery() as nursery:
                for k in range(7):
                    nursery.start_soon(one, k)
            sizes = batch.statistics().batch_sizes
    for k, y in got.items():
        assert y.shape == ()
        assert y == pytest.approx(float(sample(k).sum()), rel=1e-6)
    assert len(sizes) == 5 and sum((k + 1) * n for k, n in enumerate(sizes)) == 7
    assert max(k + 1 for k, n in enumerate(sizes) if n) <= 5


async def test_a_lone_caller_does_not_wait_for_max_wait() -> None:
    target = Recorder()
    async with opened(target, max_wait=3600.0) as batch:
        with trio.fail_after(5):  # with a 1 h max_wait, only an idle-target dispatch passes
            for k in range(3):
                np.testing.assert_array_equal(await batch(sample(k)), sample(k) * 10)
    assert [len(b) for b in target.batches] == [1, 1, 1]


async def test_batches_fill_while_the_target_is_busy() -> None:
    target = Recorder(gated=True)
    async with opened(target, max_batch=4) as batch:
        got: dict[int, np.ndarray] = {}

        async def one(k: int) -> None:
            got[k] = await batch(sample(k))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0)
            await target.entered.wait()  # batch [0] runs (the target was idle)
            for k in range(1, 11):  # arriving one after another
                nursery.start_soon(one, k)
                await trio.testing.wait_all_tasks_blocked()
            assert batch.statistics().pending == 10
            target.gate.set()
    assert [len(b) for b in target.batches] == [1, 4, 4, 2]  # FIFO, full batches first
    flat = np.concatenate(target.batches)
    np.testing.assert_array_equal(flat, np.stack([sample(k) for k in range(11)]))
    for k, row in got.items():
        np.testing.assert_array_equal(row, sample(k) * 10)
    assert batch.statistics().batch_sizes == (1, 1, 0, 2)


async def test_a_partial_batch_goes_after_max_wait_when_a_slot_is_free(
    autojump_clock: trio.testing.MockClock,
) -> None:
    target = Recorder(gated=True)
    async with opened(target, max_batch=4, max_wait=0.5, depth=2) as batch:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batch, sample(0))
            await target.entered.wait()  # batch 1 runs and blocks: the target is busy
            t0 = trio.current_time()
            target.entered = trio.Event()
            nursery.start_soon(batch, sample(1))
            await target.entered.wait()  # batch 2 went with one sample, after max_wait
            assert trio.current_time() - t0 == pytest.approx(0.5)
            target.gate.set()
        stats = batch.statistics()
    assert [len(b) for b in target.batches] == [1, 1]
    assert stats.queue_wait_p99 == pytest.approx(0.5)
    assert stats.queue_wait_p50 == 0.0


async def test_a_serial_target_queues_only_a_full_batch_behind_a_running_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A serial target (a ``models.Model``) runs its batches one after another: a partial
    batch waits past max_wait for the running one to end, growing; a full one goes at once."""
    target = Recorder(gated=True)
    async with opened(target, max_batch=2, max_wait=0.5, depth=2, serial=True) as batch:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batch, sample(0))
            await target.entered.wait()  # batch 1 runs and blocks
            target.entered = trio.Event()
            nursery.start_soon(batch, sample(1))
            await trio.sleep(5.0)  # ten times max_wait: it still waits, the target being busy
            assert len(target.batches) == 1
            nursery.start_soon(batch, sample(2))
            await target.entered.wait()  # now full: queued behind batch 1 at once
            assert len(target.batches) == 2
            target.entered = trio.Event()
            nursery.start_soon(batch, sample(3))
            await trio.testing.wait_all_tasks_blocked()
            target.gate.set()  # both end; the partial one goes once they have
        stats = batch.statistics()
    assert [len(b) for b in target.batches] == [1, 2, 1]
    assert stats.queue_wait_p99 == pytest.approx(5.0)


class _Spawns(trio.abc.Instrument):
    """Which task's step spawned each batch task."""

    def __init__(self) -> None:
        self.stepping: trio.lowlevel.Task | None = None
        self.spawned_by: list[str] = []

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.stepping = task

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.stepping = None

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        if task.name == "hcqa.batcher.Batcher._run_batch" and self.stepping is not None:
            self.spawned_by.append(self.stepping.name)


async def test_the_call_that_fills_a_batch_starts_it_in_its_own_step() -> None:
    """No round of the collector between the last sample of a full batch and its start:
    under load a round of the event loop runs every connection's task first."""
    target = Recorder(gated=True)
    spawns = _Spawns()
    trio.lowlevel.add_instrument(spawns)
    try:
        async with opened(target, max_batch=2, depth=2) as batch:

            async def call(k: int) -> None:
                await batch(sample(k))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 0, name="lone")
                await target.entered.wait()  # batch 1 runs (the target was idle)
                target.entered = trio.Event()
                nursery.start_soon(call, 1, name="first of two")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(call, 2, name="second of two")
                await target.entered.wait()
                target.gate.set()
    finally:
        trio.lowlevel.remove_instrument(spawns)
    assert [len(b) for b in target.batches] == [1, 2]
    assert spawns.spawned_by[1] == "second of two"


class _Steps(trio.abc.Instrument):
    """Counts task steps: two moments in one step read the same count."""

    def __init__(self) -> None:
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


@pytest.mark.parametrize(
    ("depth", "serial", "max_batch"),
    [(1, False, 2), (2, True, 4)],
    ids=["slot-freed", "serial-partial"],
)
async def test_a_batch_that_ends_starts_the_next_in_its_own_step(
    depth: int, serial: bool, max_batch: int
) -> None:
    """When a batch ends and the pending requests are ready to go (the slot it frees, or a
    serial target's partial batch that waited for it), the next batch reaches the target in
    the step that saw the first end: no round of the event loop while the device idles."""
    steps = _Steps()
    seen: list[tuple[str, int]] = []

    async def target(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
        seen.append(("in", steps.count))
        if len(seen) == 1:
            await gate.wait()
        seen.append(("out", steps.count))
        return x * 10

    gate = trio.Event()
    trio.lowlevel.add_instrument(steps)
    try:
        async with opened(target, max_batch=max_batch, depth=depth, serial=serial) as batch:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(batch, sample(0))
                await trio.testing.wait_all_tasks_blocked()  # batch 1 runs, blocked
                nursery.start_soon(batch, sample(1))  # waits: no slot, or a serial partial
                await trio.testing.wait_all_tasks_blocked()
                assert [k for k, _ in seen] == ["in"]
                gate.set()
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert [k for k, _ in seen] == ["in", "out", "in", "out"]
    assert seen[2][1] == seen[1][1]  # batch 2 went in within the step batch 1 came out


async def test_a_cancelled_pending_caller_leaves_the_queue() -> None:
    target = Recorder(gated=True)
    async with opened(target) as batch:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batch, sample(0))
            await target.entered.wait()
            with trio.CancelScope() as leaving:
                nursery.start_soon(batch, sample(2))

                async def cancel_soon() -> None:
                    await trio.testing.wait_all_tasks_blocked()
                    leaving.cancel()

                nursery.start_soon(cancel_soon)
                await batch(sample(1))  # cancelled while pending
            assert leaving.cancelled_caught
            assert batch.statistics().pending == 1
            target.gate.set()
        stats = batch.statistics()
    ran = np.concatenate(target.batches)
    np.testing.assert_array_equal(ran, np.stack([sample(0), sample(2)]))  # sample 1 never ran
    assert (stats.cancelled, stats.samples) == (1, 2)


async def test_a_cancelled_dispatched_caller_leaves_its_batch_unharmed() -> None:
    target = Recorder(gated=True)
    got: dict[int, np.ndarray] = {}
    async with opened(target) as batch:

        async def one(k: int) -> None:
            got[k] = await batch(sample(k))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0)
            await target.entered.wait()
            target.entered = trio.Event()
            async with trio.open_nursery() as leaving:
                leaving.start_soon(one, 1)
                nursery.start_soon(one, 2)
                nursery.start_soon(one, 3)
                await trio.testing.wait_all_tasks_blocked()
                first, target.gate = target.gate, trio.Event()
                first.set()  # batch [0] finishes; the next one will wait on the new gate
                await target.entered.wait()  # the batch [1, 2, 3] has been dispatched
                assert batch.statistics().in_flight == 1
                leaving.cancel_scope.cancel()  # caller 1 stops waiting mid-batch
            target.gate.set()
        stats = batch.statistics()
    assert [len(b) for b in target.batches] == [1, 3]
    assert sorted(got) == [0, 2, 3]
    for k in (0, 2, 3):
        np.testing.assert_array_equal(got[k], sample(k) * 10)
    assert (stats.cancelled, stats.failed_batches, stats.in_flight) == (1, 0, 0)


async def test_an_error_reaches_exactly_its_batchs_callers() -> None:
    target = Recorder(gated=True)
    outcome: dict[int, Any] = {}
    bad = np.full(SAMPLE, np.nan, np.float32)
    async with opened(target, max_batch=2) as batch:

        async def one(k: int, x: np.ndarray) -> None:
            try:
                outcome[k] = await batch(x)
            except ValueError as exc:
                outcome[k] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0, sample(0))
            await target.entered.wait()
            nursery.start_soon(one, 1, sample(1))
            nursery.start_soon(one, 2, bad)  # batch [1, 2] fails
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(one, 3, sample(3))  # batch [3] does not
            await trio.testing.wait_all_tasks_blocked()
            target.gate.set()
        stats = batch.statistics()
    assert isinstance(outcome[1], ValueError) and outcome[1] is outcome[2]
    assert "batch of 2 held a NaN" in str(outcome[1])
    for k in (0, 3):
        np.testing.assert_array_equal(outcome[k], sample(k) * 10)
    assert (stats.batches, stats.failed_batches) == (3, 1)


async def test_a_target_returning_the_wrong_rows_is_an_error_for_its_callers() -> None:
    gate, entered = trio.Event(), trio.Event()

    async def short(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
        entered.set()
        await gate.wait()
        return x[:1]

    outcome: dict[int, Any] = {}
    async with opened(short) as batch:

        async def one(k: int) -> None:
            try:
                outcome[k] = await batch(sample(k))
            except hcqa.InvalidCommand as exc:
                outcome[k] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0)  # the target is idle: a batch of 1, one row: fine
            await entered.wait()
            nursery.start_soon(one, 1)
            nursery.start_soon(one, 2)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    np.testing.assert_array_equal(outcome[0], sample(0))
    assert outcome[1] is outcome[2]
    assert str(outcome[1]) == (
        "the batch target must return one row per sample, 2 rows (got float32[1, 3])"
    )


async def test_closing_drains_pending_work_and_refuses_new_calls() -> None:
    target = Recorder(gated=True)
    got: list[np.ndarray] = []
    async with trio.open_nursery() as outside:
        async with opened(target, max_batch=2) as batch:
            for k in range(3):

                async def one(k: int = k) -> None:
                    got.append(await batch(sample(k)))

                outside.start_soon(one)
            await trio.testing.wait_all_tasks_blocked()
            target.gate.set()
        # the block waited for every batch: all three answered
        assert len(got) == 3
    with pytest.raises(hcqa.DeviceClosed, match="closed"):
        await batch(sample(0))


async def test_leaving_by_an_error_ends_waiting_callers_with_device_closed() -> None:
    target = Recorder(gated=True)
    outcome: list[BaseException] = []

    async def one(batch: hcqa.Batcher, k: int) -> None:
        try:
            await batch(sample(k))
        except hcqa.DeviceClosed as exc:
            outcome.append(exc)

    async with trio.open_nursery() as outside:
        with pytest.raises(KeyError, match="boom"):  # raised unwrapped
            async with opened(target, max_batch=1) as batch:
                outside.start_soon(one, batch, 0)
                outside.start_soon(one, batch, 1)
                await trio.testing.wait_all_tasks_blocked()
                assert batch.statistics().in_flight == 1
                raise KeyError("boom")
    assert len(outcome) == 2  # the running batch's caller and the pending one
    assert any("batch finished" in str(e) for e in outcome)
    assert any("sample ran" in str(e) for e in outcome)


async def test_max_pending_turns_callers_away() -> None:
    target = Recorder(gated=True)
    async with opened(target, max_pending=2) as batch:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batch, sample(0))
            await target.entered.wait()
            nursery.start_soon(batch, sample(1))
            nursery.start_soon(batch, sample(2))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(hcqa.QueueFull, match=r"<= 2 \(got 2 waiting\)"):
                await batch(sample(3))
            target.gate.set()


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"max_batch": 0}, hcqa.InvalidCommand, "'max_batch' must be >= 1 (got 0)"),
        ({"max_batch": True}, TypeError, "'max_batch' must be an int (got bool)"),
        ({"max_wait": math.nan}, hcqa.InvalidCommand, "'max_wait' must be a finite number"),
        ({"max_wait": -0.001}, hcqa.InvalidCommand, "(got -0.001)"),
        ({"max_wait": math.inf}, hcqa.InvalidCommand, "(got inf)"),
        ({"max_wait": "1"}, hcqa.InvalidCommand, "(got '1')"),
        ({"depth": 0}, hcqa.InvalidCommand, "'depth' must be >= 1 (got 0)"),
        ({"max_pending": 0}, hcqa.InvalidCommand, "'max_pending' must be >= 1 (got 0)"),
        ({"sample_shape": None}, hcqa.InvalidCommand, "needs 'max_batch', 'sample_shape'"),
        ({"sample_shape": (0,)}, hcqa.InvalidCommand, "'sample_shape' must be >= 1 (got 0)"),
    ],
)
async def test_bad_settings_are_refused(
    options: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as info:
        async with opened(Recorder(), **options):
            pytest.fail("opened")
    assert words in str(info.value)


async def test_bad_samples_are_refused_before_anything_is_queued() -> None:
    target = Recorder()
    async with opened(target) as batch:
        fix = "; convert it with np.asarray(x, dtype=np.float32)"
        for bad, got in [
            (np.zeros(4, np.float32), "float32[4])"),
            (np.zeros(3, np.float64), f"float64[3]){fix}"),
            ([1.0, 2.0, 3.0], f"float64[3] from a Python list){fix}"),
            (np.array([None, 1, 2], dtype=object), f"object[3]){fix}"),
            ("abc", f"<U3[]){fix}"),
        ]:
            with pytest.raises(hcqa.InvalidCommand) as info:
                await batch(bad)
            assert str(info.value) == f"a sample must be float32[3] (got {got}"
        assert batch.statistics().pending == 0
    assert target.batches == []


async def test_pipeline_settings_must_match_the_pipeline() -> None:
    async with hcqa.open_devices("cpu:0") as (d0,):
        pipe = hcqa.Pipeline([(d0, double)], in_shape=(4, 3))
        for options, words in [
            ({"max_batch": 5}, "'max_batch' must be <= 4, the pipeline's batch dimension (got 5)"),
            ({"sample_shape": (4,)}, "'sample_shape' must be [3], the pipeline's rows (got [4])"),
            ({"dtype": "float64"}, "'dtype' must be float32, the pipeline's (got float64)"),
        ]:
            with pytest.raises(hcqa.InvalidCommand) as info:
                async with hcqa.open_batcher(pipe, **options):
                    pytest.fail("opened")
            assert str(info.value) == words
    with pytest.raises(hcqa.InvalidCommand, match="got int"):
        async with hcqa.open_batcher(3, max_batch=1, sample_shape=(1,), dtype="f4"):
            pytest.fail("opened")


async def test_a_plain_function_target_is_refused_at_open() -> None:
    """A sync function (or a lambda, or an object with a sync ``__call__``) as the target
    would fail every call with Python's await error: refused when the block opens. An
    async def function, a partial of one and an object with an async ``__call__`` open."""

    def plain(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return x

    class Sync:
        def __call__(self, x: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return x

    async def scaled(x: npt.NDArray[Any], k: float) -> npt.NDArray[Any]:
        return x * k

    for target, name in ((plain, "plain"), (lambda x: x, "<lambda>"), (Sync(), "Sync")):
        with pytest.raises(hcqa.InvalidCommand, match="must be an async callable") as info:
            async with opened(target):
                pytest.fail("opened")
        assert f"(got the plain callable {name!r}" in str(info.value), info.value
    for good in (functools.partial(scaled, k=2.0), Recorder()):
        async with opened(good, max_wait=0.0) as batch:
            row = await batch(np.ones(SAMPLE, np.float32))
            assert row.shape == SAMPLE


@pytest.fixture
def test_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", here if not path else here + os.pathsep + path)


@pytest.mark.usefixtures("test_stages")
async def test_a_process_pipeline_target() -> None:
    stages = [hcqa.ProcessStage(fn="_stages:scaled", args={"factor": 3.0})]
    got: dict[int, np.ndarray] = {}
    with trio.fail_after(30):
        async with hcqa.open_process_pipeline(stages, in_shape=(8, *SAMPLE), depth=2) as pipe:
            async with hcqa.open_batcher(pipe, max_wait=0.002) as batch:
                assert (batch.max_batch, batch.depth) == (8, 2)

                async def one(k: int) -> None:
                    got[k] = await batch(sample(k))

                async with trio.open_nursery() as nursery:
                    for k in range(20):
                        nursery.start_soon(one, k)
                assert batch.statistics().batches < 20
    for k, row in got.items():
        np.testing.assert_array_equal(row, sample(k) * 3)


async def test_an_idle_batcher_burns_no_cpu() -> None:
    async with opened(Recorder(), max_wait=0.001) as batch:
        await batch(sample(0))
        cpu0 = time.process_time()
        await trio.sleep(0.3)  # idle: the collector is parked on its event
        used = time.process_time() - cpu0
    assert used < 0.03


async def test_buckets_run_each_batch_on_the_smallest_pipeline_that_holds_it() -> None:
    gate = threading.Event()

    def gated_double(out: np.ndarray, x: np.ndarray) -> None:
        gate.wait(10)  # the engine thread holds the batch until the test lets it go
        np.multiply(x, 2, out=out)

    async with hcqa.open_devices("cpu:0") as (d0,):
        prog = d0.program("double", gated_double)
        pipes = [
            hcqa.Pipeline(
                [hcqa.Stage(device=d0, program=prog)], in_shape=(b, *SAMPLE), check=False
            )  # check=False: no dry run of the gated kernel
            for b in (8, 1, 4)
        ]
        got: dict[int, np.ndarray] = {}
        async with hcqa.open_batcher(pipes, max_wait=0.0) as batch:
            assert (batch.max_batch, batch.depth) == (8, 2)

            async def one(k: int) -> None:
                got[k] = await batch(sample(k))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0)  # alone: the batch-1 pipeline
                await trio.testing.wait_all_tasks_blocked()
                for k in (1, 2, 3):  # 3 samples: the batch-4 pipeline (the second slot)
                    nursery.start_soon(one, k)
                await trio.testing.wait_all_tasks_blocked()
                for k in range(4, 10):  # 6 samples: the batch-8 one, once a slot frees
                    nursery.start_soon(one, k)
                await trio.testing.wait_all_tasks_blocked()
                assert batch.statistics().pending == 6
                gate.set()
            sizes = batch.statistics().batch_sizes
    assert [p.statistics().completed for p in pipes] == [1, 1, 1]  # 8, 1 and 4 rows
    assert sizes == (1, 0, 1, 0, 0, 1, 0, 0)
    for k, row in got.items():
        np.testing.assert_array_equal(row, sample(k) * 2)


async def test_bucket_pipelines_must_take_the_same_rows() -> None:
    async with hcqa.open_devices("cpu:0") as (d0,):
        a = hcqa.Pipeline([(d0, double)], in_shape=(4, 3))
        b = hcqa.Pipeline([(d0, double)], in_shape=(2, 5))
        c = hcqa.Pipeline([(d0, double)], in_shape=(4, 3))
        for target, words in [
            ([a, b], "the pipelines must take the same rows, float32[3] (got float32[5])"),
            ([a, c], "the pipelines' batch dimensions must differ (got [4, 4])"),
            ([], "a list of batch targets must hold Pipelines or ProcessPipelines (got [])"),
            ([a, 3], "(got ['Pipeline', 'int'])"),
        ]:
            with pytest.raises(hcqa.InvalidCommand) as info:
                async with hcqa.open_batcher(target):
                    pytest.fail("opened")
            assert words in str(info.value)
