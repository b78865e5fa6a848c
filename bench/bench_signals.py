"""Signal wake-up latency against its floor, and the CPU a waiter burns.

Run: ``python -m bench.bench_signals`` (``--quick`` for a short run, ``-n`` for samples).

Latency: a persistent producer thread gets a "go" through a queue, sleeps a little (the
"device" at work, and time for the waiter to park), takes ``t0 = perf_counter_ns()`` and
writes; the waiter takes ``t1`` as soon as it resumes. Four wake paths are sampled
round-robin in one run (the order rotates every round) so host noise hits all alike:

- hcqa: ``sig.value = k`` in the thread, ``await sig.wait(k)`` in a trio task;
- raw floor: ``os.eventfd_write`` in the thread, ``trio.lowlevel.wait_readable`` +
  ``os.eventfd_read`` in a trio task;
- ``threading.Event.set`` in the thread, ``Event.wait`` in another thread;
- ``trio.from_thread.run_sync(event.set)`` in the thread, ``await event.wait()`` in a task.

CPU: process CPU time (``time.process_time``, all threads) while one waiter waits for a
value that does not come: hcqa ``await sig.wait``, hcqa ``wait_sync`` in a thread, and a
thread spinning on ``while sig.value < 1: pass``. With the memory re-read backoff on
the first two include the owner's timer wakes; the full run's window is 10 s.

Memory-only producers: after an idle stretch, a thread writes the value word only (no
eventfd, as a device or a forgetful C kernel would); how long until the waiter resumes.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import queue
import threading
import time
from collections.abc import Awaitable, Callable

import trio

from bench._util import percentile, print_table
from hcqa.errors import SignalTimeout
from hcqa.signals import Signal

PRODUCER_DELAY = 200e-6  # seconds the producer sleeps before it writes

Write = Callable[[], object]


class Producer:
    """A persistent thread that performs writes on request, stamping t0 just before."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[Write | None] = queue.SimpleQueue()
        self.t0 = 0
        self._thread = threading.Thread(target=self._run, name="bench-producer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (write := self._requests.get()) is not None:
            time.sleep(PRODUCER_DELAY)
            self.t0 = time.perf_counter_ns()
            write()

    def go(self, write: Write) -> None:
        self._requests.put(write)

    def stop(self) -> None:
        self._requests.put(None)
        self._thread.join()


async def measure_latency(n: int) -> dict[str, list[float]]:
    producer = Producer()
    token = trio.lowlevel.current_trio_token()

    sig = Signal(name="bench")
    target = 0

    async def hcqa_signal() -> float:
        nonlocal target
        target += 1
        k = target

        def write() -> None:
            sig.value = k

        producer.go(write)
        await sig.wait(k)
        return time.perf_counter_ns() - producer.t0

    efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)

    async def raw_eventfd() -> float:
        producer.go(lambda: os.eventfd_write(efd, 1))
        await trio.lowlevel.wait_readable(efd)
        os.eventfd_read(efd)  # part of the floor: a waiter must consume the eventfd
        return time.perf_counter_ns() - producer.t0

    thread_event = threading.Event()

    def thread_wait() -> float:
        thread_event.clear()
        producer.go(thread_event.set)
        thread_event.wait()
        return time.perf_counter_ns() - producer.t0

    async def threading_event() -> float:
        return await trio.to_thread.run_sync(thread_wait)

    async def from_thread_run_sync() -> float:
        event = trio.Event()
        producer.go(lambda: trio.from_thread.run_sync(event.set, trio_token=token))
        await event.wait()
        return time.perf_counter_ns() - producer.t0

    kinds: dict[str, Callable[[], Awaitable[float]]] = {
        "hcqa": hcqa_signal,
        "raw": raw_eventfd,
        "threading": threading_event,
        "from_thread": from_thread_run_sync,
    }
    samples: dict[str, list[float]] = {name: [] for name in kinds}
    names = list(kinds)
    try:
        for name in names:  # warm up every path (thread cache, epoll registration)
            for _ in range(20):
                await kinds[name]()
        for i in range(n):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append((await kinds[name]()) / 1000.0)  # µs
    finally:
        producer.stop()
        os.close(efd)
        sig.close()
    return samples


async def measure_cpu(window: float) -> dict[str, float]:
    out: dict[str, float] = {}

    sig = Signal(name="cpu-await")
    cpu = time.process_time()
    with trio.move_on_after(window):
        await sig.wait(1)
    out["await"] = time.process_time() - cpu
    sig.close()

    sig = Signal(name="cpu-wait-sync")

    def wait_sync() -> None:
        try:
            sig.wait_sync(1, timeout=window)
        except SignalTimeout:
            pass

    cpu = time.process_time()
    await trio.to_thread.run_sync(wait_sync)
    out["wait_sync"] = time.process_time() - cpu
    sig.close()

    sig = Signal(name="cpu-spin")

    def spin() -> None:
        while sig.value < 1:
            pass

    cpu = time.process_time()
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    await trio.sleep(window)
    sig.value = 1
    thread.join()
    out["spin"] = time.process_time() - cpu
    sig.close()
    return out


