"""A bounded loopback load test of an hcqa inference server.

Starts ``hcqa.serve.serve`` on a free loopback port with a two-layer MLP on ``cpu:0`` and
``cpu:1`` (each microbatch keeps each device busy for tens of milliseconds of matmul), then
runs N concurrent keep-alive clients that POST raw float32 inputs to ``/infer`` while a
prober GETs ``/health`` every 10 ms. It prints p50/p99 request latency, throughput and the
health probes' latency: the probes answer in about a millisecond while the kernels run,
because the kernels run in engine threads and every request just awaits a fence.

    python examples/loadtest.py --clients 16 --requests 50 --batch 128 --width 2048
    python examples/loadtest.py --sleep-ms 30     # kernels that leave the host CPU idle,
                                                  # as an accelerator's do
    python examples/loadtest.py --connect 8000    # load a running `hcqa serve`

The client is httpx (``pip install -e '.[loadtest]'``), HTTP/1.1 keep-alive, one connection
per client. Requests go only to loopback, bounded in count and time.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import ssl
import sys
import time
from functools import partial
from typing import Any

import attrs
import numpy as np
import trio

try:
    import httpx
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    from hcqa.serve import mlp_pipeline, serve
except ImportError as exc:  # say what to install, not a traceback
    sys.exit(f"loadtest.py needs {exc.name}: pip install -e '.[loadtest]' in the hcqa checkout")

import hcqa

RAW_TYPE = "application/octet-stream"


@attrs.frozen
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


_PLAIN_HTTP = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # never used: loopback http only


class Client:
    """A keep-alive HTTP/1.1 client (httpx) for one server; one request at a time.

    httpx reconnects by itself when the server ends a connection (hypercorn closes one
    after ``keep_alive_max_requests``).
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._http = httpx.AsyncClient(
            base_url=f"http://{host}:{port}",
            limits=httpx.Limits(max_connections=1),
            timeout=httpx.Timeout(60.0),
            verify=_PLAIN_HTTP,  # httpx's default TLS set-up costs ~40 ms of CPU per client
            trust_env=False,  # loopback only: no proxies from the environment
        )

    @classmethod
    async def connect(cls, host: str, port: int) -> Client:
        return cls(host, port)

    async def request(
        self, method: str, path: str, body: bytes = b"", content_type: str = "application/json"
    ) -> Response:
        headers = {"content-type": content_type} if method == "POST" else {}
        r = await self._http.request(method, path, content=body or None, headers=headers)
        return Response(r.status_code, dict(r.headers), r.content)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100; numpy's "inverted_cdf"); NaN when empty."""
    return float(np.percentile(values, q, method="inverted_cdf")) if values else math.nan


@attrs.frozen(kw_only=True)
class LoadReport:
    """What :func:`load_test` measured; latencies in milliseconds."""

    clients: int
    requests: int  # answered 200
    errors: int  # answered otherwise
    seconds: float
    throughput: float  # successful requests per second
    p50_ms: float
    p99_ms: float
    max_ms: float
    health_probes: int
    health_p50_ms: float
    health_p99_ms: float
    health_max_ms: float
    idle_health_p50_ms: float  # the same probe with no load, just before: the floor
    idle_health_p99_ms: float

    def __str__(self) -> str:
        return (
            f"{self.clients} clients: {self.requests} ok, {self.errors} errors in "
            f"{self.seconds:.2f} s = {self.throughput:.1f} req/s; latency p50 "
            f"{self.p50_ms:.1f} ms, p99 {self.p99_ms:.1f} ms, max {self.max_ms:.1f} ms\n"
            f"/health meanwhile: {self.health_probes} probes, p50 {self.health_p50_ms:.2f} ms,"
            f" p99 {self.health_p99_ms:.2f} ms, max {self.health_max_ms:.2f} ms (idle server: "
            f"p50 {self.idle_health_p50_ms:.2f} ms, p99 {self.idle_health_p99_ms:.2f} ms)"
        )


