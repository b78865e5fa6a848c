"""An async inference server: Starlette on trio (through anyio) under hypercorn.

Theory of operation
-------------------
:func:`make_app` builds a Starlette app around a :class:`~hcqa.Pipeline` (or a
:class:`~hcqa.ProcessPipeline`) and, optionally, a :class:`~hcqa.Batcher` over it;
:func:`serve` opens the batcher, runs the app under hypercorn's trio worker in the
current trio run, and drains on a shutdown trigger. The HTTP server, the batcher's
collector, the pipeline's queue actors and the devices' wake-ups share one event loop;
the kernels run in engine threads (or worker processes), so the loop only routes.

``POST /infer`` reads the body (bounded: 413 past ``max_body``), decodes it
(:mod:`hcqa._serve_inputs`: one sample or a batch, JSON or raw bytes, plain-language 400s)
and then

- one sample: ``await batcher(sample)`` -- it shares a microbatch with whatever other
  single samples are pending (without a batcher it runs alone, padded to the pipeline's
  batch dimension);
- a batch of ``n``: runs directly, in chunks of the pipeline's batch dimension (the last
  one padded), up to the pipeline's depth at once.

A client that disconnects cancels its request (see :mod:`hcqa.batcher` for what that
does to its batch). ``max_pending`` bounds the ``/infer`` requests admitted at once;
one more gets ``503`` at once instead of queueing.

Draining: when the shutdown trigger fires (``hcqa serve`` wires it to SIGTERM and
SIGINT), hypercorn closes the listening sockets, lets requests in flight finish for up to
``grace_period`` seconds and closes idle keep-alive connections; then the batcher drains
and :func:`serve` returns.

Metrics: ``GET /metrics`` is Prometheus text from a private ``CollectorRegistry`` per app
(two apps in one process never share counters): request counts and latency histograms by
endpoint and status, and, read at scrape time, the batch-size histogram, queue depths,
batches in flight and each device's busy state.

The app's own code awaits through anyio, not trio, so it can later run under an asyncio
server too; the pipeline and batcher it awaits are hcqa's.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from hcqa._serve_inputs import InputError, Shape, from_json, from_raw
from hcqa.batcher import Batcher, open_batcher
from hcqa.devices.base import Device
from hcqa.errors import DeviceClosed, DeviceFault, HcqaError, InvalidCommand, sole_error
from hcqa.pipeline import Pipeline, Stage

try:
    import anyio  # comes with starlette
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.registry import Collector
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        f"hcqa.serve needs starlette and prometheus-client: {exc.name} is "
        "missing (pip install 'hcqa[serve]')"
    ) from exc

__all__ = ["make_app", "mlp_pipeline", "serve"]

JSON_TYPE = "application/json"
RAW_TYPE = "application/octet-stream"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_OFFLOAD_BYTES = 1 << 16  # (de)serialise JSON bodies larger than this in a worker thread
_INSTALL = "pip install 'hcqa[serve]'"
_ENDPOINTS = ("/health", "/infer", "/metrics", "/stats")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)


def _json(status: int, doc: Any, headers: Mapping[str, str] | None = None) -> Response:
    return Response(json.dumps(doc).encode(), status, headers, media_type=JSON_TYPE)


def _error(status: int, message: str) -> Response:
    return _json(status, {"error": " ".join(message.split())})


class _Disconnected(Exception):
    """The client went away before its answer was ready: nobody to answer."""


class _State:
    """What the endpoints share: the pipeline, the batcher, counters and metrics."""

    def __init__(
        self,
        pipeline: Any,
        batcher: Batcher | None,
        *,
        max_pending: int | None,
        max_body: int | None,
    ) -> None:
        self.pipeline = pipeline
        self.batcher = batcher
        self.max_pending = max_pending
        self.rows = int(pipeline.in_shape[0])
        self.shape = Shape(tuple(pipeline.in_shape[1:]), np.dtype(pipeline.dtype))
        batch_nbytes = self.rows * self.shape.nbytes
        self.max_body = max_body or max(1 << 20, 32 * batch_nbytes)
        devices = [getattr(s, "device", None) for s in getattr(pipeline, "stages", ())]
        devices.append(getattr(pipeline, "device", None))
        self.devices: list[Device] = list(
            {id(d): d for d in devices if isinstance(d, Device)}.values()
        )
        self.started = time.monotonic()
        self.pending = 0  # /infer requests admitted and not yet answered
        self.latencies: list[float] = []  # successful /infer, seconds; last 4096
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "hcqa_requests",
            "HTTP requests answered",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "hcqa_request_duration_seconds",
            "HTTP request latency, from the first byte of the request to the response",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_ScrapeTime(self))

    def device_rows(self) -> list[dict[str, Any]]:
        rows = []
        for d in self.devices:
            s = d.statistics()
            rows.append(
                {
                    "name": s.name,
                    "timeline": s.timeline_value,
                    "pending": sum(q.submitted - q.completed for q in s.queues),
                    "faulted": s.faulted,
                    "hung": s.hung,
                    "closed": s.closed,
                }
            )
        return rows


class _ScrapeTime(Collector):
    """Metrics read from the batcher, pipeline and devices when ``/metrics`` is scraped."""

    def __init__(self, state: _State) -> None:
        self.state = state

    def collect(self) -> Iterable[Any]:
        st = self.state
        yield GaugeMetricFamily(
            "hcqa_requests_pending",
            "/infer requests admitted and not yet answered",
            value=st.pending,
        )
        p = st.pipeline.statistics()
        yield GaugeMetricFamily(
            "hcqa_pipeline_in_flight", "microbatches on the pipeline now", value=p.in_flight
        )
        yield GaugeMetricFamily("hcqa_pipeline_depth", "microbatches allowed", value=p.depth)
        if st.batcher is not None:
            b = st.batcher.statistics()
            yield GaugeMetricFamily(
                "hcqa_batcher_queue_depth", "single samples waiting for a batch", value=b.pending
            )
            yield GaugeMetricFamily(
                "hcqa_batcher_in_flight", "batches running now", value=b.in_flight
            )
            buckets, total = [], 0
            edges = sorted({2**k for k in range(b.max_batch.bit_length())} | {b.max_batch})
            for edge in edges:
                total = sum(b.batch_sizes[:edge])
                buckets.append((str(edge), total))
            buckets.append(("+Inf", b.batches))
            yield HistogramMetricFamily(
                "hcqa_batch_size",
                "samples per batch run by the dynamic batcher",
                buckets=buckets,
                sum_value=b.samples,
            )
            for name, q, v in (("p50", 0.5, b.queue_wait_p50), ("p99", 0.99, b.queue_wait_p99)):
                yield GaugeMetricFamily(
                    f"hcqa_batcher_queue_wait_{name}_seconds",
                    f"queue wait, quantile {q}, of the last 4096 single samples",
                    value=0.0 if math.isnan(v) else v,
                )
        busy = GaugeMetricFamily(
            "hcqa_device_busy", "1 while the device has work queued or running", labels=["device"]
        )
        queued = GaugeMetricFamily(
            "hcqa_device_pending_batches",
            "command batches submitted, not completed",
            labels=["device"],
        )
        healthy = GaugeMetricFamily(
            "hcqa_device_usable", "0 once the device faulted, hung or closed", labels=["device"]
        )
        for d in st.device_rows():
            busy.add_metric([d["name"]], 1.0 if d["pending"] else 0.0)
            queued.add_metric([d["name"]], d["pending"])
            healthy.add_metric([d["name"]], 0.0 if d["faulted"] or d["hung"] or d["closed"] else 1)
        yield from (busy, queued, healthy)


class _Endpoints:
    def __init__(self, state: _State) -> None:
        self.st = state

    async def health(self, request: Request) -> Response:
        st = self.st
        devices = st.device_rows()
        bad = [d["name"] for d in devices if d["faulted"] or d["hung"] or d["closed"]]
        p = st.pipeline.statistics()
        doc = {
            "status": "unavailable" if bad else "ok",
            "unavailable": bad,
            "uptime_s": round(time.monotonic() - st.started, 3),
            "requests_pending": st.pending,
            "pipeline": {"depth": p.depth, "in_flight": p.in_flight, "completed": p.completed},
            "devices": devices,
        }
        return _json(503 if bad else 200, doc)

    async def stats(self, request: Request) -> Response:
        st = self.st
        lat = sorted(st.latencies)
        p50 = p99 = None  # nearest-rank percentiles in ms (numpy's "inverted_cdf")
        if lat:
            p50, p99 = (np.percentile(lat, [50, 99], method="inverted_cdf") * 1e3).tolist()
        p = st.pipeline
        doc = {
            "input": {"shape": list(st.shape.sample_shape), "dtype": str(st.shape.dtype)},
            "batch_input": {"shape": list(p.in_shape), "dtype": str(st.shape.dtype)},
            "uptime_s": round(time.monotonic() - st.started, 3),
            "requests_pending": st.pending,
            "infer_ms": {
                "count": len(lat),
                "p50": p50,
                "p99": p99,
                "max": lat[-1] * 1e3 if lat else None,
            },
            "batcher": None if st.batcher is None else _plain(st.batcher.statistics()),
            "pipeline": _plain(p.statistics()),
            "devices": [_plain(d.statistics()) for d in st.devices],
        }
        return _json(200, doc)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.st.registry), media_type=METRICS_TYPE)

    async def infer(self, request: Request) -> Response:
        st = self.st
        if st.max_pending is not None and st.pending >= st.max_pending:
            return _error(503, f"too many requests waiting (limit {st.max_pending})")
        st.pending += 1
        t0 = time.perf_counter()
        try:
            response = await self._infer(request)
        except InputError as exc:
            return _error(exc.status, str(exc))
        finally:
            st.pending -= 1
        if response.status_code == 200:
            st.latencies.append(time.perf_counter() - t0)
            if len(st.latencies) > 8192:
                del st.latencies[:4096]
        return response

    async def _infer(self, request: Request) -> Response:
        st = self.st
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in (JSON_TYPE, RAW_TYPE):
            return _error(
                415, f"Content-Type must be {JSON_TYPE} or {RAW_TYPE} (got {ctype or 'none'})"
            )
        body = await self._body(request)
        big = len(body) > _OFFLOAD_BYTES
        if ctype == RAW_TYPE:
            x, single = from_raw(body, st.shape)
        elif big:
            x, single = await anyio.to_thread.run_sync(from_json, body, st.shape)
        else:
            x, single = from_json(body, st.shape)
        try:
            y = await self._cancel_on_disconnect(request, self._run, x, single)
        except _Disconnected:
            return Response(status_code=499)  # nobody reads it
        except (InvalidCommand, TypeError) as exc:
            return _error(400, str(exc))
        except DeviceFault as exc:
            return _error(500, f"DeviceFault: {exc}")
        except (DeviceClosed, HcqaError) as exc:
            return _error(503, f"{type(exc).__name__}: {exc}")
        if ctype == JSON_TYPE:
            out = await anyio.to_thread.run_sync(_to_json, y) if big else _to_json(y)
            return Response(out, media_type=JSON_TYPE)
        shape = ",".join(map(str, y.shape))
        headers = {"x-hcqa-shape": shape, "x-hcqa-dtype": str(y.dtype)}
        data = y.astype(y.dtype.newbyteorder("<"), copy=False).tobytes()
        return Response(data, headers=headers, media_type=RAW_TYPE)

    async def _body(self, request: Request) -> bytes:
        limit = self.st.max_body
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise InputError(413, f"body larger than {limit} bytes (got {int(declared)} bytes)")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise InputError(413, f"body larger than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _cancel_on_disconnect(
        self, request: Request, fn: Callable[..., Awaitable[npt.NDArray[Any]]], *args: Any
    ) -> npt.NDArray[Any]:
        """``await fn(*args)``, cancelled if the client disconnects meanwhile."""
        result: list[npt.NDArray[Any]] = []
        error: list[BaseException] = []

        async def watch(scope: anyio.CancelScope) -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, tg.cancel_scope)
            try:
                result.append(await fn(*args))
            except Exception as exc:  # raised below, not wrapped in an ExceptionGroup
                error.append(exc)
            tg.cancel_scope.cancel()
        if error:
            raise error[0]
        if not result:
            raise _Disconnected
        return result[0]

    async def _run(self, x: npt.NDArray[Any], single: bool) -> npt.NDArray[Any]:
        st = self.st
        if single and st.batcher is not None:
            return await st.batcher(x)
        rows = x[None] if single else x
        chunks = [rows[i : i + st.rows] for i in range(0, len(rows), st.rows)]
        outs: list[npt.NDArray[Any] | None] = [None] * len(chunks)

        async def one(i: int) -> None:
            chunk = chunks[i]
            if len(chunk) < st.rows:
                padded = np.zeros((st.rows, *st.shape.sample_shape), st.shape.dtype)
                padded[: len(chunk)] = chunk
                chunk = padded
            outs[i] = np.asarray(await st.pipeline(chunk))[: len(chunks[i])]

        if len(chunks) == 1:
            await one(0)
        else:
            errors: list[Exception] = []

            async def guarded(i: int, scope: anyio.CancelScope) -> None:
                try:
                    await one(i)
                except Exception as exc:
                    errors.append(exc)
                    scope.cancel()

            async with anyio.create_task_group() as tg:
                for i in range(len(chunks)):
                    tg.start_soon(guarded, i, tg.cancel_scope)
            if errors:
                raise errors[0]
        y = np.concatenate([o for o in outs if o is not None]) if len(outs) > 1 else outs[0]
        assert y is not None
        return y[0] if single else y


class _Measured:
    """ASGI middleware: counts and times every HTTP request by endpoint and status."""

    def __init__(self, app: ASGIApp, state: _State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        path = scope["path"].rstrip("/") or "/"
        endpoint = path if path in _ENDPOINTS else "other"
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            if status[0] != 499:
                self.state.requests.labels(endpoint, str(status[0])).inc()
                self.state.latency.labels(endpoint).observe(time.perf_counter() - t0)


def _plain(stats: Any) -> Any:
    """``stats`` as JSON-ready data: NaN (no data yet) becomes null."""

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        if isinstance(v, float) and math.isnan(v):
            return None
        return v if isinstance(v, int | float | str | bool | None) else str(v)

    return clean(attrs.asdict(stats))


def _to_json(y: npt.NDArray[Any]) -> bytes:
    doc = {"outputs": y.tolist(), "shape": list(y.shape), "dtype": str(y.dtype)}
    return json.dumps(doc).encode()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if exc.status_code == 404:
        return _error(404, f"no endpoint {path} (try {', '.join(_ENDPOINTS)})")
    if exc.status_code == 405:
        return _error(405, f"method {request.method} not allowed on {path}")
    return _error(exc.status_code, str(exc.detail))


def make_app(
    pipeline: Any,
    *,
    batcher: Batcher | None = None,
    max_pending: int | None = None,
    max_body: int | None = None,
) -> ASGIApp:
    """An ASGI app serving ``pipeline`` (a ``Pipeline`` or ``ProcessPipeline``).

    ``batcher``: single samples go through it (see :func:`hcqa.open_batcher`); without one
    each runs alone. ``max_pending``: answer ``503`` to an ``/infer`` request when that many
    are already admitted (None: no limit). ``max_body``: the largest request body accepted
    (default: 32 times the raw size of one pipeline batch, at least 1 MiB).
    """
    if not all(hasattr(pipeline, a) for a in ("in_shape", "dtype", "depth", "statistics")):
        raise TypeError(
            f"make_app needs a hcqa.Pipeline or ProcessPipeline (got {type(pipeline).__name__})"
        )
    if len(pipeline.in_shape) < 1:
        raise InvalidCommand(f"the pipeline needs a batch dimension (got in_shape {[]})")
    if max_pending is not None and (isinstance(max_pending, bool) or max_pending < 1):
        raise ValueError(f"'max_pending' must be >= 1 or None (got {max_pending})")
    state = _State(pipeline, batcher, max_pending=max_pending, max_body=max_body)
    ep = _Endpoints(state)
    routes = [
        Route("/health", ep.health, methods=["GET"]),
        Route("/stats", ep.stats, methods=["GET"]),
        Route("/metrics", ep.metrics, methods=["GET"]),
        Route("/infer", ep.infer, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.hcqa = state
    return _Measured(app, state)


async def serve(
    pipeline: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int | None = None,
    max_wait: float = 0.002,
    max_pending: int | None = None,
    grace_period: float = 10.0,
    access_log: str | None = None,
    log_level: str = "WARNING",
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    hypercorn_options: Mapping[str, Any] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``pipeline`` over HTTP on ``host:port`` until cancelled or drained.

    Single samples are batched (:func:`hcqa.open_batcher`, ``max_batch`` -- default the
    pipeline's batch dimension -- and ``max_wait``); ``max_batch=1`` turns batching off.
    ``pipeline`` may also be a list of pipelines taking the same rows in batches of different
    sizes (buckets, see :func:`hcqa.open_batcher`); whole-batch requests use the largest.
    ``port=0`` picks a free port; ``await nursery.start(partial(serve, pipe, port=0))``
    returns the bound port. When ``shutdown_trigger()`` returns, the server drains: it stops
    accepting, gives requests in flight ``grace_period`` seconds, and returns.
    ``access_log``: ``"-"`` for stdout, a file path, or None. A single startup error
    (``OSError`` for a port in use) is raised unwrapped. ``hypercorn_options`` sets more
    attributes of hypercorn's ``Config`` (``certfile``, ``keep_alive_timeout``, ...).
    """
    try:
        from hypercorn.config import Config
        from hypercorn.trio import serve as hypercorn_serve
    except ImportError as exc:
        raise ImportError(f"hcqa.serve needs hypercorn: {_INSTALL}") from exc
    if not (isinstance(grace_period, int | float) and 0 <= grace_period < math.inf):
        raise InvalidCommand(f"'grace_period' must be a finite number >= 0 (got {grace_period!r})")
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.loglevel = log_level
    config.graceful_timeout = float(grace_period)
    if access_log is not None:
        config.accesslog = _access_logger(access_log)
        config.access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(L)ss'
    for key, value in (hypercorn_options or {}).items():
        if not hasattr(config, key):
            raise TypeError(f"hypercorn's Config has no option {key!r}")
        setattr(config, key, value)
    try:
        largest = _largest(pipeline)
        async with _maybe_batcher(pipeline, max_batch, max_wait) as batcher:
            app: Any = make_app(largest, batcher=batcher, max_pending=max_pending)
            async with trio.open_nursery() as nursery:
                start = hypercorn_serve
                binds: list[str] = await nursery.start(
                    lambda task_status: start(
                        app, config, shutdown_trigger=shutdown_trigger, task_status=task_status
                    )
                )
                task_status.started(int(binds[0].rsplit(":", 1)[1]))
    except BaseExceptionGroup as group:  # nurseries wrap one error (port in use, Ctrl-C)
        raise sole_error(group) from None


