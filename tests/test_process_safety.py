"""Process pipelines you can trust (issue 13): exact under cancellation, bounded under
hangs, safe from their workers, nothing left behind."""

from __future__ import annotations

import gc
import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import hcqa
from hcqa.processes import _items, open_process_pipeline

TESTS = os.path.dirname(os.path.abspath(__file__))
ADD = "hcqa.processes.stages:add_one"


def children() -> set[int]:
    """Live (not zombie) child processes of this process that the test did not find there
    (another library's pool -- tinygrad's compile workers, a Ray cluster -- may outlive the
    test that started it: only a process started since counts)."""
    return _children() - _EARLIER


def _children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[1] == me and fields[0] != "Z":
            out.add(int(name))
    return out


_EARLIER: set[int] = set()


@pytest.fixture(autouse=True)
def _earlier_children() -> Iterator[None]:
    """Note the children alive as each test starts (see ``children``)."""
    _EARLIER.clear()
    _EARLIER.update(_children())
    yield


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


async def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    with trio.fail_after(10):
        while True:
            states = []
            for t in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    stat = f.read()
                states.append(stat[stat.rindex(")") + 2])
            if all(s == "T" for s in states):
                return
            await trio.sleep(0.001)  # polling another process's state, not syncing tasks


# -- 1. exact results under cancellation ------------------------------------------------------


async def _hammer(pipe: hcqa.ProcessPipeline, n: int, calls: int, seed: int) -> dict[str, int]:
    """``calls`` calls from 4 concurrent callers, about a third cancelled at a random
    moment and, with ``item()``s, some blocks left without ``run()``; every completed
    result is checked against its own input."""
    rng = random.Random(seed)
    counts = {"ok": 0, "cancelled": 0, "abandoned": 0, "items": 0}
    ids = iter(range(1, calls + 1))

    async def caller() -> None:
        for call in ids:
            x = np.full(n, float(call % 100_000), np.float32)
            cut = rng.random() < 0.35
            deadline = trio.current_time() + rng.uniform(0, 400e-6) if cut else math.inf
            kind = rng.random()
            with trio.CancelScope(deadline=deadline) as scope:
                if kind < 0.25:  # zero-copy
                    async with pipe.item() as item:
                        if rng.random() < 0.2:
                            counts["abandoned"] += 1
                            continue  # left without run(): passed through, dropped
                        item.input[:] = x
                        out = await item.run()
                        np.testing.assert_array_equal(out, x + 2)
                        counts["items"] += 1
                else:
                    y = await pipe(x)
                    np.testing.assert_array_equal(y, x + 2)
                    del y  # a lent result: its loan comes back
            if scope.cancelled_caught:
                counts["cancelled"] += 1
            else:
                counts["ok"] += 1

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(caller)
        await pipe(np.zeros(n, np.float32))  # completes after every earlier item: reclaims
    gc.collect()
    stats = pipe.statistics()
    assert stats.in_flight == 0 and stats.retired == 0 and stats.lent == 0, stats
    assert not stats.faulted
    return counts


@pytest.mark.parametrize(
    ("path", "n", "calls"),
    [("inline", 16, 3000), ("stepped", 4096, 1500), ("engine", 4096, 300)],
)
async def test_random_cancellations_never_give_a_wrong_result(
    monkeypatch: pytest.MonkeyPatch, path: str, n: int, calls: int
) -> None:
    """Thousands of calls, cancelled at random points and abandoned, on each copy path:
    every result that arrives is its own caller's (the bug: a freed slot still in
    flight gave callers 0.0 or another caller's data)."""
    if path != "inline":
        monkeypatch.setattr(_items, "INLINE_COPY", 1024)  # 16 KiB items: lent results
        monkeypatch.setattr(_items, "COPY_STEP", 4096)  # stepped: 4 steps per item
    if path == "engine":
        monkeypatch.setattr(_items, "STEPPED_COPY", 2048)
    async with open_process_pipeline([ADD, ADD], in_shape=(n,), depth=3) as pipe:
        assert pipe.loans == (0 if path == "inline" else 3)
        counts = await _hammer(pipe, n, calls, seed=hash(path) & 0xFFFF)
        assert pipe.loaned > 0 or path == "inline"
    assert counts["ok"] > calls // 3 and counts["cancelled"] > 0, counts
    assert counts["abandoned"] > 0 and counts["items"] > 0, counts


