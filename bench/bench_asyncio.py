"""asyncio hosts: hcqa awaited from asyncio vs trio natively vs ``asyncio.to_thread``.

Run from the repository root::

    python -m bench.bench_asyncio           # full run (about a minute)
    python -m bench.bench_asyncio --quick   # short run (fewer samples, smaller server load)

Part 1, latency (p50 and p99 of one call, in one process, rounds interleaved with the
order flipped every round so the host's load hits every side alike):

* **launch+await**: ``await prog(out, a)`` of a tiny numpy kernel (``out = a + 1`` over 64
  float32) -- from an asyncio task (hcqa hosted in a trio guest run), from a trio task
  (native), and the asyncio user's usual route, ``await asyncio.to_thread(kernel, out, a)``;
* **2-stage Pipeline**: ``await pipe(x)`` (``+1`` on cpu:0, ``*2`` on cpu:1, 16x16 float32)
  from asyncio and from trio, against ``await asyncio.to_thread(both_stages, x)``.

Targets: asyncio-hosted p50 <= 1.3x trio-native and <= 1.0x ``asyncio.to_thread``.

Part 2, serving (each server in its own process, one BLAS thread per process, the same
loopback load generator -- ``examples/loadtest.py``'s, trio + h11 -- in this process):
``examples/fastapi_app.py`` on uvicorn against ``hcqa serve`` (its own HTTP/1.1 server on
trio) and ``hcqa serve --http hypercorn`` (the same app under hypercorn's trio worker), all
without an access log, serving the demo 2-stage MLP (``float32[32, 256]``), 50 concurrent
keep-alive clients posting raw inputs, while a prober GETs ``/health`` every 10 ms. Four
rounds (two with ``--quick``), the order flipped every round; throughput is summed over the
rounds.
Targets: ``hcqa serve``'s throughput >= 1.0x FastAPI's (serving is no slower than the fastest
host hcqa runs under), and FastAPI's >= 0.8x ``hcqa serve``'s (hosting on asyncio costs little).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import trio

import hcqa
from bench._util import markdown_table, percentile, print_footer

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (16, 16)


def kernel(out: np.ndarray, a: np.ndarray) -> None:
    np.add(a, 1, out=out)


def double(out: np.ndarray, a: np.ndarray) -> None:
    np.multiply(a, 2, out=out)


def both_stages(x: np.ndarray) -> np.ndarray:
    y = np.empty_like(x)
    kernel(y, x)
    z = np.empty_like(x)
    double(z, y)
    return z


Timings = dict[str, list[float]]


async def _timed(into: list[float], n: int, call: Callable[[], Awaitable[Any]]) -> None:
    for _ in range(5):  # warm
        await call()
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        into.append(time.perf_counter() - t0)


async def _hcqa_round(prefix: str, n: int, out: Timings) -> None:
    """The same code under either library: hcqa picks the host by itself."""
    a = np.arange(64, dtype=np.float32)
    x = np.ones(SHAPE, np.float32)
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        src, dst = d0.alloc(shape=(64,), dtype="float32"), d0.alloc(shape=(64,), dtype="float32")
        await src.copyin(a)
        prog = d0.program("tiny", kernel)
        pipe = hcqa.Pipeline([(d0, kernel), (d1, double)], in_shape=SHAPE, depth=2)
        await _timed(out.setdefault(f"{prefix} launch", []), n, lambda: prog(dst, src).wait())
        await _timed(out.setdefault(f"{prefix} pipeline", []), n, lambda: pipe(x))


async def _to_thread_round(n: int, out: Timings) -> None:
    a = np.arange(64, dtype=np.float32)
    dst = np.empty_like(a)
    x = np.ones(SHAPE, np.float32)
    await _timed(
        out.setdefault("to_thread launch", []), n, lambda: asyncio.to_thread(kernel, dst, a)
    )
    await _timed(
        out.setdefault("to_thread pipeline", []), n, lambda: asyncio.to_thread(both_stages, x)
    )


def latency(rounds: int, n: int) -> Timings:
    out: Timings = {}
    sides: list[Callable[[], None]] = [
        lambda: asyncio.run(_hcqa_round("asyncio", n, out)),
        lambda: trio.run(_hcqa_round, "trio", n, out),
        lambda: asyncio.run(_to_thread_round(n, out)),
    ]
    for r in range(rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            side()
    return out


# -- serving ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)  # a start-up poll in a benchmark, bounded by ``limit``
    raise TimeoutError(f"nothing listened on port {port} within {limit} s")


def _server(kind: str, port: int) -> subprocess.Popen[bytes]:
    if kind.startswith("hcqa serve"):
        argv = [str(Path(sys.executable).parent / "hcqa"), "serve", "--port", str(port)]
        argv += ["--access-log", "none"]
        if kind == "hcqa serve --http hypercorn":
            argv += ["--http", "hypercorn"]
    else:
        argv = [sys.executable, str(ROOT / "examples" / "fastapi_app.py"), "--port", str(port)]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    quiet = subprocess.DEVNULL
    return subprocess.Popen(argv, env=env, stdout=quiet, stderr=quiet, cwd=ROOT)


def _loadtest() -> Any:
    path = ROOT / "examples" / "loadtest.py"
    spec = importlib.util.spec_from_file_location("hcqa_example_loadtest", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serving(rounds: int, clients: int, per_client: int) -> dict[str, list[Any]]:
    lt = _loadtest()
    x = np.random.default_rng(1).standard_normal((32, 256)).astype("<f4")
    reports: dict[str, list[Any]] = {
        "hcqa serve": [],
        "fastapi": [],
        "hcqa serve --http hypercorn": [],
    }
    kinds = list(reports)
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            port = _free_port()
            proc = _server(kind, port)
            try:
                _wait_listening(port, proc)
                report = trio.run(
                    lambda port=port: lt.load_test(
                        "127.0.0.1",
                        port,
                        clients=clients,
                        requests_per_client=per_client,
                        payload=x.tobytes(),
                        idle_probes=20,
                    )
                )
                reports[kind].append(report)
            finally:
                proc.terminate()
                proc.wait(30)
    return reports


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--no-serving", action="store_true", help="skip part 2")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    n, rounds = (200, 2) if args.quick else (1000, 4)
    lat = latency(rounds, n)
    rows = []
    verdict = []
    for what in ("launch", "pipeline"):
        p50 = {
            side: percentile(lat[f"{side} {what}"], 50) for side in ("asyncio", "trio", "to_thread")
        }
        p99 = {
            side: percentile(lat[f"{side} {what}"], 99) for side in ("asyncio", "trio", "to_thread")
        }
        for side in ("asyncio", "trio", "to_thread"):
            rows.append(
                [
                    "launch+await" if what == "launch" else "2-stage Pipeline",
                    {
                        "asyncio": "hcqa from asyncio",
                        "trio": "hcqa from trio",
                        "to_thread": "asyncio.to_thread",
                    }[side],
                    f"{p50[side] * 1e6:.0f}",
                    f"{p99[side] * 1e6:.0f}",
                    f"{p50[side] / p50['trio']:.2f}x",
                    f"{p50[side] / p50['to_thread']:.2f}x",
                ]
            )
        r_trio, r_thread = p50["asyncio"] / p50["trio"], p50["asyncio"] / p50["to_thread"]
        ok = "met" if r_trio <= 1.3 and r_thread <= 1.0 else "MISSED"
        verdict.append(
            f"{what}: asyncio-hosted p50 = {r_trio:.2f}x trio-native (target <= 1.3), "
            f"{r_thread:.2f}x asyncio.to_thread (target <= 1.0): {ok}"
        )
    print(f"## latency ({rounds} rounds x {n} calls per side, interleaved)\n")
    print(markdown_table(["call", "side", "p50 us", "p99 us", "vs trio", "vs to_thread"], rows))
    if not args.no_serving:
        clients, per = (50, 4) if args.quick else (50, 20)
        reports = serving(2 if args.quick else 4, clients, per)
        srows = []
        tput = {}
        for kind, reps in reports.items():
            tput[kind] = sum(r.requests for r in reps) / sum(r.seconds for r in reps)
            srows.append(
                [
                    {
                        "fastapi": "FastAPI + uvicorn (asyncio)",
                        "hcqa serve": "hcqa serve (trio, its HTTP server)",
                    }.get(kind, "hcqa serve --http hypercorn (trio)"),
                    f"{tput[kind]:.0f}",
                    " / ".join(f"{r.throughput:.0f}" for r in reps),
                    " / ".join(f"{r.p50_ms:.0f}" for r in reps),
                    " / ".join(f"{r.p99_ms:.0f}" for r in reps),
                    " / ".join(f"{r.health_p50_ms:.1f}" for r in reps),
                    sum(r.errors for r in reps),
                ]
            )
        n_rounds = len(reports["fastapi"])
        print(f"\n## serving the demo MLP, {clients} clients x {per} requests, {n_rounds} rounds\n")
        print(
            markdown_table(
                [
                    "server",
                    "req/s (all rounds)",
                    "req/s per round",
                    "p50 ms",
                    "p99 ms",
                    "/health p50 ms under load",
                    "errors",
                ],
                srows,
            )
        )
        own = tput["hcqa serve"] / tput["fastapi"]
        verdict.append(
            f"serving: hcqa serve = {own:.2f}x FastAPI's throughput (target >= 1.0): "
            f"{'met' if own >= 1.0 else 'MISSED'} (hypercorn host: "
            f"{tput['hcqa serve --http hypercorn'] / tput['fastapi']:.2f}x)"
        )
        ratio = tput["fastapi"] / tput["hcqa serve"]
        ok = "met" if ratio >= 0.8 else "MISSED"
        verdict.append(
            f"serving: FastAPI = {ratio:.2f}x hcqa serve's throughput (target >= 0.8): {ok}"
        )
    print_footer(None, verdict, started)


if __name__ == "__main__":
    main()
