"""A worker's stage loop (``hcqa.processes._worker._stage_loop``) run in a thread of this
process: it sleeps in a blocking read of its input signal's eventfd, so every way out of
that read must still come -- a value set, a break -- and items must land in the slots the
table names. (Quick: one thread, a few items; no worker process.)"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from hcqa.errors import DeviceClosed, DeviceFault
from hcqa.processes._worker import _stage_loop
from hcqa.signals import Signal

DEPTH = 3


def _add_one(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
    np.add(inp, 1, out=out)


class Loop:
    """A stage loop on its own thread, over in-process slots and signals."""

    def __init__(self, fn: Any = _add_one) -> None:
        self.ins = [np.zeros(4, np.float32) for _ in range(DEPTH)]
        self.outs = [np.zeros(4, np.float32) for _ in range(DEPTH + 1)]  # one loan slot
        self.table = np.zeros((DEPTH, 2), np.int64)
        self.inp, self.done = Signal(name="fed"), Signal(name="done0")
        self.result: list[BaseException | None] = []
        self.thread = threading.Thread(target=self._run, args=(fn,), name="test stage loop")
        self.thread.start()

    def _run(self, fn: Any) -> None:
        self.result.append(_stage_loop(fn, self.ins, self.outs, self.table, 1, self.inp, self.done))

    def feed(self, k: int, slot: int, oslot: int, value: float) -> None:
        self.table[k % DEPTH] = (slot, oslot)
        self.ins[slot][:] = value
        self.inp._set_from_engine(k)

    def finish(self, exc: BaseException) -> BaseException | None:
        self.inp._break(exc)
        self.thread.join(10)
        assert not self.thread.is_alive(), "the stage loop did not wake from its read"
        self.inp.close()
        self.done.close()
        return self.result[0]


def test_items_go_through_in_order_into_the_slots_the_table_names() -> None:
    loop = Loop()
    try:
        for k in range(1, 8):
            slot, oslot = k % DEPTH, DEPTH if k % 2 else k % DEPTH  # odd items: the loan
            loop.feed(k, slot, oslot, float(k))
            loop.done.wait_sync(k, timeout=10)
            np.testing.assert_array_equal(loop.outs[oslot], np.full(4, k + 1, np.float32))
    finally:
        assert loop.finish(DeviceClosed("closed")) is None


def test_a_break_wakes_an_idle_loop_blocked_in_its_read() -> None:
    loop = Loop()
    # no item fed: the thread is (or is about to be) blocked in read(2); a break ends it
    assert loop.finish(DeviceClosed("closed")) is None
    assert loop.done.value == 0


def test_a_fault_that_breaks_the_input_is_returned() -> None:
    loop = Loop()
    fault = DeviceFault("worker 0 died", device="worker0")
    assert loop.finish(fault) is fault


def test_a_stage_error_ends_the_loop_and_is_returned() -> None:
    def boom(out: npt.NDArray[Any], inp: npt.NDArray[Any]) -> None:
        raise ValueError("stage says no")

    loop = Loop(boom)
    loop.feed(1, 0, 0, 1.0)
    loop.thread.join(10)
    assert not loop.thread.is_alive()
    (error,) = loop.result
    assert isinstance(error, ValueError)
    assert loop.done.value == 0  # the failed item is not reported done
    loop.inp.close()
    loop.done.close()


@pytest.mark.parametrize("ahead", [1, 3])
def test_values_set_before_the_loop_reads_are_not_lost(ahead: int) -> None:
    """Several items fed at once (one eventfd count, or several): each is run."""
    loop = Loop()
    try:
        for k in range(1, ahead + 1):
            loop.table[k % DEPTH] = (k % DEPTH, k % DEPTH)
            loop.ins[k % DEPTH][:] = k
        loop.inp._set_from_engine(ahead)
        loop.done.wait_sync(ahead, timeout=10)
        for k in range(1, ahead + 1):
            np.testing.assert_array_equal(loop.outs[k % DEPTH], np.full(4, k + 1, np.float32))
    finally:
        assert loop.finish(DeviceClosed("closed")) is None