async def test_a_slot_is_not_reused_while_its_cancelled_item_is_in_a_stage() -> None:
    """Deterministic: the last stage is stopped, so the cancelled item can't leave it;
    its slot must stay out of the pool, and the next caller waits for it."""
    async with open_process_pipeline([ADD, ADD], in_shape=(16,), depth=1) as pipe:
        x = np.ones(16, np.float32)
        await pipe(x)
        last = pipe.workers[1].pid
        await stop_process(last)
        try:
            with trio.move_on_after(0.05):
                await pipe(x * 3)
            assert pipe.statistics().retired == 1 and pipe.statistics().in_flight == 1
            with trio.move_on_after(0.05) as waited:
                await pipe(x * 5)  # no slot: it waits (the old code gave it 0.0 or 5.0)
            assert waited.cancelled_caught
        finally:
            os.kill(last, signal.SIGCONT)
        with trio.fail_after(10):
            y = await pipe(x * 7)
        np.testing.assert_array_equal(y, x * 7 + 2)
        assert pipe.statistics().retired == 0


async def test_an_abandoned_item_block_keeps_its_slot_until_the_item_leaves() -> None:
    async with open_process_pipeline([ADD], in_shape=(16,), depth=1) as pipe:
        await stop_process(pipe.workers[0].pid)
        try:
            async with pipe.item() as item:
                item.input[:] = 1.0
            assert pipe.statistics().retired == 1
            with trio.move_on_after(0.05) as waited:
                async with pipe.item():
                    pass  # pragma: no cover - no slot is free
            assert waited.cancelled_caught
        finally:
            os.kill(pipe.workers[0].pid, signal.SIGCONT)
        with trio.fail_after(10):
            async with pipe.item() as item:
                item.input[:] = 4.0
                np.testing.assert_array_equal(await item.run(), np.full(16, 5.0))


# -- 2. hangs ----------------------------------------------------------------------------


async def test_a_stopped_worker_ends_every_waiting_call_with_signal_timeout() -> None:
    async with open_process_pipeline([ADD, ADD], in_shape=(16,), depth=1, hang_limit=0.5) as pipe:
        x = np.ones(16, np.float32)
        await pipe(x)
        pid = pipe.workers[1].pid
        await stop_process(pid)
        errors: list[BaseException] = []

        async def call() -> None:
            try:
                await pipe(x)
            except hcqa.HcqaError as exc:
                errors.append(exc)

        start = trio.current_time()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)  # in the stopped stage
                nursery.start_soon(call)  # waiting for the one slot
        took = trio.current_time() - start
        assert 0.5 <= took < 3.0
        assert len(errors) == 2 and all(isinstance(e, hcqa.SignalTimeout) for e in errors)
        text = str(errors[0])
        assert "stage 1" in text and f"pid {pid}" in text and "0.5 s" in text, text
        assert errors[0] is errors[1]  # sticky: one fault
        with pytest.raises(hcqa.SignalTimeout):
            await pipe(x)
        assert pipe.statistics().faulted
        with trio.fail_after(5):
            while alive(pid):  # killed (SIGKILL works on a stopped process)
                await trio.sleep(0.01)
    assert not children()


async def test_a_slow_but_progressing_stage_is_not_a_hang() -> None:
    stage = hcqa.ProcessStage(fn="_stages:sleepy", args={"seconds": 0.2})
    async with open_process_pipeline(
        [stage], in_shape=(4,), depth=4, hang_limit=1.0, path=[TESTS]
    ) as pipe:
        results: dict[int, Any] = {}

        async def call(i: int) -> None:
            results[i] = await pipe(np.full(4, i, np.float32))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for i in range(8):  # 8 x 0.2 s = 1.6 s queued: more than a limit
                    nursery.start_soon(call, i)
        for i in range(8):
            np.testing.assert_array_equal(results[i], np.full(4, i + 1.0))
        assert not pipe.statistics().faulted


async def test_a_call_waits_for_its_item_with_no_rereader_timer() -> None:
    # the last stage always writes the coordinator's eventfd after the value, so a caller
    # waiting for its item sleeps on that eventfd alone: the run's re-reader watches no
    # pipeline signal and does not tick while the stage runs
    from hcqa._signals import rereader as _rereader

    stage = hcqa.ProcessStage(fn="_stages:sleepy", args={"seconds": 0.3})
    async with open_process_pipeline([stage], in_shape=(4,), path=[TESTS]) as pipe:
        rereader = _rereader.watch()
        results: list[Any] = []

        async def call() -> None:
            results.append(await pipe(np.full(4, 2, np.float32)))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()
                watched = set(rereader.watched) & set(pipe.signals.values())
                ticks = rereader.ticks
        assert watched == set()
        assert rereader.ticks <= ticks + 1  # (one tick may have been due as a wait began)
        np.testing.assert_array_equal(results[0], np.full(4, 3.0))


