"""The Starlette app of ``hcqa.serve``: the endpoints and their errors.

Theory of operation
-------------------
:func:`make_app` wraps a pipeline (and optionally a batcher) in four routes --
``/health``, ``/stats``, ``/metrics`` and ``POST /infer`` -- behind the counting
middleware of :mod:`hcqa.serve.metrics`. ``/infer`` reads its body
(:func:`hcqa.serve.bodies.read_body`: up to ``max_body``, 413; within ``body_timeout``,
408), only then admits the request (503 past ``max_pending``), decodes it
(:mod:`hcqa.serve.inputs`: 400 with what was expected and what came; JSON bodies past
64 KiB are parsed and their answers written in a worker thread, in bounded pieces, so the
loop keeps routing), runs it -- one sample through the batcher, a batch directly in
chunks of the pipeline's batch dimension -- and answers in the request's own encoding. A
client that disconnects, mid-body or while its request waits, cancels it and is counted
as a disconnect. Device faults answer 500 (or 503 once the device is unusable) with the
fault's message; every other HTTP error is JSON too. ``POST /infer``, the hot path, goes
straight to its endpoint (:class:`_Direct`), past Starlette's middlewares and router, and
its raw answer is framed without per-request formatting (the input's shape and the output
dtype's name are made once).

The endpoints await through anyio, not trio, so the app also runs under an asyncio
server (uvicorn); the pipeline and batcher it awaits are hcqa's, which host themselves
on asyncio.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from hcqa.batcher import Batcher
from hcqa.errors import InvalidCommand
from hcqa.serve.bodies import ClientGone, InputError, dumps_array, inflate, off_loop, read_body
from hcqa.serve.hosted import Hosted, Model, Unavailable, error_status
from hcqa.serve.inputs import Shape, from_json, from_raw
from hcqa.serve.metrics import ENDPOINTS, Measured, State
from hcqa.serve.tensors import TensorSpec
from hcqa.serve.v2 import V2, cancel_on_disconnect
from hcqa.trace import serving

__all__ = ["make_app"]

JSON_TYPE = "application/json"
RAW_TYPE = "application/octet-stream"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_OFFLOAD_BYTES = 1 << 16  # (de)serialise JSON bodies larger than this in a worker thread


def _json(status: int, doc: Any, headers: Mapping[str, str] | None = None) -> Response:
    return Response(json.dumps(doc).encode(), status, headers, media_type=JSON_TYPE)


def _error(status: int, message: str) -> Response:
    # after a 408 or 413 the rest of the body is unread: the connection can't be reused
    close = {"connection": "close"} if status in (408, 413) else None
    return _json(status, {"error": " ".join(message.split())}, close)


class _Endpoints:
    def __init__(self, state: State) -> None:
        self.st = state

    async def health(self, request: Request) -> Response:
        st = self.st
        devices = st.device_rows()
        bad = [d["name"] for d in devices if d["faulted"] or d["hung"] or d["closed"]]
        models = {m.name: m.unavailable() or "ready" for m in st.models}
        down = [n for n, why in models.items() if why.startswith(("failed", "devices"))]
        status = "unavailable" if bad or down else "ok"
        if status == "ok" and any(why != "ready" for why in models.values()):
            status = "starting"  # a model still builds (or recovers): alive, not ready
        doc = {
            "status": status,
            "unavailable": bad,
            "uptime_s": round(time.monotonic() - st.started, 3),
            "requests_pending": st.pending,
            "requests_receiving": st.receiving,
            "models": models,
            "devices": devices,
        }
        p = st.first.target.statistics() if st.first.target is not None else None
        if p is not None and hasattr(p, "in_flight"):
            doc["pipeline"] = {"depth": p.depth, "in_flight": p.in_flight, "completed": p.completed}
        return _json(503 if status == "unavailable" else 200, doc)

    def _model_stats(self, m: Hosted) -> dict[str, Any]:
        st = self.st
        lat = sorted(st.latencies[m.name])
        p50 = p99 = None  # nearest-rank percentiles in ms (numpy's "inverted_cdf")
        if lat:
            p50, p99 = (np.percentile(lat, [50, 99], method="inverted_cdf") * 1e3).tolist()
        t = m.target
        doc: dict[str, Any] = {"state": m.unavailable() or "ready"}
        if t is not None:
            doc["inputs"] = [_spec(s) for s in t.inputs]
            doc["outputs"] = [_spec(s) for s in t.outputs]
            if len(t.inputs) == 1:
                s = t.inputs[0]
                doc["input"] = {"shape": list(s.sample_shape), "dtype": str(s.dtype)}
                doc["batch_input"] = {"shape": [t.rows, *s.sample_shape], "dtype": str(s.dtype)}
        doc |= {
            "requests_pending": st.pending_by[m.name],
            "infer_ms": {
                "count": len(lat),
                "p50": p50,
                "p99": p99,
                "max": lat[-1] * 1e3 if lat else None,
            },
            "batcher": None if m.batcher is None else _plain(m.batcher.statistics()),
        }
        p = t.statistics() if t is not None else None
        doc["pipeline"] = None if p is None else _plain(p)
        doc["devices"] = [_plain(d.statistics()) for d in (t.devices if t is not None else ())]
        return doc

    async def stats(self, request: Request) -> Response:
        st = self.st
        models = {m.name: self._model_stats(m) for m in st.models}
        doc = {
            **models[st.first.name],  # the first model's, where /infer's clients look
            "uptime_s": round(time.monotonic() - st.started, 3),
            "requests_pending": st.pending,
            "requests_receiving": st.receiving,
            "models": models,
        }
        return _json(200, doc)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.st.registry), media_type=METRICS_TYPE)

    async def infer(self, request: Request) -> Response:
        tracer = serving.active()
        if tracer is None:
            return await self._timed(request)
        name = self.st.first.name
        with serving.request(tracer, f"POST /infer (model {name})", name) as args:
            response = await self._timed(request)
            args["status"] = response.status_code
            return response

    async def _timed(self, request: Request) -> Response:
        st = self.st
        t0 = time.perf_counter()
        try:
            response = await self._infer(request)
        except InputError as exc:
            return _error(exc.status, str(exc))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        if response.status_code == 200:
            st.record(st.first, time.perf_counter() - t0)
        return response

    async def _infer(self, request: Request) -> Response:
        st = self.st
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in (JSON_TYPE, RAW_TYPE):
            return _error(
                415, f"Content-Type must be {JSON_TYPE} or {RAW_TYPE} (got {ctype or 'none'})"
            )
        body = await read_body(request, st)
        with st.admit(st.first):
            return await self._admitted(request, ctype, body)

    async def _admitted(self, request: Request, ctype: str, body: bytes) -> Response:
        st, m = self.st, self.st.first
        try:
            t = m.ready_target()
        except Unavailable as exc:
            return _error(503, str(exc))
        if len(t.inputs) != 1 or len(t.outputs) != 1:
            return _error(
                400,
                f"/infer serves models of one input and one output; model '{m.name}' has "
                f"{len(t.inputs)} and {len(t.outputs)}: use POST /v2/models/{m.name}/infer",
            )
        spec = t.inputs[0]
        shape = _shape(spec.sample_shape, spec.dtype)
        encoding = request.headers.get("content-encoding")
        if encoding is not None:  # gzip (every member), deflate: bounded by max_body once inflated
            body = await off_loop(st.limiter, inflate, body, encoding, st.max_body)
        if ctype == RAW_TYPE:
            x, single = from_raw(body, shape)
        elif len(body) > _OFFLOAD_BYTES:
            x, single = await off_loop(st.limiter, from_json, body, shape)
        else:
            x, single = from_json(body, shape)
        del body
        try:
            (y,) = await cancel_on_disconnect(request, m.run, (x[None] if single else x,))
        except (ClientGone, InputError):
            raise
        except Exception as exc:
            status, message = error_status(exc)
            return _error(status, message)
        if single:
            y = y[0]
        if ctype == JSON_TYPE:
            out = await off_loop(st.limiter, _to_json, y) if y.size > 4096 else _to_json(y)
            return Response(out, media_type=JSON_TYPE)
        return _raw_answer(y)


@functools.lru_cache(maxsize=64)
def _shape(sample_shape: tuple[int, ...], dtype: np.dtype[Any]) -> Shape:
    """A model input's :class:`Shape` (made once: its messages are formatted strings)."""
    return Shape(sample_shape, dtype)


