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
fault's message; every other HTTP error is JSON too.

The endpoints await through anyio, not trio, so the app also runs under an asyncio
server (uvicorn); the pipeline and batcher it awaits are hcqa's, which host themselves
on asyncio.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import attrs
import numpy as np
import numpy.typing as npt
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from hcqa.batcher import Batcher
from hcqa.errors import DeviceClosed, DeviceFault, HcqaError, InvalidCommand
from hcqa.serve.bodies import ClientGone, InputError, dumps_array, inflate, off_loop, read_body
from hcqa.serve.http import DISCONNECT
from hcqa.serve.inputs import from_json, from_raw
from hcqa.serve.metrics import ENDPOINTS, Measured, State
from hcqa.serve.v2 import V2, Model, Served

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
        p = st.pipeline.statistics()
        doc = {
            "status": "unavailable" if bad else "ok",
            "unavailable": bad,
            "uptime_s": round(time.monotonic() - st.started, 3),
            "requests_pending": st.pending,
            "requests_receiving": st.receiving,
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
            "requests_receiving": st.receiving,
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
        t0 = time.perf_counter()
        try:
            response = await self._infer(request)
        except InputError as exc:
            return _error(exc.status, str(exc))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
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
        body = await read_body(request, st)
        with st.admit():
            return await self._admitted(request, ctype, body)

    async def _admitted(self, request: Request, ctype: str, body: bytes) -> Response:
        st = self.st
        encoding = request.headers.get("content-encoding")
        if encoding is not None:  # gzip (every member), deflate: bounded by max_body once inflated
            body = await off_loop(st.limiter, inflate, body, encoding, st.max_body)
        big = len(body) > _OFFLOAD_BYTES
        if ctype == RAW_TYPE:
            x, single = from_raw(body, st.shape)
        elif big:
            x, single = await off_loop(st.limiter, from_json, body, st.shape)
        else:
            x, single = from_json(body, st.shape)
        del body
        try:
            y = await self._cancel_on_disconnect(request, self._run, x, single)
        except (InvalidCommand, TypeError) as exc:
            return _error(400, str(exc))
        except DeviceFault as exc:
            return _error(500, f"DeviceFault: {exc}")
        except (DeviceClosed, HcqaError) as exc:
            return _error(503, f"{type(exc).__name__}: {exc}")
        if ctype == JSON_TYPE:
            out = await off_loop(st.limiter, _to_json, y) if y.size > 4096 else _to_json(y)
            return Response(out, media_type=JSON_TYPE)
        shape = ",".join(map(str, y.shape))
        headers = {"x-hcqa-shape": shape, "x-hcqa-dtype": str(y.dtype)}
        data = y.astype(y.dtype.newbyteorder("<"), copy=False).tobytes()
        return Response(data, headers=headers, media_type=RAW_TYPE)

    async def _cancel_on_disconnect(
        self, request: Request, fn: Callable[..., Awaitable[npt.NDArray[Any]]], *args: Any
    ) -> npt.NDArray[Any]:
        """``await fn(*args)``, cancelled if the client disconnects meanwhile."""
        notify = request.scope.get("extensions", {}).get(DISCONNECT)
        if notify is not None:  # hcqa's HTTP server cancels us itself: no watcher task
            with anyio.CancelScope() as scope:
                forget = notify(scope.cancel)
                try:
                    return await fn(*args)
                finally:
                    forget()
            raise ClientGone
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
            raise ClientGone
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
            left = iter(range(len(chunks)))

            async def worker(scope: anyio.CancelScope) -> None:
                # a few workers take the chunks in turn: one task per chunk would put tens of
                # thousands of tasks on the loop for a big batch of small rows
                try:
                    for i in left:
                        await one(i)
                except Exception as exc:
                    errors.append(exc)
                    scope.cancel()

            async with anyio.create_task_group() as tg:
                for _ in range(min(len(chunks), max(1, int(st.pipeline.depth)))):
                    tg.start_soon(worker, tg.cancel_scope)
            if errors:
                raise errors[0]
        y = np.concatenate([o for o in outs if o is not None]) if len(outs) > 1 else outs[0]
        assert y is not None
        return y[0] if single else y


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


def _largest(pipeline: Any) -> Any:
    """The pipeline itself, or the one with the largest batch of a list of them."""
    if isinstance(pipeline, list | tuple):
        if not pipeline:
            raise InvalidCommand("serve needs a pipeline (got an empty list)")
        return max(pipeline, key=lambda p: p.in_shape[0])
    return pipeline


def _version() -> str:
    from hcqa import __version__

    return __version__


def make_app(
    pipeline: Any,
    *,
    batcher: Batcher | None = None,
    max_pending: int | None = None,
    max_body: int | None = None,
    name: str = "model",
    version: str = "1",
    models: Sequence[tuple[Model, Batcher | None]] = (),
    body_timeout: float = 30.0,
) -> ASGIApp:
    """An ASGI app serving ``pipeline`` (a ``Pipeline`` or ``ProcessPipeline``).

    ``/infer`` and the Open Inference Protocol's ``/v2/models/{name}/...`` serve it;
    ``models``: more models for ``/v2`` only, each a :class:`~hcqa.serve.Model` (its
    ``pipeline`` the largest of its batch sizes) with its own open batcher (or None).

    ``batcher``: single samples go through it (see :func:`hcqa.open_batcher`); without one
    each runs alone. ``max_pending``: answer ``503`` to an ``/infer`` request when that many
    are already admitted (None: no limit); a request is admitted once its body has arrived.
    ``max_body``: the largest request body accepted (default: 32 times the raw size of one
    pipeline batch, at least 1 MiB; 413 past it). ``body_timeout``: seconds a request's body
    may take to arrive, from its headers to its last byte (408 past it).
    """
    if not all(hasattr(pipeline, a) for a in ("in_shape", "dtype", "depth", "statistics")):
        raise InvalidCommand(
            f"make_app needs a hcqa.Pipeline or ProcessPipeline (got {type(pipeline).__name__})"
        )
    if len(pipeline.in_shape) < 1:
        raise InvalidCommand(f"the pipeline needs a batch dimension (got in_shape {[]})")
    if max_pending is not None and (isinstance(max_pending, bool) or max_pending < 1):
        raise InvalidCommand(f"'max_pending' must be >= 1 or None (got {max_pending})")
    if not (isinstance(body_timeout, int | float) and 0 < body_timeout < math.inf):
        raise InvalidCommand(f"'body_timeout' must be a finite number > 0 (got {body_timeout!r})")
    state = State(
        pipeline, batcher, max_pending=max_pending, max_body=max_body, body_timeout=body_timeout
    )
    served = [Served(name, version, state, _Endpoints)]
    for model, model_batcher in models:
        served.append(
            Served.make(
                model.name,
                model.version,
                _largest(model.pipeline),
                model_batcher,
                max_pending=max_pending,
                max_body=max_body,
                body_timeout=body_timeout,
                endpoints=_Endpoints,
            )
        )
    v2 = V2(served, _version())
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
    return Measured(app, state)