async def measure_memory_only(rounds: int, idle: float) -> list[float]:
    """Seconds from a memory-only write to the waiter resuming, after ``idle`` s each."""
    out: list[float] = []
    for k in range(1, rounds + 1):
        sig = Signal(name="memory-only")
        word = ctypes.c_uint64.from_address(sig.address)
        written = 0.0

        def write(word: ctypes.c_uint64 = word, k: int = k) -> None:
            nonlocal written
            time.sleep(idle)
            written = time.perf_counter()
            word.value = k

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        await sig.wait(k)
        out.append(time.perf_counter() - written)
        thread.join()
        sig.close()
    return out


def report(samples: dict[str, list[float]], cpu: dict[str, float], window: float) -> None:
    n = len(samples["raw"])
    raw50, raw99 = percentile(samples["raw"], 50), percentile(samples["raw"], 99)
    labels = {
        "hcqa": "hcqa `Signal`: `sig.value = k` → `await sig.wait(k)` (task)",
        "raw": "raw floor: `eventfd_write` → `wait_readable` + `eventfd_read` (task)",
        "threading": "`threading.Event.set` → `Event.wait` (thread)",
        "from_thread": "`trio.from_thread.run_sync(ev.set)` → `await ev.wait()` (task)",
    }
    rows = []
    for name, label in labels.items():
        p50, p99 = percentile(samples[name], 50), percentile(samples[name], 99)
        rows.append(
            [label, f"{p50:.1f}", f"{p99:.1f}", f"{p50 / raw50:.2f}x", f"{p99 / raw99:.2f}x"]
        )
    print(
        f"## Wake-up latency, thread writes → waiter resumes "
        f"(N={n} each, interleaved; {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"trio {trio.__version__})\n"
    )
    print_table(["wake path", "p50 µs", "p99 µs", "p50 / raw", "p99 / raw"], rows)
    ratio = percentile(samples["hcqa"], 50) / raw50
    verdict = "met" if ratio <= 2.0 else "MISSED"
    print(
        f"\nhcqa p50 = {ratio:.2f}x the raw eventfd floor (target ≤ 2x: {verdict}); "
        f"p99 = {percentile(samples['hcqa'], 99) / raw99:.2f}x.\n"
    )

    print(f"## CPU burnt by one waiter over {window:g} s (process CPU, all threads)\n")
    cpu_rows = [
        [
            "hcqa `await sig.wait(1)` (trio task, eventfd owner)",
            f"{cpu['await']:.4f}",
            f"{100 * cpu['await'] / window:.2f} %",
        ],
        [
            "hcqa `sig.wait_sync(1, timeout=…)` (thread, poll)",
            f"{cpu['wait_sync']:.4f}",
            f"{100 * cpu['wait_sync'] / window:.2f} %",
        ],
        [
            "spinning thread `while sig.value < 1: pass`",
            f"{cpu['spin']:.4f}",
            f"{100 * cpu['spin'] / window:.2f} %",
        ],
    ]
    print_table(["waiter", "CPU s", "of one core"], cpu_rows)
    verdict = "met" if max(cpu["await"], cpu["wait_sync"]) < 0.01 * window else "MISSED"
    print(f"\nidle waiter with the memory re-read backoff: target < 1 % of a core: {verdict}\n")


def report_memory_only(late: list[float], idle: float) -> None:
    print(f"## Memory-only write (value word only, no eventfd) after {idle:g} s idle\n")
    rows = [
        ["p50 ms", f"{1000 * percentile(late, 50):.1f}"],
        ["max ms", f"{1000 * max(late):.1f}"],
    ]
    print_table([f"N={len(late)}", "write → waiter resumes"], rows)
    verdict = "met" if max(late) < 0.1 else "MISSED"
    print(f"\ntarget: seen within 100 ms: {verdict}")


async def amain(n: int, window: float) -> None:
    samples = await measure_latency(n)
    cpu = await measure_cpu(window)
    idle = 0.3 if window < 1 else 1.0
    late = await measure_memory_only(3 if window < 1 else 10, idle)
    report(samples, cpu, window)
    report_memory_only(late, idle)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="300 samples, 0.3 s CPU window")
    parser.add_argument("--window", type=float, default=None, help="CPU window in s (10)")
    parser.add_argument("-n", type=int, default=None, help="samples per wake path (2000)")
    args = parser.parse_args(argv)
    n = args.n if args.n is not None else (300 if args.quick else 2000)
    window = args.window if args.window is not None else (0.3 if args.quick else 10.0)
    trio.run(amain, n, window)


if __name__ == "__main__":
    main()
