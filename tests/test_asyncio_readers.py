"""Kept readers: an asyncio owner's eventfd reader stays registered between waits
(hcqa/_signals/aio_readers.py). Plain functions that call ``asyncio.run``."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import hcqa
from hcqa._signals import aio_readers
from hcqa.signals import Signal

TIMEOUT = 30.0


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), TIMEOUT))


def negate(out: Any, a: Any) -> None:
    np.negative(a, out=out)


def kept(sig: Signal) -> aio_readers.Reader | None:
    table = aio_readers._tables.get(asyncio.get_running_loop())
    return None if table is None else table.readers.get(id(sig))


async def park_until(sig: Signal, value: int) -> None:
    """Wait from asyncio for ``sig`` to reach ``value``, set on the loop once parked."""
    asyncio.get_running_loop().call_soon(setattr, sig, "value", value)
    await sig.wait(value)


def test_one_registration_serves_every_wait_on_a_signal() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        added: list[int] = []
        add_reader = loop.add_reader

        def counting(fd: int, *args: Any) -> None:
            added.append(fd)
            add_reader(fd, *args)

        loop.add_reader = counting  # type: ignore[method-assign,assignment]
        sig = Signal()
        for v in range(1, 6):
            await park_until(sig, v)
            reader = kept(sig)
            assert reader is not None and reader.current is None  # idle between waits
        assert len(added) == 1  # registered once: a duplicate of the signal's eventfd
        assert added[0] != sig._fd
        sig.close()
        other = Signal()
        await park_until(other, 1)  # a new registration sweeps the closed signal's away
        assert kept(sig) is None
        assert list(aio_readers._tables[loop].readers.values()) == [kept(other)]
        other.close()

    run(main)


def test_an_idle_reader_leaves_another_owners_wake_up_alone() -> None:
    async def main() -> None:
        sig = Signal()
        await park_until(sig, 1)
        reader = kept(sig)
        assert reader is not None
        fd = reader.fd
        woke = threading.Event()

        def thread_wait() -> None:  # a thread owns the eventfd now
            sig.wait_sync(2, TIMEOUT)
            woke.set()

        thread = threading.Thread(target=thread_wait)
        thread.start()
        while sig.statistics().owner != "thread":
            await asyncio.sleep(0.001)
        sig.value = 2  # the write wakes the thread (and the loop: the reader drops itself)
        await asyncio.to_thread(thread.join, TIMEOUT)
        assert woke.is_set()  # the idle reader left the counter to the thread
        # The loop's reader fires only if the loop polled before the thread read the counter
        # (level-triggered: once read, the eventfd is not readable); then it dropped itself.
        # Otherwise it is still registered, idle, and serves the next wait as before.
        await asyncio.sleep(0)  # (one round of the loop: a pending fire runs)
        if kept(sig) is None:
            assert reader.fd == -1
            try:
                os.fstat(fd)
            except OSError:
                pass  # closed (or, at most, reused by someone else's descriptor since)
        else:
            assert kept(sig) is reader and reader.current is None and reader.fd == fd
        await park_until(sig, 3)  # and the next asyncio wait is served
        reader = kept(sig)
        assert reader is not None and reader.current is None
        # Deterministically now: another owner's wake-up that nobody has read yet (written
        # straight to the eventfd) makes the idle reader drop itself and leave the count.
        fd = reader.fd
        os.eventfd_write(sig._fd, 1)
        for _ in range(10):  # loop rounds, not time: the reader fires on the next poll
            if kept(sig) is None:
                break
            await asyncio.sleep(0)
        assert kept(sig) is None and reader.fd == -1
        assert os.eventfd_read(sig._fd) == 1  # the other owner's wake-up is still there
        await park_until(sig, 4)  # and the next asyncio wait registers again
        assert kept(sig) is not None and kept(sig) is not reader
        sig.close()

    run(main)


def test_a_hosts_end_drops_the_loops_readers() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        sig = Signal()  # outlives the block, never written again
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            pipe = hcqa.Pipeline([(d0, negate), (d1, negate)], in_shape=(4,))
            x = np.arange(4, dtype=np.float32)
            for _ in range(3):
                np.testing.assert_array_equal(await pipe(x), x)
            await park_until(sig, 1)
            assert len(aio_readers._tables[loop].readers) == 3  # two timelines and sig
        assert not aio_readers._tables[loop].readers  # closing woke the timelines' (they
        assert not aio_readers._tables[loop].fds  # dropped themselves); the host's end, sig's
        sig.close()

    run(main)