async def test_an_idle_pipeline_is_not_a_hang_and_costs_no_cpu() -> None:
    async with open_process_pipeline([ADD], in_shape=(4,), hang_limit=0.05) as pipe:
        await pipe(np.zeros(4, np.float32))
        cpu = time.process_time()
        await trio.sleep(0.3)  # six limits with nothing in flight
        assert time.process_time() - cpu < 0.05
        await pipe(np.zeros(4, np.float32))
        assert not pipe.statistics().faulted


# -- 3. a worker can't kill the coordinator ---------------------------------------------------


def test_memfds_are_sealed_against_shrinking(tmp_path: Any) -> None:
    import fcntl

    from hcqa._signals.slots import memfd

    fd = memfd("hcqa-test", 8192)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        os.ftruncate(fd, 16384)  # growing is harmless
    finally:
        os.close(fd)


async def test_a_stage_that_truncates_its_memfds_gets_an_error_not_our_sigbus() -> None:
    stages = [ADD, "_stages:truncate_memfds"]
    async with open_process_pipeline(stages, in_shape=(4096,), depth=2, path=[TESTS]) as pipe:
        with trio.fail_after(20), pytest.raises(hcqa.DeviceFault, match="PermissionError"):
            await pipe(np.ones(4096, np.float32))
        # every shared page is still whole: touching them is fine
        for row in pipe.buffers:
            for b in row:
                assert float(b._kernel_array().reshape(-1)[-1]) >= 0
        assert pipe.signals["fed"].value >= 1


# -- 4. no orphans ------------------------------------------------------------------------