@functools.lru_cache(maxsize=64)
def _little(dtype: np.dtype[Any]) -> tuple[np.dtype[Any], bytes]:
    """``dtype`` in little-endian byte order, and its name as a header value."""
    return dtype.newbyteorder("<"), str(dtype).encode("latin-1")


def _raw_answer(y: npt.NDArray[Any]) -> Response:
    """``y`` as raw little-endian bytes, its shape and dtype in ``x-hcqa-*`` headers."""
    little, name = _little(y.dtype)
    data = y.astype(little, copy=False).tobytes()
    response = Response(data, media_type=RAW_TYPE)
    shape = ",".join(map(str, y.shape)).encode("latin-1")
    response.raw_headers[:0] = [(b"x-hcqa-shape", shape), (b"x-hcqa-dtype", name)]
    return response


def _spec(s: TensorSpec) -> dict[str, Any]:
    return {"name": s.name, "shape": list(s.sample_shape), "dtype": str(s.dtype)}


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
    tail = json.dumps({"shape": list(y.shape), "dtype": str(y.dtype)})[1:]
    return b'{"outputs": ' + dumps_array(y) + b", " + tail.encode()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if exc.status_code == 404:
        return _error(404, f"no endpoint {path} (try {', '.join(ENDPOINTS)})")
    if exc.status_code == 405:
        return _error(405, f"method {request.method} not allowed on {path}")
    return _error(exc.status_code, str(exc.detail))


