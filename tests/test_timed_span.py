"""Device timing spans (issue 17): ``async with d.timed() as span`` and the clock offset."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio

import hcqa
from hcqa.errors import InvalidCommand

TIMEOUT = 20.0


def _nap(seconds: float) -> Any:
    def nap(out: npt.NDArray[Any]) -> None:
        time.sleep(seconds)  # the kernel at work (a thread asleep), not synchronisation

    return nap


async def test_span_times_queued_work_on_both_queues_with_device_timestamps() -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            nap = d.program("nap", _nap(0.1))
            copy_nap = d.program("nap", _nap(0.0))
            out = d.alloc(8)
            big = d.alloc(32 << 20)
            host = np.ones(32 << 20, np.uint8)
            before = time.monotonic_ns() / 1000.0
            async with d.timed() as span:
                assert span.seconds is None
                nap(out)  # not awaited: the span waits for it
                big.copyin(host)  # the copy queue's work is in the span too
            after = time.monotonic_ns() / 1000.0
            assert span.seconds is not None
            assert 0.1 <= span.seconds < (after - before) / 1e6
            assert span.start_us is not None and span.end_us is not None
            assert before <= span.start_us < span.end_us <= after
            assert span.end_us - span.start_us == pytest.approx(span.seconds * 1e6, abs=0.01)
            # the copy had finished by the end stamp: a kernel timed now is short
            async with d.timed(queue="copy") as quick:
                await copy_nap(out)
            assert quick.seconds is not None and quick.seconds < span.seconds
            assert "TimedSpan cpu:0 copy" in repr(quick)


async def test_cpu_clock_offset_is_exactly_zero_and_span_times_are_the_stamps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            assert d.clock_offset_ns() == 0
            assert type(d.clock_offset_ns()) is int
            prog = d.program("nap", _nap(0.01))
            out = d.alloc(8)
            t0 = time.monotonic_ns() / 1000
            async with d.timed() as plain:
                prog(out)
            t1 = time.monotonic_ns() / 1000
            # Signal.timestamp is on the host clock for every device: a device with a clock
            # of its own applies its offset when it stores a stamp, so the span never does
            monkeypatch.setattr(d, "clock_offset_ns", lambda: 5_000_000)
            async with d.timed() as shifted:
                prog(out)
            t2 = time.monotonic_ns() / 1000
            assert plain.seconds is not None and shifted.seconds is not None
            assert plain.start_us is not None and plain.end_us is not None
            assert shifted.start_us is not None and shifted.end_us is not None
            assert t0 <= plain.start_us <= plain.end_us <= t1
            assert t1 <= shifted.start_us <= shifted.end_us <= t2
            assert shifted.seconds == pytest.approx(plain.seconds, abs=0.01)


async def test_span_left_by_an_exception_has_no_result_and_leaves_the_device_usable() -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            prog = d.program("nap", _nap(0.0))
            out = d.alloc(8)
            span = d.timed()
            with pytest.raises(ZeroDivisionError):
                async with span:
                    prog(out)
                    1 / 0  # noqa: B018
            assert span.seconds is None
            with pytest.raises(InvalidCommand, match="entered once"):
                async with span:
                    pass
            cancelled = d.timed()
            with trio.CancelScope() as scope:
                async with cancelled:
                    prog(out)
                    scope.cancel()  # takes effect at the exit's wait
            assert scope.cancelled_caught
            assert cancelled.seconds is None
            entering = d.timed()
            with trio.move_on_after(0):  # cancelled at the entry's checkpoint
                async with entering:
                    pass
            assert entering.seconds is None
            async with d.timed() as nested_outer:
                async with d.timed() as nested_inner:
                    await prog(out)
            assert nested_outer.seconds is not None and nested_inner.seconds is not None
            assert nested_inner.seconds <= nested_outer.seconds
            await d.synchronize()


async def test_span_refuses_capture_and_bad_queue_and_closed_devices() -> None:
    async with hcqa.open_device("cpu:0") as d:
        with pytest.raises(InvalidCommand, match="'queue' must be 'compute' or 'copy'"):
            d.timed(queue="dma")
        with hcqa.capture():
            with pytest.raises(InvalidCommand, match="can't be captured"):
                async with d.timed():
                    pass
    with pytest.raises(hcqa.DeviceClosed):
        async with d.timed():
            pass


def test_span_under_asyncio() -> None:
    async def main() -> float | None:
        async with hcqa.open_device("cpu:0") as d:
            prog = d.program("nap", _nap(0.02))
            out = d.alloc(8)
            async with d.timed() as span:
                prog(out)
            return span.seconds

    seconds = asyncio.run(main())
    assert seconds is not None and seconds >= 0.02
