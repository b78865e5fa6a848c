"""Measuring processes for the process-pipeline benchmarks: plans, CPU from /proc, results as JSON.

A benchmark's round runs in a child process (``--child``), which prints each result as one JSON
line (``emit``); the parent collects them. CPU is read from ``/proc/<pid>/stat`` (utime +
stime of every thread), per group of processes over a window (``CpuWindow``); a reused pid is
told apart by its start time. ``guarded`` times a call that may hang (a teardown) in a daemon
thread. ``bench_workers`` and ``bench_multihost`` share these."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._util import percentile

TEARDOWN_LIMIT = 20.0  # seconds before a teardown counts as hung


@dataclass(frozen=True)
class Plan:
    name: str
    rounds: int
    warmup: int
    lat_small: int
    lat_big: int
    tput_small: int
    tput_big: int
    idle_s: float
    child_timeout_s: float


Value = float | str  # a measurement, or "hung" / an error note


# -- CPU accounting from /proc ---------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat from field 3 (state) on; None when the process is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return data[data.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid`` so far (0 when it is gone)."""
    f = _stat(pid)
    return 0.0 if f is None else (int(f[11]) + int(f[12])) / _TICK


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    f = _stat(pid)
    return -1 if f is None else int(f[19])


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            f = _stat(int(name))
            if f is not None:
                children.setdefault(int(f[1]), []).append(int(name))
    out: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


class CpuWindow:
    """CPU used by groups of processes between construction and :meth:`stop`."""

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self.groups = {k: list(v) for k, v in groups.items()}
        self.start = {p: cpu_seconds(p) for pids in self.groups.values() for p in pids}
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[float, dict[str, float]]:
        """(wall seconds, % of one core per group)."""
        wall = time.perf_counter() - self.t0
        pct = {
            k: 100.0 * sum(cpu_seconds(p) - self.start[p] for p in pids) / wall
            for k, pids in self.groups.items()
        }
        return wall, pct


# -- the child side: one round of one contender, results as JSON lines on stdout ------------------


def emit(key: str, value: Any) -> None:
    print(json.dumps({key: value}), flush=True)


def emit_latency(tag: str, samples: Sequence[float]) -> None:
    emit(f"lat_{tag}_p50", percentile(samples, 50) * 1e6)
    emit(f"lat_{tag}_p99", percentile(samples, 99) * 1e6)


def emit_cpu(key: str, pct: dict[str, float]) -> None:
    emit(key, sum(v for k, v in pct.items() if not k.startswith("ray-daemons")))
    for k, v in pct.items():
        emit(f"{key}:{k}", v)


def guarded(fn: Callable[[], object], limit: float = TEARDOWN_LIMIT) -> Value:
    """Seconds ``fn()`` took in a daemon thread; "hung" past ``limit``, or the error."""
    box: dict[str, Value] = {}

    def run() -> None:
        t = time.perf_counter()
        try:
            fn()
        except BaseException as exc:
            box["v"] = f"error: {type(exc).__name__}: {exc}"[:200]
            return
        box["v"] = time.perf_counter() - t

    thread = threading.Thread(target=run, daemon=True, name="guarded")
    thread.start()
    thread.join(limit)
    return box.get("v", "hung")
