"""cuda:0 against raw cuda-bindings calls, in one process, on one GPU (tools/gpu_check.sh runs it).

Launch: ``await k(y)`` of an empty kernel (hcqa: host function completion, eventfd, trio)
against ``cuLaunchKernel`` + ``cuStreamSynchronize`` (spins) and against ``cuLaunchKernel`` +
``cuEventSynchronize`` of a blocking-sync event (sleeps) on a stream of its own; and 1000
launches in one queue submit against 1000 raw launches + one synchronize. Copies: hcqa's
copyin / copyout of pageable numpy arrays (pinned staging in stream order) against the
synchronous ``cuMemcpyHtoD`` / ``cuMemcpyDtoH`` of the same arrays, and against pinned memory
(``cuMemHostAlloc`` + async copy + synchronize: the ceiling). Rounds interleave the two sides;
each figure is the median of per-round ratios. Prints a JSON document (``--json PATH`` too).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import sys
import time
from typing import Any

import numpy as np
import trio

import hcqa
from hcqa.devices.cuda import driver as drv

EMPTY = 'extern "C" __global__ void empty(int *y) { }'


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


async def bench(rounds: int, n_await: int, sizes: list[int]) -> dict[str, Any]:
    driver, _ = drv.bindings()
    out: dict[str, Any] = {"rounds": rounds}
    async with hcqa.open_device("cuda:0") as g:
        y = g.alloc(shape=(4,), dtype="int32")
        k = g.program("empty", EMPTY)
        drv.current(g.cu_context)  # type: ignore[attr-defined]
        stream = drv.check("cuStreamCreate", driver.cuStreamCreate(1))
        blocking = drv.check(
            "cuEventCreate",
            driver.cuEventCreate(
                int(driver.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
                | int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            ),
        )
        value = ctypes.c_uint64(y.va_addr)
        params = (ctypes.c_void_p * 1)(ctypes.addressof(value))
        addr = ctypes.addressof(params)
        f = k.cu_function  # type: ignore[attr-defined]

        def raw_spin() -> None:
            driver.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, addr, 0)
            driver.cuStreamSynchronize(stream)

        def raw_sleep() -> None:
            driver.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, addr, 0)
            driver.cuEventRecord(blocking, stream)
            driver.cuEventSynchronize(blocking)

        for _ in range(200):  # warm both sides
            await k(y)
            raw_spin()
        rows: dict[str, list[float]] = {
            "hcqa_us": [], "spin_us": [], "sleep_us": [], "hcqa_cpu_us": [],
            "batch_hcqa_us": [], "batch_raw_us": [],
        }  # fmt: skip
        q = g.compute_queue()
        for _ in range(1000):
            q.exec(k, (y,))
        await q.submit()
        for _ in range(rounds):
            c0, t0 = _cpu(), time.perf_counter()
            for _ in range(n_await):
                await k(y)
            t1, c1 = time.perf_counter(), _cpu()
            rows["hcqa_us"].append((t1 - t0) / n_await * 1e6)
            rows["hcqa_cpu_us"].append((c1 - c0) / n_await * 1e6)
            t0 = time.perf_counter()
            for _ in range(n_await):
                raw_spin()
            rows["spin_us"].append((time.perf_counter() - t0) / n_await * 1e6)
            t0 = time.perf_counter()
            for _ in range(n_await):
                raw_sleep()
            rows["sleep_us"].append((time.perf_counter() - t0) / n_await * 1e6)
            t0 = time.perf_counter()
            await q.submit()
            rows["batch_hcqa_us"].append((time.perf_counter() - t0) / 1000 * 1e6)
            t0 = time.perf_counter()
            for _ in range(1000):
                driver.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, addr, 0)
            driver.cuStreamSynchronize(stream)
            rows["batch_raw_us"].append((time.perf_counter() - t0) / 1000 * 1e6)
            await trio.lowlevel.checkpoint()
        launch = {key: _med(v) for key, v in rows.items()}
        launch["hcqa_over_spin"] = _med(
            [a / b for a, b in zip(rows["hcqa_us"], rows["spin_us"], strict=True)]
        )
        launch["hcqa_over_sleep"] = _med(
            [a / b for a, b in zip(rows["hcqa_us"], rows["sleep_us"], strict=True)]
        )
        launch["batch_hcqa_over_raw"] = _med(
            [a / b for a, b in zip(rows["batch_hcqa_us"], rows["batch_raw_us"], strict=True)]
        )
        out["launch"] = launch
        copies = []
        for size in sizes:
            host = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
            back = np.empty_like(host)
            buf = g.alloc(size)
            pinned = int(drv.check("cuMemHostAlloc", driver.cuMemHostAlloc(size, 0)))
            reps = max(3, min(50, (256 << 20) // size))
            r: dict[str, list[float]] = {
                "hcqa_in": [], "hcqa_out": [], "raw_in": [], "raw_out": [],
                "pinned_in": [], "pinned_out": [],
            }  # fmt: skip
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(reps):
                    await buf.copyin(host)
                r["hcqa_in"].append(size * reps / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                for _ in range(reps):
                    await buf.copyout(back)
                r["hcqa_out"].append(size * reps / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                for _ in range(reps):
                    driver.cuMemcpyHtoD(buf.va_addr, host.ctypes.data, size)
                r["raw_in"].append(size * reps / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                for _ in range(reps):
                    driver.cuMemcpyDtoH(back.ctypes.data, buf.va_addr, size)
                r["raw_out"].append(size * reps / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                for _ in range(reps):
                    driver.cuMemcpyHtoDAsync(buf.va_addr, pinned, size, stream)
                driver.cuStreamSynchronize(stream)
                r["pinned_in"].append(size * reps / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                for _ in range(reps):
                    driver.cuMemcpyDtoHAsync(pinned, buf.va_addr, size, stream)
                driver.cuStreamSynchronize(stream)
                r["pinned_out"].append(size * reps / (time.perf_counter() - t0) / 1e9)
                await trio.lowlevel.checkpoint()
            back[:] = 0
            await buf.copyin(host)  # (the pinned rounds left the pinned buffer's bytes there)
            await buf.copyout(back)
            row: dict[str, Any] = {"bytes": size, "correct": bool((back == host).all())}
            row.update({f"{key}_GBps": round(_med(v), 2) for key, v in r.items()})
            for d in ("in", "out"):
                row[f"{d}_hcqa_over_raw"] = round(
                    _med([a / b for a, b in zip(r[f"hcqa_{d}"], r[f"raw_{d}"], strict=True)]), 3
                )
            copies.append(row)
            driver.cuMemFreeHost(pinned)
        out["copies"] = copies
        driver.cuStreamDestroy(stream)
        driver.cuEventDestroy(blocking)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--awaits", type=int, default=300)
    p.add_argument("--sizes", default="4096,1048576,67108864")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    result = trio.run(bench, args.rounds, args.awaits, sizes)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
