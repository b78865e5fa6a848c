"""Serving single samples: hcqa serve with dynamic batching, without it, Ray Serve.

Run from the repository root::

    python -m bench.bench_serve           # full run (a few minutes with Ray Serve)
    python -m bench.bench_serve --quick   # short run: indicative only
    python -m bench.bench_serve --no-ray  # the two hcqa servers only
    python -m bench.bench_serve --sleep-ms 0   # CPU kernels only (see below)

The same model is served three ways on loopback, each server in its own process with one BLAS
thread: the demo MLP of ``hcqa serve`` (``relu(x @ w1) @ w2``, float32, width 256, the same
seed-0 weights), each layer's kernel also holding its device for ``--sleep-ms`` (default 10 ms)
without using the host CPU -- an accelerator's kernel as the host sees it: its time hardly
depends on the batch size, so batching pays, and it leaves the host's CPU to the serving --
as

* **hcqa batched**: ``hcqa serve --max-batch 32 --max-wait 0.002`` (single samples gathered by
  ``hcqa.open_batcher`` into batches of up to 32 rows);
* **hcqa unbatched**: ``hcqa serve --max-batch 1`` (every request its own pipeline batch of 1);
* **Ray Serve**: one replica whose ``@serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)``
  method runs the same two layers (matmul and sleep, in ``asyncio.to_thread`` so the replica's
  event loop stays free, with up to 2 batches at once like hcqa's pipeline depth) on the
  stacked samples (``bench/_ray_serve_app.py``).

With ``--sleep-ms 0`` the kernels are a few microseconds of matmul and every request's cost
is the HTTP server's and the client's Python: batching then saves only the per-batch dispatch.

Closed-loop clients (a minimal raw HTTP/1.1 keep-alive client in this process, ~0.1 ms of CPU
per request where httpx takes ~1 ms: the clients share the 2 cores with the servers) each POST
one raw float32[256] sample, wait for its answer, and send the next, at 1, 16 and 64
concurrency, after a warm-up. Every answer is checked against numpy. Reported: throughput,
latency p50 / p99, and the server's CPU time per request (its process tree's user + system
time over the run, from ``/proc``: for Ray, every process of its session -- GCS, raylet,
proxy, replica).

Targets (at 64 clients): batched >= 4x unbatched throughput, >= 3x Ray Serve's, p99 <= 0.5x Ray
Serve's; at 1 client, batched p50 <= 1.2x unbatched (batching must not tax a lone client).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

from bench._util import markdown_table, percentile, print_footer

ROOT = Path(__file__).resolve().parents[1]
WIDTH, MAX_BATCH, MAX_WAIT = 256, 32, 0.002
CONCURRENCY = (1, 16, 64)
RAW = "application/octet-stream"
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def reference(x: np.ndarray) -> np.ndarray:
    """The served model in numpy (the weights of ``hcqa.serve.mlp_pipeline``, seed 0)."""
    rng = np.random.default_rng(0)
    scale = np.float32(1 / np.sqrt(WIDTH))
    w1, w2 = (rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * scale for _ in range(2))
    return np.asarray(np.maximum(x @ w1, 0) @ w2)


# -- CPU accounting ----------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> list[int]:
    """``root`` and every live descendant process (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _started(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def cpu_seconds(root: int) -> float:
    """User + system CPU of ``root``'s process tree (live processes and reaped children)."""
    total = 0
    for pid in _tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / _TICK


# -- servers ---------------------------------------------------------------------------------


class Server:
    """A server process on a free loopback port."""

    def __init__(
        self, name: str, argv: list[str], *, ready: str, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**ENV, **(env or {})},
            cwd=ROOT,
        )
        self.port = 0
        deadline = time.monotonic() + 180
        seen = []
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(ready, line)
            if m:
                self.port = int(m.group(1))
                break
        if not self.port:
            self.stop()
            raise RuntimeError(f"{name} did not start: {''.join(seen[-5:])}")
        # drain its output from now on so it never blocks on a full pipe
        import threading

        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        tree = [(pid, _started(pid)) for pid in _tree(self.proc.pid)[1:]]  # Ray's GCS, raylet...
        if self.proc.poll() is None:
            self.proc.terminate()  # hcqa drains; Ray's driver shuts its session down
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid, started in tree:  # whatever of its own processes outlived it (same pid and
            if started is not None and _started(pid) == started:  # start time: not a reused pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


def hcqa_server(batched: bool, sleep_ms: float) -> Server:
    argv = [sys.executable, "-m", "hcqa.cli", "serve", "--port", "0", "--width", str(WIDTH)]
    argv += ["--sleep-ms", str(sleep_ms)]
    argv += ["--access-log", "none", "--max-pending", "1024"]
    argv += ["--max-batch", str(MAX_BATCH) if batched else "1", "--max-wait", str(MAX_WAIT)]
    name = "hcqa batched" if batched else "hcqa unbatched"
    return Server(name, argv, ready=r"http://127\.0\.0\.1:(\d+)")


def ray_server(sleep_ms: float) -> Server:
    argv = [sys.executable, str(ROOT / "bench" / "_ray_serve_app.py"), "--sleep-ms", str(sleep_ms)]
    argv += ["--width", str(WIDTH), "--max-batch", str(MAX_BATCH), "--max-wait", str(MAX_WAIT)]
    return Server("Ray Serve", argv, ready=r"RAY SERVE READY (\d+)")


# -- load ------------------------------------------------------------------------------------


class RawClient:
    """A minimal keep-alive HTTP/1.1 client over a trio socket: POSTs raw bytes, reads the
    answer (Content-Length or chunked). The bench's clients and the servers share 2 cores, so
    the load generator must cost little: httpx takes ~1 ms of CPU per request, this ~0.1 ms."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stream: trio.SocketStream | None = None
        self.buf = b""

    async def _more(self) -> None:
        assert self.stream is not None
        data = await self.stream.receive_some(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.stream is None:
            self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            self.buf = b""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {RAW}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        await self.stream.send_all(head.encode() + body)
        while b"\r\n\r\n" not in self.buf:
            await self._more()
        raw_head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        pairs = (line.partition(":") for line in lines[1:])
        headers = {k.strip().lower(): v.strip() for k, _, v in pairs}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            out = b""
            while True:
                while b"\r\n" not in self.buf:
                    await self._more()
                size_line, _, self.buf = self.buf.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                while len(self.buf) < size + 2:
                    await self._more()
                out, self.buf = out + self.buf[:size], self.buf[size + 2 :]
                if size == 0:
                    break
        else:
            length = int(headers.get("content-length", "0"))
            while len(self.buf) < length:
                await self._more()
            out, self.buf = self.buf[:length], self.buf[length:]
        if headers.get("connection", "").lower() == "close":
            await self.aclose()
        return status, out

    async def aclose(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            await stream.aclose()


async def closed_loop(
    port: int, path: str, clients: int, seconds: float, warmup: float
) -> tuple[list[float], int, float]:
    """``clients`` closed-loop clients for ``warmup`` + ``seconds``; returns the latencies
    of the measured window, the errors, and the window's length."""
    rng = np.random.default_rng(clients)
    xs = rng.standard_normal((64, WIDTH)).astype(np.float32)
    bodies = [x.astype("<f4").tobytes() for x in xs]
    latencies, errors = await run_clients(
        port, path, bodies, reference(xs), clients=clients, seconds=seconds, warmup=warmup
    )
    return latencies, errors, seconds


async def run_clients(
    port: int,
    path: str,
    bodies: list[bytes],
    want: np.ndarray,
    *,
    clients: int,
    seconds: float,
    warmup: float,
) -> tuple[list[float], int]:
    """``clients`` closed-loop clients posting ``bodies`` in turn to ``path`` for ``warmup``
    + ``seconds``, each answer checked against ``want`` (float32 rows); returns the latencies
    of the measured window and the errors (a wrong answer counts as one)."""
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter() + warmup
    stop = start + seconds

    async def client(k: int) -> None:
        nonlocal errors
        c = RawClient(port)
        try:
            i = k
            while (t0 := time.perf_counter()) < stop:
                j = i % len(bodies)
                status, body = await c.post(path, bodies[j])
                t1 = time.perf_counter()
                ok = status == 200 and np.allclose(
                    np.frombuffer(body, "<f4"), want[j], rtol=1e-4, atol=1e-5
                )
                if t0 >= start:
                    if ok:
                        latencies.append(t1 - t0)
                    else:
                        errors += 1
                i += 1
        finally:
            await c.aclose()

    async with trio.open_nursery() as nursery:
        for k in range(clients):
            nursery.start_soon(client, k)
    return latencies, errors


async def measure(server: Server, path: str, seconds: float, warmup: float) -> list[dict[str, Any]]:
    rows = []
    for clients in CONCURRENCY:
        cpu0 = server.cpu()
        t0 = time.perf_counter()
        lat, errors, window = await closed_loop(server.port, path, clients, seconds, warmup)
        wall = time.perf_counter() - t0
        cpu = server.cpu() - cpu0
        n = len(lat)
        # CPU over the whole run (warm-up included) per request of the whole run: estimate the
        # warm-up's requests at the window's rate
        total = n * wall / window if window else n
        rows.append(
            {
                "server": server.name,
                "clients": clients,
                "req/s": n / window,
                "p50": percentile(lat, 50) * 1e3,
                "p99": percentile(lat, 99) * 1e3,
                "cpu_ms": cpu / total * 1e3 if total else float("nan"),
                "errors": errors,
            }
        )
        print(
            f"  {server.name}, {clients} clients: {n / window:.0f} req/s, "
            f"p50 {rows[-1]['p50']:.2f} ms, p99 {rows[-1]['p99']:.2f} ms, "
            f"{rows[-1]['cpu_ms']:.2f} ms CPU/request, {errors} errors",
            flush=True,
        )
    return rows


async def main(quick: bool, with_ray: bool, sleep_ms: float) -> None:
    started = time.perf_counter()
    seconds, warmup = (1.0, 0.3) if quick else (5.0, 1.0)
    print(
        f"# Serving single samples: float32[{WIDTH}] MLP, kernels + {sleep_ms:g} ms sleep per "
        "layer, closed-loop clients on loopback"
    )
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start\n")
    rows: list[dict[str, Any]] = []
    missing: str | None = None
    for batched in (True, False):
        server = hcqa_server(batched, sleep_ms)
        try:
            rows += await measure(server, "/infer", seconds, warmup)
        finally:
            server.stop()
    if with_ray:
        if importlib.util.find_spec("ray") is None:
            missing = "Ray Serve: not installed (pip install -e '.[bench]'): its targets skipped"
        else:
            try:
                server = ray_server(sleep_ms)
            except RuntimeError as exc:
                missing = f"Ray Serve: could not start ({exc}): its targets skipped"
            else:
                try:
                    rows += await measure(server, "/infer", seconds, warmup)
                finally:
                    server.stop()
    else:
        missing = "Ray Serve: not run (--no-ray): its targets skipped"
    print()
    print(
        markdown_table(
            ["server", "clients", "req/s", "p50 ms", "p99 ms", "CPU ms/request", "errors"],
            [
                [
                    r["server"],
                    r["clients"],
                    f"{r['req/s']:.0f}",
                    f"{r['p50']:.2f}",
                    f"{r['p99']:.2f}",
                    f"{r['cpu_ms']:.2f}",
                    r["errors"],
                ]
                for r in rows
            ],
        )
    )
    by = {(r["server"], r["clients"]): r for r in rows}
    lines = ["", "Targets:"]
    b64, u64 = by[("hcqa batched", 64)], by[("hcqa unbatched", 64)]
    ratio = b64["req/s"] / u64["req/s"]
    lines.append(
        f"- 64 clients: batched = {ratio:.2f}x unbatched throughput (target >= 4): "
        f"{'met' if ratio >= 4 else 'MISSED'}"
    )
    b1, u1 = by[("hcqa batched", 1)], by[("hcqa unbatched", 1)]
    r1 = b1["p50"] / u1["p50"]
    lines.append(
        f"- 1 client: batched p50 = {r1:.2f}x unbatched (target <= 1.2): "
        f"{'met' if r1 <= 1.2 else 'MISSED'}"
    )
    if ("Ray Serve", 64) in by:
        ray64 = by[("Ray Serve", 64)]
        rt = b64["req/s"] / ray64["req/s"]
        rp = b64["p99"] / ray64["p99"]
        lines.append(
            f"- 64 clients: batched = {rt:.2f}x Ray Serve's throughput (target >= 3): "
            f"{'met' if rt >= 3 else 'MISSED'}"
        )
        lines.append(
            f"- 64 clients: batched p99 = {rp:.2f}x Ray Serve's (target <= 0.5): "
            f"{'met' if rp <= 0.5 else 'MISSED'}"
        )
    errors = sum(r["errors"] for r in rows)
    lines.append(f"- every answer checked against numpy: {errors} wrong or failed")
    print_footer(missing, lines, started)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run (indicative only)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray Serve peer")
    parser.add_argument(
        "--sleep-ms", type=float, default=10.0, help="each layer's kernel also sleeps (default 10)"
    )
    args = parser.parse_args()
    trio.run(main, args.quick, not args.no_ray, args.sleep_ms)