def test_workers_die_with_a_killed_coordinator(tmp_path: Any) -> None:
    script = textwrap.dedent(
        f"""
        import sys, numpy as np, trio, hcqa
        async def main():
            async with hcqa.open_process_pipeline(
                ["{ADD}", "_stages:stuck"], in_shape=(4,), path=[{TESTS!r}]
            ) as pipe:
                print(" ".join(str(w.pid) for w in pipe.workers), flush=True)
                await pipe(np.ones(4, np.float32))  # stuck in stage 1 forever
        trio.run(main)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=tmp_path, text=True
    )
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        time.sleep(0.2)  # let the item reach the stuck stage (it stays stuck either way)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 2.0
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in pids if alive(p)], "workers outlived their coordinator"


# -- 5. closing wakes everyone -------------------------------------------------------------


@pytest.mark.parametrize("by_exception", [False, True])
async def test_tasks_parked_on_a_closing_pipeline_get_device_closed(by_exception: bool) -> None:
    errors: list[BaseException] = []

    async def wait_for_slot(pipe: hcqa.ProcessPipeline) -> None:
        try:
            await pipe(np.zeros(4, np.float32))
        except hcqa.HcqaError as exc:
            errors.append(exc)

    async def hold_slot(pipe: hcqa.ProcessPipeline, task_status: Any) -> None:
        async with pipe.item():
            task_status.started()
            await trio.sleep_forever()

    with trio.fail_after(20):
        async with trio.open_nursery() as outer:
            try:
                async with open_process_pipeline([ADD], in_shape=(4,), depth=1) as pipe:
                    await outer.start(hold_slot, pipe)
                    outer.start_soon(wait_for_slot, pipe)
                    await trio.testing.wait_all_tasks_blocked()
                    if by_exception:
                        raise KeyError("body")
            except KeyError:
                assert by_exception
            await trio.testing.wait_all_tasks_blocked()
            assert len(errors) == 1 and isinstance(errors[0], hcqa.DeviceClosed), errors
            outer.cancel_scope.cancel()
    with pytest.raises(hcqa.DeviceClosed):
        await pipe(np.zeros(4, np.float32))


async def test_a_normal_close_drains_items_already_fed() -> None:
    stage = hcqa.ProcessStage(fn="_stages:sleepy", args={"seconds": 0.05})
    results: list[Any] = []
    async with trio.open_nursery() as outer:
        async with open_process_pipeline([stage], in_shape=(4,), depth=2, path=[TESTS]) as pipe:

            async def call() -> None:
                results.append(await pipe(np.ones(4, np.float32)))

            outer.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
    assert len(results) == 1 and float(results[0][0]) == 2.0


# -- 6. nothing left behind -----------------------------------------------------------------


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


async def test_open_close_cycles_leak_no_process_fd_mapping_or_thread() -> None:
    async def cycle() -> None:
        async with open_process_pipeline([ADD], in_shape=(4,), depth=2) as pipe:
            np.testing.assert_array_equal(await pipe(np.ones(4, np.float32)), np.full(4, 2.0))

    async def cycles(n: int) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(cycle)

    with trio.fail_after(120):
        await cycles(5)  # warm what is made once (a malloc arena per concurrent thread...)
        gc.collect()
        before = (len(os.listdir("/proc/self/fd")), _maps(), threading.active_count())
        for _ in range(2):  # 20 cycles, 10 at a time: a leak of one of anything per cycle
            await cycles(10)  # shows as 20 (each pipeline maps 6 buffers and signal pages)
    gc.collect()
    fds, maps, threads = (len(os.listdir("/proc/self/fd")), _maps(), threading.active_count())
    assert fds == before[0], f"fds leaked: {before[0]} -> {fds}"
    # trio's cached worker threads may retire while idle, so the count may fall, never rise;
    # the pipelines' own threads are checked by name.
    assert threads <= before[2], f"threads leaked: {before[2]} -> {threads}"
    forks = [t for t in threading.enumerate() if t.name == "hcqa process-pipeline forks"]
    assert forks == [], f"fork threads outlived their pipelines: {forks}"
    # Each pipeline maps 6 shared buffers and signal pages: a leak would add >= 20 lines.
    # The allocator may keep a new arena or two across the rounds.
    assert maps - before[1] < 10, f"mappings leaked: {before[1]} -> {maps}"
    assert children() == set(), "processes leaked"


# -- 7. the worker's start-up -------------------------------------------------------------


async def test_workers_import_nothing_from_the_working_directory(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "planted-ran"
    planted = tmp_path / "cwd"
    planted.mkdir()
    for name in ("numpy", "trio", "planted"):
        (planted / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'a').write('{name} ')\ndef stage(out, inp):\n    out[:] = inp\n"
        )
    monkeypatch.chdir(planted)
    async with open_process_pipeline([ADD], in_shape=(4,)) as pipe:
        np.testing.assert_array_equal(await pipe(np.ones(4, np.float32)), np.full(4, 2.0))
    with pytest.raises(hcqa.DeviceFault, match="'planted' was not found on the workers' path"):
        async with open_process_pipeline(["planted:stage"], in_shape=(4,)):
            pass  # pragma: no cover
    assert not marker.exists()
    # named explicitly, a directory is used
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "planted.py").write_bytes((planted / "planted.py").read_bytes())
    async with open_process_pipeline(
        ["planted:stage"], in_shape=(4,), path=[str(tmp_path / "mine")]
    ):
        pass
    assert marker.read_text() == "planted "


async def test_a_worker_dying_during_set_up_is_a_device_fault_naming_it() -> None:
    stage = hcqa.ProcessStage(fn="_stages:die_in_factory", args={"code": 3})
    with trio.fail_after(20), pytest.raises(hcqa.DeviceFault) as info:
        async with open_process_pipeline([ADD, stage], in_shape=(4,), path=[TESTS]):
            pass  # pragma: no cover
    text = str(info.value)
    assert "worker 1" in text and "_stages:die_in_factory" in text and "pid " in text, text
    assert "exit status 3" in text, text
    assert not children()


def test_private_pipelines_are_not_dumpable(tmp_path: Any) -> None:
    """``private=True``: coordinator and workers are non-dumpable (their /proc entries
    and ptrace are root's only); run in a child, since it can't be undone here."""
    script = textwrap.dedent(
        f"""
        import ctypes, json, numpy as np, trio, hcqa
        libc = ctypes.CDLL(None)
        async def main():
            before = libc.prctl(3, 0, 0, 0, 0)
            async with hcqa.open_process_pipeline(
                ["_stages:dumpable"], in_shape=(1,), path=[{TESTS!r}], private=True
            ) as pipe:
                worker = float((await pipe(np.zeros(1, np.float32)))[0])
            print(json.dumps([before, libc.prctl(3, 0, 0, 0, 0), worker]))
        trio.run(main)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [1, 0, 0.0]
