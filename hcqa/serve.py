"""An async inference server: HTTP from trio (hypercorn's trio worker) awaiting a pipeline.

Theory of operation
-------------------
:func:`make_app` wraps a :class:`~hcqa.Pipeline` in a small ASGI app; :func:`serve` runs it
under hypercorn's trio worker, so the HTTP server, the pipeline's queue actors and the
devices' wake-ups all share one trio event loop. ``POST /infer`` decodes the body, then
``await pipeline(x)``: the handler task parks until the last stage's copyout fence is
reached. The kernels run in the devices' engine threads, so while they run the loop is
free and ``GET /health`` answers in well under a millisecond of its own work.

Backpressure is the pipeline's: at most ``depth`` microbatches are on the devices; more
requests wait on its semaphore (parked, costing no CPU); ``max_pending`` turns requests
beyond that many waiting into an immediate ``503`` instead. A client that disconnects
cancels its request: it leaves the queue, or stops waiting for its microbatch (whose
queued work still completes; the pipeline reuses the slot safely after it).

Decoding and encoding large JSON bodies takes milliseconds of pure Python, so bodies over
64 KiB are (de)serialised in a worker thread (``trio.to_thread``), keeping the loop's
stalls at the interpreter's GIL switch interval. Raw ``application/octet-stream``
bodies (little-endian, C order, exactly the input's size) need no such work.

Endpoints::

    GET  /health   200 {"status": "ok", ...} while every device is usable, else 503
    POST /infer    {"inputs": [[...], ...]} -> {"outputs": ..., "shape": ..., "dtype": ...}
                   or raw bytes -> raw bytes (headers x-hcqa-shape, x-hcqa-dtype)
                   400 bad body (expected vs got), 413 too large, 415 other media type,
                   500 DeviceFault, 503 closed device or too many waiting
    GET  /stats    server counters, latency percentiles, pipeline and device statistics

hypercorn is imported only by :func:`serve` (``pip install 'hcqa[serve]'``), so ``import
hcqa.serve`` and :func:`make_app` (for any other ASGI server) work without it.
:func:`mlp_pipeline` builds the two-layer demo that ``hcqa serve`` runs;
``examples/loadtest.py`` is the loopback load generator.
"""

from __future__ import annotations

import collections
import json
import math
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from hcqa.devices.base import Device
from hcqa.errors import DeviceClosed, DeviceFault, InvalidCommand, sole_error
from hcqa.pipeline import Pipeline, Stage

__all__ = ["make_app", "mlp_pipeline", "serve"]

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Reply = tuple[int, bytes, str, list[tuple[bytes, bytes]]]  # status, body, type, more headers

JSON_TYPE = "application/json"
RAW_TYPE = "application/octet-stream"
_OFFLOAD_BYTES = 1 << 16  # (de)serialise JSON bodies larger than this in a worker thread
_INSTALL = "pip install 'hcqa[serve]'"


class _Disconnected(Exception):
    """The client went away before its answer was ready: nobody to answer."""


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _spec(dtype: np.dtype[Any], shape: tuple[int, ...]) -> str:
    return f"{dtype}{list(shape)}"