def _access_logger(target: str) -> logging.Logger:
    """A logger writing one line per request to stdout (``"-"``) or a file."""
    logger = logging.getLogger(f"hcqa.serve.access.{target}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not logger.handlers:
        handler: logging.Handler = (
            logging.StreamHandler(sys.stdout) if target == "-" else logging.FileHandler(target)
        )
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
    return logger


def _largest(pipeline: Any) -> Any:
    """The pipeline itself, or the one with the largest batch of a list of them."""
    if isinstance(pipeline, list | tuple):
        if not pipeline:
            raise InvalidCommand("serve needs a pipeline (got an empty list)")
        return max(pipeline, key=lambda p: p.in_shape[0])
    return pipeline


@asynccontextmanager
async def _maybe_batcher(
    pipeline: Any, max_batch: int | None, max_wait: float
) -> AsyncIterator[Batcher | None]:
    if max_batch == 1:
        yield None
        return
    async with open_batcher(pipeline, max_batch=max_batch, max_wait=max_wait) as batcher:
        yield batcher


async def mlp_pipeline(
    d0: Device,
    d1: Device,
    *,
    batch: int = 32,
    width: int = 256,
    depth: int = 2,
    seed: int = 0,
    sleep: float = 0.0,
    buckets: Sequence[int] = (),
) -> Any:
    """A two-layer MLP with random weights: ``relu(x @ w1)`` on ``d0``, ``@ w2`` on ``d1``.

    Input and output are ``float32[batch, width]``; each layer is ``2 * batch * width**2``
    flops, so ``width`` sets how long a microbatch keeps each device busy. ``sleep`` adds
    that many seconds to each layer's kernel without using the host CPU (GIL released), as
    an accelerator's kernel looks from the host.

    ``buckets``: batch sizes smaller than ``batch`` for which to build pipelines too, sharing
    the weights; then the result is the list of pipelines, smallest first (a target for
    :func:`serve` and :func:`hcqa.open_batcher`: a lone sample runs in the batch-1 pipeline
    instead of being padded to ``batch`` rows).
    """
    rng = np.random.default_rng(seed)
    scale = np.float32(1 / math.sqrt(width))
    w1 = d0.alloc(shape=(width, width), dtype="float32")
    w2 = d1.alloc(shape=(width, width), dtype="float32")
    for buf in (w1, w2):
        await buf.copyin(rng.standard_normal((width, width), dtype=np.float32) * scale)

    def dense_relu(out: npt.NDArray[Any], x: npt.NDArray[Any], w: npt.NDArray[Any]) -> None:
        if sleep:
            time.sleep(sleep)
        np.matmul(x, w, out=out)
        np.maximum(out, 0, out=out)

    def dense(out: npt.NDArray[Any], x: npt.NDArray[Any], w: npt.NDArray[Any]) -> None:
        if sleep:
            time.sleep(sleep)
        np.matmul(x, w, out=out)

    stages = [
        Stage(device=d0, program=d0.program("dense_relu", dense_relu), params=(w1,)),
        Stage(device=d1, program=d1.program("dense", dense), params=(w2,)),
    ]
    sizes = sorted({b for b in buckets if b < batch} | {batch})
    pipes = [Pipeline(stages, in_shape=(b, width), depth=depth) for b in sizes]
    return pipes if buckets else pipes[0]