async def load_test(
    host: str,
    port: int,
    *,
    clients: int,
    requests_per_client: int,
    payload: bytes,
    content_type: str = RAW_TYPE,
    probe_interval: float = 0.01,
    idle_probes: int = 100,
    time_limit: float = 300.0,
) -> LoadReport:
    """``clients`` concurrent clients each POST ``payload`` to ``/infer``
    ``requests_per_client`` times, while a prober GETs ``/health`` every ``probe_interval``.

    First the prober alone sends ``idle_probes`` probes: the idle server's latency, the floor
    the latency under load compares with.

    Loopback only; at most 256 clients and 100 000 requests; ``trio.TooSlowError`` after
    ``time_limit`` seconds.
    """
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"load_test only targets loopback addresses (got {host!r})")
    if not (1 <= clients <= 256 and 1 <= requests_per_client <= 100_000 // clients):
        raise ValueError("load_test takes 1..256 clients and at most 100000 requests in all")
    latencies: list[float] = []
    probes: list[float] = []
    idle: list[float] = []
    errors = 0

    async def client() -> None:
        nonlocal errors
        async with await Client.connect(host, port) as c:
            for _ in range(requests_per_client):
                t0 = time.perf_counter()
                r = await c.request("POST", "/infer", payload, content_type)
                if r.status == 200:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

    async def prober(into: list[float], count: float) -> None:
        async with await Client.connect(host, port) as c:
            while len(into) < count:
                t0 = time.perf_counter()
                await c.request("GET", "/health")
                into.append(time.perf_counter() - t0)
                await trio.sleep(probe_interval)

    with trio.fail_after(time_limit):
        await prober(idle, idle_probes)
        async with trio.open_nursery() as outer:
            outer.start_soon(prober, probes, math.inf)
            start = time.perf_counter()
            async with trio.open_nursery() as inner:
                for _ in range(clients):
                    inner.start_soon(client)
            seconds = time.perf_counter() - start
            outer.cancel_scope.cancel()
    lat, hp, idle = sorted(latencies), sorted(probes), sorted(idle)
    return LoadReport(
        clients=clients,
        requests=len(lat),
        errors=errors,
        seconds=seconds,
        throughput=len(lat) / seconds,
        p50_ms=percentile(lat, 50) * 1e3,
        p99_ms=percentile(lat, 99) * 1e3,
        max_ms=percentile(lat, 100) * 1e3,
        health_probes=len(hp),
        health_p50_ms=percentile(hp, 50) * 1e3,
        health_p99_ms=percentile(hp, 99) * 1e3,
        health_max_ms=percentile(hp, 100) * 1e3,
        idle_health_p50_ms=percentile(idle, 50) * 1e3,
        idle_health_p99_ms=percentile(idle, 99) * 1e3,
    )


async def run_clients(args: argparse.Namespace, port: int) -> LoadReport:
    """Load the server on 127.0.0.1:``port`` with a random input of the shape it reports."""
    async with await Client.connect("127.0.0.1", port) as c:
        stats = (await c.request("GET", "/stats")).json()
    spec = stats["input"] if args.single else stats["batch_input"]
    x = np.random.default_rng(1).standard_normal(spec["shape"]).astype(spec["dtype"])
    if args.json:
        body, content_type = json.dumps({"inputs": x.tolist()}).encode(), "application/json"
    else:
        body, content_type = x.astype(x.dtype.newbyteorder("<")).tobytes(), RAW_TYPE
    return await load_test(
        "127.0.0.1",
        port,
        clients=args.clients,
        requests_per_client=args.requests,
        payload=body,
        content_type=content_type,
    )


async def main(args: argparse.Namespace) -> None:
    if args.connect is not None:  # the load-generator process (or a server run elsewhere)
        report = await run_clients(args, args.connect)
        print(json.dumps(attrs.asdict(report)) if args.report_json else report)
        return
    with threadpool_limits(args.blas_threads):  # BLAS threads per engine: don't oversubscribe
        await serve_and_load(args)


def sleeping_pipeline(d0: hcqa.Device, d1: hcqa.Device, args: argparse.Namespace) -> hcqa.Pipeline:
    """Kernels that hold their device ``--sleep-ms`` without using the host CPU: what an
    accelerator's kernels look like from the host."""

    def busy(out: np.ndarray, x: np.ndarray) -> None:
        time.sleep(args.sleep_ms / 1e3)
        out[...] = x

    shape = (args.batch, args.width)
    return hcqa.Pipeline([(d0, busy), (d1, busy)], in_shape=shape, depth=args.depth)


async def serve_and_load(args: argparse.Namespace) -> None:
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} before the run")
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        if args.sleep_ms:
            pipe = sleeping_pipeline(d0, d1, args)
            kernels = f"kernels sleep {args.sleep_ms:g} ms"
        else:
            pipe = await mlp_pipeline(d0, d1, batch=args.batch, width=args.width, depth=args.depth)
            w = np.ones((args.width, args.width), np.float32)
            t0 = time.perf_counter()
            np.ones(pipe.in_shape, np.float32) @ w  # what one layer costs on the host
            kernels = f"one layer's matmul {(time.perf_counter() - t0) * 1e3:.1f} ms"
        x = np.random.default_rng(1).standard_normal(pipe.in_shape, dtype=np.float32)
        await pipe(x)  # warm up
        t0 = time.perf_counter()
        for _ in range(5):
            await pipe(x)
        alone = (time.perf_counter() - t0) / 5
        print(
            f"{pipe}: float32{list(pipe.in_shape)} per request; {kernels}; "
            f"one request alone {alone * 1e3:.1f} ms"
        )
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve, pipe, port=0))
            if args.same_process:
                report = await run_clients(args, port)
            else:  # clients in their own process, so they don't share the server's loop
                argv = [sys.executable, __file__, "--connect", str(port), "--report-json"]
                argv += ["--clients", str(args.clients), "--requests", str(args.requests)]
                argv += ["--json"] if args.json else []
                argv += ["--single"] if args.single else []
                done = await trio.run_process(argv, capture_stdout=True)
                report = LoadReport(**json.loads(done.stdout))
            print(report)
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=50, help="requests per client")
    parser.add_argument("--batch", type=int, default=128, help="rows per request")
    parser.add_argument("--width", type=int, default=2048, help="MLP width (sets kernel time)")
    parser.add_argument("--depth", type=int, default=2, help="pipeline depth (slots)")
    parser.add_argument("--sleep-ms", type=float, default=0, help="sleeping kernels instead")
    parser.add_argument("--blas-threads", type=int, default=1, help="BLAS threads per kernel")
    parser.add_argument("--json", action="store_true", help="send JSON instead of raw bytes")
    parser.add_argument("--single", action="store_true", help="send single samples (batched)")
    parser.add_argument("--same-process", action="store_true", help="clients share the loop")
    parser.add_argument("--connect", type=int, metavar="PORT", help="load a running server")
    parser.add_argument("--report-json", action="store_true", help=argparse.SUPPRESS)
    trio.run(main, parser.parse_args())