class _App:
    """The ASGI app (see the module docstring); one per pipeline."""

    def __init__(
        self, pipeline: Pipeline, *, max_pending: int | None, max_body: int | None
    ) -> None:
        self.pipeline = pipeline
        self.max_pending = max_pending
        self.in_nbytes = math.prod(pipeline.in_shape) * pipeline.dtype.itemsize
        self.in_spec = _spec(pipeline.dtype, pipeline.in_shape)
        self.max_body = max_body or max(1 << 20, 32 * self.in_nbytes)
        self.devices = list({id(s.device): s.device for s in pipeline.stages}.values())
        self.started = time.monotonic()
        self.pending = 0  # /infer requests admitted and not yet answered
        self.counts: collections.Counter[int] = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=4096)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return  # websockets are not served
        route = (scope["method"], scope["path"].rstrip("/") or "/")
        try:
            if route == ("GET", "/health"):
                reply = self._health()
            elif route == ("GET", "/stats"):
                reply = _json_reply(200, self._stats())
            elif route == ("POST", "/infer"):
                reply = await self._infer(scope, receive)
            elif route[1] in ("/health", "/stats", "/infer"):
                raise _HttpError(405, f"method {route[0]} not allowed on {route[1]}")
            else:
                raise _HttpError(404, f"no endpoint {route[1]} (try /health, /infer, /stats)")
        except _HttpError as exc:
            reply = _json_reply(exc.status, {"error": " ".join(str(exc).split())})
        except _Disconnected:
            return
        status, body, ctype, extra = reply
        self.counts[status] += 1
        headers = [(b"content-type", ctype.encode()), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers + extra})
        await send({"type": "http.response.body", "body": body})

    # -- endpoints -------------------------------------------------------------------------

    def _health(self) -> Reply:
        devices = []
        for d in self.devices:
            s = d.statistics()
            devices.append(
                {
                    "name": s.name,
                    "timeline": s.timeline_value,
                    "pending": sum(q.submitted - q.completed for q in s.queues),
                    "faulted": s.faulted,
                    "hung": s.hung,
                    "closed": s.closed,
                }
            )
        bad = [d["name"] for d in devices if d["faulted"] or d["hung"] or d["closed"]]
        p = self.pipeline.statistics()
        doc = {
            "status": "unavailable" if bad else "ok",
            "unavailable": bad,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "requests_pending": self.pending,
            "pipeline": {"depth": p.depth, "in_flight": p.in_flight, "completed": p.completed},
            "devices": devices,
        }
        return _json_reply(503 if bad else 200, doc)

    def _stats(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        p50 = p99 = None  # nearest-rank percentiles in ms (numpy's "inverted_cdf")
        if lat:
            p50, p99 = (np.percentile(lat, [50, 99], method="inverted_cdf") * 1e3).tolist()
        p = self.pipeline
        return {
            "input": {"shape": list(p.in_shape), "dtype": str(p.dtype)},
            "output": {"shape": list(p.out_shape), "dtype": str(p.out_dtype)},
            "uptime_s": round(time.monotonic() - self.started, 3),
            "requests_pending": self.pending,
            "responses": {str(k): v for k, v in sorted(self.counts.items())},
            "infer_ms": {
                "count": len(lat),
                "p50": p50,
                "p99": p99,
                "max": lat[-1] * 1e3 if lat else None,
            },
            "pipeline": attrs.asdict(self.pipeline.statistics()),
            "devices": [attrs.asdict(d.statistics()) for d in self.devices],
        }

    async def _infer(self, scope: Scope, receive: Receive) -> Reply:
        if self.max_pending is not None and self.pending >= self.max_pending:
            raise _HttpError(503, f"too many requests waiting (limit {self.max_pending})")
        self.pending += 1
        t0 = time.perf_counter()
        try:
            ctype = _content_type(scope)
            if ctype not in (JSON_TYPE, RAW_TYPE):
                raise _HttpError(
                    415, f"Content-Type must be {JSON_TYPE} or {RAW_TYPE} (got {ctype or 'none'})"
                )
            body = await self._read_body(receive)
            big = len(body) > _OFFLOAD_BYTES
            if ctype == RAW_TYPE:
                x = self._from_raw(body)
            elif big:
                x = await trio.to_thread.run_sync(self._from_json, body)
            else:
                x = self._from_json(body)
            try:
                y = await self._run(x, receive)
            except InvalidCommand as exc:
                raise _HttpError(400, str(exc)) from exc
            except DeviceFault as exc:
                raise _HttpError(500, f"DeviceFault: {exc}") from exc
            except DeviceClosed as exc:
                raise _HttpError(503, f"DeviceClosed: {exc}") from exc
            extra: list[tuple[bytes, bytes]] = []
            if ctype == JSON_TYPE:
                out = await trio.to_thread.run_sync(_to_json, y) if big else _to_json(y)
            else:
                out = y.astype(y.dtype.newbyteorder("<"), copy=False).tobytes()
                shape = ",".join(map(str, y.shape)).encode()
                extra = [(b"x-hcqa-shape", shape), (b"x-hcqa-dtype", str(y.dtype).encode())]
            self.latencies.append(time.perf_counter() - t0)
            return 200, out, ctype, extra
        finally:
            self.pending -= 1

    async def _run(self, x: npt.NDArray[Any], receive: Receive) -> npt.NDArray[Any]:
        """``await pipeline(x)``, cancelled if the client disconnects meanwhile."""
        y: npt.NDArray[Any] | None = None
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                y = await self.pipeline(x)
            except Exception as exc:  # raised below, not wrapped in an ExceptionGroup
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        if y is None:
            raise _Disconnected
        return y

    # -- decoding ------------------------------------------------------------------------

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise _HttpError(413, f"body larger than {self.max_body} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _from_raw(self, body: bytes) -> npt.NDArray[Any]:
        p = self.pipeline
        if len(body) != self.in_nbytes:
            raise _HttpError(
                400,
                f"expected {self.in_nbytes} bytes of little-endian {self.in_spec} "
                f"(got {len(body)} bytes)",
            )
        x = np.frombuffer(body, dtype=p.dtype.newbyteorder("<")).reshape(p.in_shape)
        return x.astype(p.dtype)  # native byte order, writable, owned

    def _from_json(self, body: bytes) -> npt.NDArray[Any]:
        p = self.pipeline
        want = self.in_spec
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise _HttpError(400, f"body is not JSON ({exc})") from exc
        if not isinstance(doc, dict) or "inputs" not in doc:
            raise _HttpError(400, f'expected {{"inputs": {want}}} (got no "inputs" key)')
        try:
            x = np.asarray(doc["inputs"])
        except ValueError:
            raise _HttpError(400, f"expected inputs {want} (got a ragged nested list)") from None
        if x.dtype.kind not in "biuf" or not np.can_cast(x.dtype, p.dtype, "same_kind"):
            raise _HttpError(400, f"expected inputs {want} (got {x.dtype} values)")
        if x.shape != p.in_shape:
            raise _HttpError(400, f"expected inputs {want} (got shape {list(x.shape)})")
        return x.astype(p.dtype)


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _content_type(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-type":
            return str(value.decode("latin-1").split(";")[0].strip().lower())
    return ""


def _json_reply(status: int, doc: Any) -> Reply:
    return status, json.dumps(doc).encode(), JSON_TYPE, []


def _to_json(y: npt.NDArray[Any]) -> bytes:
    doc = {"outputs": y.tolist(), "shape": list(y.shape), "dtype": str(y.dtype)}
    return json.dumps(doc).encode()


def make_app(
    pipeline: Pipeline, *, max_pending: int | None = None, max_body: int | None = None
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """An ASGI app serving ``pipeline`` (see the module docstring for the endpoints).

    ``max_pending``: answer ``503`` to an ``/infer`` request when that many are already
    admitted (None: no limit; the pipeline's ``depth`` is still all that runs at once).
    ``max_body``: the largest request body accepted (default: 32 times the raw input size,
    at least 1 MiB, enough for the input as JSON text).
    """
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"make_app needs a hcqa.Pipeline (got {type(pipeline).__name__})")
    if max_pending is not None and max_pending < 1:
        raise ValueError(f"'max_pending' must be >= 1 or None (got {max_pending})")
    return _App(pipeline, max_pending=max_pending, max_body=max_body)


async def serve(
    pipeline: Pipeline,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_pending: int | None = None,
    log_level: str = "WARNING",
    hypercorn_options: Mapping[str, Any] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``pipeline`` over HTTP on ``host:port`` until cancelled.

    Runs hypercorn's trio worker in the current trio run. ``port=0`` picks a free port;
    ``await nursery.start(partial(serve, pipe, port=0))`` returns the bound port. A single
    error (``OSError`` for a port in use, ``KeyboardInterrupt``) is raised unwrapped.
    ``hypercorn_options`` sets more attributes of hypercorn's ``Config`` (``certfile``,
    ``keep_alive_timeout``, ``keep_alive_max_requests``, ...).
    """
    try:
        from hypercorn.config import Config
        from hypercorn.trio import serve as hypercorn_serve
    except ImportError as exc:
        raise ImportError(f"hcqa.serve needs hypercorn: {_INSTALL}") from exc
    app: Any = make_app(pipeline, max_pending=max_pending)
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.loglevel = log_level
    config.graceful_timeout = 1.0
    for key, value in (hypercorn_options or {}).items():
        if not hasattr(config, key):
            raise TypeError(f"hypercorn's Config has no option {key!r}")
        setattr(config, key, value)
    try:
        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(hypercorn_serve, app, config)
            task_status.started(int(binds[0].rsplit(":", 1)[1]))
    except BaseExceptionGroup as group:  # nurseries wrap one error (port in use, Ctrl-C)
        raise sole_error(group) from None


async def mlp_pipeline(
    d0: Device, d1: Device, *, batch: int = 32, width: int = 256, depth: int = 2, seed: int = 0
) -> Pipeline:
    """A two-layer MLP with random weights: ``relu(x @ w1)`` on ``d0``, ``@ w2`` on ``d1``.

    Input and output are ``float32[batch, width]``; each layer is ``2 * batch * width**2``
    flops, so ``width`` sets how long a microbatch keeps each device busy.
    """
    rng = np.random.default_rng(seed)
    scale = np.float32(1 / math.sqrt(width))
    w1 = d0.alloc(shape=(width, width), dtype="float32")
    w2 = d1.alloc(shape=(width, width), dtype="float32")
    for buf in (w1, w2):
        await buf.copyin(rng.standard_normal((width, width), dtype=np.float32) * scale)

    def dense_relu(out: npt.NDArray[Any], x: npt.NDArray[Any], w: npt.NDArray[Any]) -> None:
        np.matmul(x, w, out=out)
        np.maximum(out, 0, out=out)

    def dense(out: npt.NDArray[Any], x: npt.NDArray[Any], w: npt.NDArray[Any]) -> None:
        np.matmul(x, w, out=out)

    stages = [
        Stage(device=d0, program=dense_relu, params=(w1,), name="dense_relu"),
        Stage(device=d1, program=dense, params=(w2,), name="dense"),
    ]
    return Pipeline(stages, in_shape=(batch, width), depth=depth)
