"""Process-pipeline benchmark: hcqa's worker processes vs Ray Compiled Graphs.

Run from the repository root (the stage workers import ``bench._stages`` from there, given
to them as ``path=[ROOT]``: workers never import from the working directory)::

    python -m bench.bench_workers            # 3 rounds per side, interleaved (about 2 min)
    python -m bench.bench_workers --quick    # 1 round per side, fewer items
    python -m bench.bench_workers --no-ray   # hcqa only
    python -m bench.bench_workers --hops     # hcqa only: where an item's time goes, per hop

The pipeline: 2 stages in 2 worker processes, each a trivial numpy stage (``out = inp + 1``).

* **hcqa**: ``open_process_pipeline(["hcqa.workers:add_one"] * 2, depth=10)``; the coordinator
  is this process, the stages run in ``pipe.workers[i].pid``.
* **Ray Compiled Graphs** (optional: ``pip install "ray[default]"``): two actors, each with the
  same stage, ``b.fwd.bind(a.fwd.bind(inp)).experimental_compile(_max_inflight_executions=10)``,
  on a local Ray started with ``ray.init(include_dashboard=False, num_cpus=2)`` and shut down
  after.

Measured per side, for 16 float32 and for 4 MiB items:

* latency per item: sequential ``await pipe(x)`` / ``ray.get(cdag.execute(x))``, p50 and p99;
  for 4 MiB hcqa also with its result copied out (the caller holds every loan slot) and
  zero-copy (``pipe.item()``: the caller fills the input slot, reads the output in place);
* items/s with 10 in flight: 10 concurrent callers on a depth-10 pipeline / a window of 10
  outstanding ``execute`` refs (``ray.get`` of the oldest before the next submit);
* CPU used by every process of the pipeline (utime + stime from ``/proc/<pid>/stat``): over 2 s
  idle (pipeline open, nothing submitted), and during one item whose first stage sleeps 1 s
  (``bench._stages:sleep_1s``); for Ray also its cluster daemons (raylet, GCS, idle workers);
* teardown: leaving ``async with open_process_pipeline(...)`` with 10 items in flight /
  ``cdag.teardown()`` with 10 executions outstanding, run in a thread with a 20 s limit:
  "hung" past it.

Each side runs in its own child process (``--child``), one round at a time, alternating which
side goes first, so load from the host hits both; the table reports medians over rounds.
Targets: latency <= 0.3x Ray's, items/s >= 3x Ray's, idle CPU < 5 % of a core, teardown < 1 s.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench._procs import (
    CpuWindow,
    Plan,
    Value,
    _stat,
    descendants,
    emit,
    emit_cpu,
    emit_latency,
    guarded,
    start_time,
)
from bench._stages import KERNEL_SECONDS
from bench._util import markdown_table, percentile
from bench._workers_report import (
    _per_round,
    report,
)

ROOT = Path(__file__).resolve().parents[1]
SMALL = 16  # float32 items
BIG = (4 << 20) // 4  # float32 items: 4 MiB
IN_FLIGHT = 10
STAGE = "hcqa.workers:add_one"
SLOW_STAGE = "bench._stages:sleep_1s"


FULL = Plan("full", 3, 100, 2000, 200, 3000, 200, 2.0, 300.0)
QUICK = Plan("quick", 1, 20, 300, 30, 500, 40, 2.0, 240.0)
PLANS = {p.name: p for p in (FULL, QUICK)}


async def _hcqa_round(plan: Plan) -> None:
    import trio

    from hcqa.processes import ProcessPipeline, open_process_pipeline

    me = os.getpid()

    async def flood(pipe: ProcessPipeline, x: npt.NDArray[np.float32]) -> None:
        while True:
            await pipe(x)

    async def payload(tag: str, n: int, lat_n: int, tput_n: int, idle: bool) -> None:
        x = np.arange(n, dtype=np.float32)
        t0 = time.perf_counter()
        async with open_process_pipeline(
            [STAGE, STAGE], in_shape=(n,), dtype="float32", depth=IN_FLIGHT
        ) as pipe:
            emit(f"setup_{tag}", time.perf_counter() - t0)
            workers = [w.pid for w in pipe.workers]
            for _ in range(plan.warmup // (1 if n == SMALL else 10)):
                y = await pipe(x)
            np.testing.assert_array_equal(y, x + 2)
            samples = []
            for _ in range(lat_n):
                t = time.perf_counter()
                await pipe(x)
                samples.append(time.perf_counter() - t)
            emit_latency(tag, samples)
            if tag == "big":  # the result copied out: every loan slot held by the caller
                held = [await pipe(x) for _ in range(pipe.loans)]
                samples = []
                for _ in range(lat_n):
                    t = time.perf_counter()
                    await pipe(x)
                    samples.append(time.perf_counter() - t)
                emit_latency("big_copy", samples)
                del held
                # zero-copy: the caller fills the shared slot, reads a view
                samples = []
                for _ in range(lat_n):
                    t = time.perf_counter()
                    async with pipe.item() as item:
                        np.copyto(item.input, x)
                        out = await item.run()
                        assert out[0] == x[0] + 2
                    samples.append(time.perf_counter() - t)
                emit_latency("big_zc", samples)

            left = [tput_n]

            async def caller() -> None:
                while left[0] > 0:
                    left[0] -= 1
                    await pipe(x)

            t = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(IN_FLIGHT):
                    nursery.start_soon(caller)
            emit(f"tput_{tag}", tput_n / (time.perf_counter() - t))

            if tag == "big":  # zero-copy, the input produced in place (one value written)
                left[0] = tput_n

                async def zc_caller() -> None:
                    while left[0] > 0:
                        left[0] -= 1
                        async with pipe.item() as item:
                            item.input[0] = left[0]
                            out = await item.run()
                            assert out[0] == item.input[0] + 2

                t = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for _ in range(IN_FLIGHT):
                        nursery.start_soon(zc_caller)
                emit("tput_big_zc", tput_n / (time.perf_counter() - t))

            if idle:
                window = CpuWindow({"coordinator": [me], "workers": workers})
                await trio.sleep(plan.idle_s)
                emit_cpu("idle_cpu", window.stop()[1])

            # teardown with IN_FLIGHT callers mid-item
            async with trio.open_nursery() as nursery:
                for _ in range(IN_FLIGHT):
                    nursery.start_soon(flood, pipe, x)
                start = pipe.completed
                while pipe.completed < start + IN_FLIGHT:  # flowing: every caller is mid-item
                    await trio.sleep(0.001)
                nursery.cancel_scope.cancel()
                t_cancel = time.perf_counter()
        emit(f"teardown_{tag}", time.perf_counter() - t_cancel)
        alive = [p for p in workers if _stat(p) is not None]
        if alive:
            emit(f"teardown_{tag}_leftover", alive)

    await payload("small", SMALL, plan.lat_small, plan.tput_small, idle=True)

    async with open_process_pipeline(
        [SLOW_STAGE, STAGE], in_shape=(SMALL,), dtype="float32", depth=2, path=[str(ROOT)]
    ) as pipe:
        await pipe(np.zeros(SMALL, np.float32))  # warm: no sleep for a leading 0
        window = CpuWindow({"coordinator": [me], "workers": [w.pid for w in pipe.workers]})
        await pipe(np.ones(SMALL, np.float32))
        wall, pct = window.stop()
        emit_cpu("busy_cpu", pct)
        emit("busy_wall", wall)

    await payload("big", BIG, plan.lat_big, plan.tput_big, idle=False)


class _RayStage:
    """The Ray side's actor: the same trivial numpy stage (and the sleeping one)."""

    def pid(self) -> int:
        return os.getpid()

    def fwd(self, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        return x + 1

    def slow(self, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        if x.flat[0] != 0:
            time.sleep(KERNEL_SECONDS)
        return x + 1


def _ray_round(plan: Plan) -> None:
    # imported by name: an optional extra, typed as Any whether or not it is installed
    ray: Any = importlib.import_module("ray")
    InputNode: Any = importlib.import_module("ray.dag").InputNode

    me = os.getpid()
    t = time.perf_counter()
    ray.init(
        include_dashboard=False, num_cpus=2, log_to_driver=False, logging_level=logging.WARNING
    )
    emit("init_s", time.perf_counter() - t)
    stage: Any = ray.remote(_RayStage)
    a, b = stage.remote(), stage.remote()
    actors = ray.get([a.pid.remote(), b.pid.remote()])
    everyone = descendants(me)
    emit("ray_pids", [[p, start_time(p)] for p in everyone])
    groups = {
        "driver": [me],
        "actors": actors,
        "ray-daemons": [p for p in everyone if p not in actors],
    }

    def compile_(first: str) -> Any:
        with InputNode() as inp:
            dag = b.fwd.bind(getattr(a, first).bind(inp))
        return dag.experimental_compile(_max_inflight_executions=IN_FLIGHT)

    def payload(tag: str, n: int, lat_n: int, tput_n: int, idle: bool) -> bool:
        x = np.arange(n, dtype=np.float32)
        t0 = time.perf_counter()
        cdag = compile_("fwd")
        emit(f"setup_{tag}", time.perf_counter() - t0)
        for _ in range(plan.warmup // (1 if n == SMALL else 10)):
            ray.get(cdag.execute(x))
        # Ray hands back a zero-copy view of its channel buffer, which stays locked while
        # the view lives (holding it deadlocks the next read): copy what is kept.
        y = np.array(ray.get(cdag.execute(x)))
        np.testing.assert_array_equal(y, x + 2)
        samples = []
        for _ in range(lat_n):
            t = time.perf_counter()
            ray.get(cdag.execute(x))
            samples.append(time.perf_counter() - t)
        emit_latency(tag, samples)

        window: collections.deque[Any] = collections.deque()
        t = time.perf_counter()
        for _ in range(tput_n):
            if len(window) >= IN_FLIGHT:
                ray.get(window.popleft())
            window.append(cdag.execute(x))
        while window:
            ray.get(window.popleft())
        emit(f"tput_{tag}", tput_n / (time.perf_counter() - t))

        if idle:
            cw = CpuWindow(groups)
            time.sleep(plan.idle_s)
            emit_cpu("idle_cpu", cw.stop()[1])

        refs = [cdag.execute(x) for _ in range(IN_FLIGHT)]  # outstanding at teardown
        took = guarded(cdag.teardown)
        emit(f"teardown_{tag}", took)
        if isinstance(took, str):
            return False
        del refs
        return True

    ok = payload("small", SMALL, plan.lat_small, plan.tput_small, idle=True)
    if ok:
        cdag = compile_("slow")
        ray.get(cdag.execute(np.zeros(SMALL, np.float32)))
        cw = CpuWindow(groups)
        ray.get(cdag.execute(np.ones(SMALL, np.float32)))
        wall, pct = cw.stop()
        emit_cpu("busy_cpu", pct)
        emit("busy_wall", wall)
        took = guarded(cdag.teardown)
        ok = not isinstance(took, str)
    if ok:
        ok = payload("big", BIG, plan.lat_big, plan.tput_big, idle=False)
    everyone = descendants(me)  # again, for the parent's clean-up should shutdown hang
    emit("ray_pids", [[p, start_time(p)] for p in everyone])
    emit("shutdown_s", guarded(ray.shutdown))


def ring_floor(items: int, warmup: int = 100) -> list[float]:
    """The floor of a 16-float item's 3 wake-ups, measured bare: a trio task writes an
    eventfd, a plain process wakes (blocking read) and writes the next, a second one
    writes back, and the task wakes from ``wait_readable``. Seconds per round trip."""
    import trio

    fds = [os.eventfd(0, os.EFD_CLOEXEC) for _ in range(3)]
    pids = []
    for i in (1, 2):
        pid = os.fork()
        if pid == 0:  # a plain process: no trio, nothing but the two syscalls
            try:
                for _ in range(warmup + items):
                    os.eventfd_read(fds[i])
                    os.eventfd_write(fds[(i + 1) % 3], 1)
            finally:
                os._exit(0)
        pids.append(pid)

    async def coordinator() -> list[float]:
        samples = []
        for j in range(warmup + items):
            t = time.perf_counter()
            os.eventfd_write(fds[1], 1)
            await trio.lowlevel.wait_readable(fds[0])
            os.eventfd_read(fds[0])
            if j >= warmup:
                samples.append(time.perf_counter() - t)
        return samples

    try:
        return trio.run(coordinator)
    finally:
        for pid in pids:
            os.waitpid(pid, 0)
        for fd in fds:
            os.close(fd)


def child_main(side: str, plan: Plan) -> None:
    if side == "hcqa":
        import trio

        emit("ring_p50", percentile(ring_floor(plan.lat_small), 50) * 1e6)
        trio.run(_hcqa_round, plan)
    else:
        _ray_round(plan)
    sys.stdout.flush()
    os._exit(0)  # a hung Ray thread must not hold the process at exit


# -- the parent side: rounds, medians, the table --------------------------------------------


def _kill_leftovers(results: dict[str, Value | list[Any]]) -> None:
    """Kill processes a Ray child started that outlived it (pid and start time must match),
    then remove the named semaphores its processes left in /dev/shm (``sem.hdr<pid>-*``,
    ``sem.obj<pid>-*``: Ray's shared-memory channels leave them behind after shutdown)."""
    pairs = results.get("ray_pids")
    if not isinstance(pairs, list):
        return
    for pid, started in pairs:
        if start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    shm = Path("/dev/shm")
    for pid, _ in pairs:
        if _stat(pid) is None:
            for kind in ("hdr", "obj"):
                for leftover in shm.glob(f"sem.{kind}{pid}-*"):
                    leftover.unlink(missing_ok=True)


def run_child(side: str, plan: Plan) -> dict[str, Any]:
    """One round of ``side`` in a child process (its own session); what it reported."""
    cmd = [sys.executable, "-m", "bench.bench_workers", "--child", side, "--plan", plan.name]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=plan.child_timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        err += f"\n[bench] {side} round timed out after {plan.child_timeout_s:.0f} s".encode()
    results: dict[str, Any] = {}
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("{"):
            results.update(json.loads(line))
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its session is left
    except ProcessLookupError:
        pass
    _kill_leftovers(results)
    if proc.returncode != 0 or "teardown_big" not in results:
        tail = err.decode(errors="replace").strip().splitlines()[-15:]
        results["error"] = f"rc={proc.returncode}: " + " / ".join(tail)
    return results


async def _hops(items: int) -> None:
    """Where an item's time goes in hcqa: the stages stamp their kernels' start and end
    (``bench._stages:stamp0/1``, float64 payloads), the coordinator stamps submit/return."""
    from hcqa.processes import open_process_pipeline

    names = ["submit -> stage 0 starts", "stage 0 runs", "stage 0 ends -> stage 1 starts"]
    names += ["stage 1 runs", "stage 1 ends -> caller resumes", "total"]
    rows: list[list[str]] = []
    for tag, n, count in (("16 float64", SMALL, items), ("4 MiB", (4 << 20) // 8, items // 10)):
        stages = ["bench._stages:stamp0", "bench._stages:stamp1"]
        async with open_process_pipeline(
            stages, in_shape=(n,), dtype="float64", depth=IN_FLIGHT, path=[str(ROOT)]
        ) as pipe:
            x = np.zeros(n)
            for _ in range(20):
                await pipe(x)
            marks = []
            for _ in range(count):
                t0 = time.monotonic_ns()
                y = await pipe(x)
                marks.append([t0, *y[:4], time.monotonic_ns()])
        d = np.diff(np.array(marks, dtype=np.float64), axis=1) / 1e3
        spans = [*d.T, d.sum(axis=1)]
        for name, span in zip(names, spans, strict=True):
            p50, p99 = np.percentile(span, [50, 99])
            rows.append([tag, name, f"{p50:,.0f} µs", f"{p99:,.0f} µs"])
    print(markdown_table(["payload", "span", "p50", "p99"], rows))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 round per side, fewer items")
    parser.add_argument("--no-ray", action="store_true", help="hcqa only")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per side")
    parser.add_argument(
        "--hops", action="store_true", help="hcqa only: where an item's time goes, per hop"
    )
    parser.add_argument("--child", choices=("hcqa", "ray"), help=argparse.SUPPRESS)
    parser.add_argument("--plan", choices=tuple(PLANS), default="full", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, PLANS[args.plan])
        return 0

    if args.hops:
        import trio

        trio.run(_hops, 300 if args.quick else 2000)
        return 0
    plan = QUICK if args.quick else FULL
    rounds = args.rounds or plan.rounds
    with_ray = not args.no_ray and importlib.util.find_spec("ray") is not None
    ray_note = "" if with_ray or args.no_ray else " (ray not importable: Ray side skipped)"
    print(
        f"# bench_workers{' --quick' if args.quick else ''}: 2 stages (out = inp + 1) in 2 worker "
        f"processes, {rounds} round(s) per side, interleaved; {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}{ray_note}\n"
    )
    started = time.perf_counter()
    hc: list[dict[str, Any]] = []
    ry: list[dict[str, Any]] = []
    for r in range(rounds):
        order = ["hcqa", "ray"] if r % 2 == 0 else ["ray", "hcqa"]
        for side in order:
            if side == "ray" and not with_ray:
                continue
            res = run_child(side, plan)
            (hc if side == "hcqa" else ry).append(res)
            if "error" in res:
                print(f"[round {r + 1}, {side}] {res['error']}", file=sys.stderr)
    ok = report(hc, ry, with_ray)
    print()
    print(_per_round("hcqa rounds", hc))
    if ry:
        print(_per_round("Ray rounds", ry))
    print(f"\n(ran in {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f})")
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