def _version() -> str:
    from hcqa import __version__

    return __version__


def make_app(
    pipeline: Any = None,
    *,
    batcher: Batcher | None = None,
    max_pending: int | None = None,
    max_body: int | None = None,
    name: str = "model",
    version: str = "1",
    models: Sequence[tuple[Model, Batcher | None]] = (),
    body_timeout: float = 30.0,
    hosted: Sequence[Hosted] = (),
) -> ASGIApp:
    """An ASGI app serving ``pipeline`` (a ``models.Model``, ``Pipeline``, ``ProcessPipeline``,
    a list of pipelines as buckets, or an async batch callable: see :func:`hcqa.serve.serve`).

    ``/infer`` and the Open Inference Protocol's ``/v2/models/{name}/...`` serve it;
    ``models``: more models for ``/v2`` only, each a :class:`~hcqa.serve.Model` with its own
    open batcher (or None). (``hosted``: the models as ``serve()`` keeps them, instead.)

    ``batcher``: single samples go through it (see :func:`hcqa.open_batcher`); without one
    each runs alone. ``max_pending``: answer ``503`` to an inference request when that many
    are already admitted (None: no limit); a request is admitted once its body has arrived.
    ``max_body``: the largest request body accepted (default: 32 times the raw size of the
    largest model's batch, at least 1 MiB; 413 past it). ``body_timeout``: seconds a
    request's body may take to arrive, from its headers to its last byte (408 past it).
    """
    if max_pending is not None and (isinstance(max_pending, bool) or max_pending < 1):
        raise InvalidCommand(f"'max_pending' must be >= 1 or None (got {max_pending})")
    if max_body is not None and (
        isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1
    ):
        raise InvalidCommand(f"'max_body' must be an int >= 1 or None (got {max_body!r})")
    if not (isinstance(body_timeout, int | float) and 0 < body_timeout < math.inf):
        raise InvalidCommand(f"'body_timeout' must be a finite number > 0 (got {body_timeout!r})")
    if not hosted:
        if pipeline is None:
            raise InvalidCommand("make_app needs a model or pipeline to serve (got none)")
        first = Hosted.ready_now(Model(name=name, pipeline=pipeline, version=version), batcher)
        hosted = [first, *(Hosted.ready_now(m, b) for m, b in models)]
    state = State(hosted, max_pending=max_pending, max_body=max_body, body_timeout=body_timeout)
    v2 = V2(state, _version())
    ep = _Endpoints(state)
    routes = [
        Route("/health", ep.health, methods=["GET"]),
        Route("/stats", ep.stats, methods=["GET"]),
        Route("/metrics", ep.metrics, methods=["GET"]),
        Route("/infer", ep.infer, methods=["POST"]),
        *v2.routes(),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.hcqa = state
    return Measured(_Direct(app, ep.infer), state)


class _Direct:
    """``POST /infer`` straight to its endpoint, every other request through Starlette.

    The hot path skips Starlette's two middlewares and its router, which cost as much loop
    time as the endpoint's own work. Nothing else changes: the endpoint answers every error
    itself (it raises no ``HTTPException``), and an exception that escapes it reaches the
    server, which answers ``500`` as Starlette's error middleware would. Other paths and
    methods on ``/infer`` (``/infer/``, ``GET``) still get Starlette's redirect and ``405``.
    """

    def __init__(self, app: ASGIApp, infer: Callable[[Request], Awaitable[Response]]) -> None:
        self.app = app
        self.infer = infer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/infer" and scope["method"] == "POST":
            response = await self.infer(Request(scope, receive, send))
            await response(scope, receive, send)
        else:
            await self.app(scope, receive, send)
