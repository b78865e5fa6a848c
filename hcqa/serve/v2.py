"""The Open Inference Protocol (KServe v2 REST) beside ``/infer``: standard clients work.

Theory of operation
-------------------
A served app holds one or more models (:class:`~hcqa.serve.hosted.Hosted`: each with its
own tensors, batcher and state of readiness) sharing the app's
:class:`~hcqa.serve.metrics.State` (admission counter, body limit). :class:`V2` adds the
protocol's routes to the app:

- ``GET /v2/health/live`` (200 while the server runs) and ``/v2/health/ready`` (200 when
  every model is built and its devices usable, else 400 with the reason);
- ``GET /v2`` (server metadata: name, version, extensions);
- ``GET /v2/models/{m}`` (model metadata: versions, platform, the model's own input and
  output tensors with ``-1`` for the batch dimension) and ``/v2/models/{m}/ready``;
- ``GET /v2/models/{m}/config`` (Triton's model configuration: ``max_batch_size``, the
  tensors' ``dims`` without the batch dimension, ``dynamic_batching``, ``instance_group``)
  and ``/v2/models/{m}/stats`` (Triton's statistics extension; ``/v2/models/stats`` for
  every model);
- ``POST /v2/models/{m}/infer`` (JSON tensors, or binary tensor data after the JSON:
  :mod:`hcqa.serve.tensors`);
- ``POST /v2/repository/index`` (every model with its state).

Each also answers under ``/v2/models/{m}/versions/{v}/...``. An infer request reads its
body (bounded), parses and checks it (off the loop when large), is admitted (503 past
``max_pending``), and runs through :meth:`Hosted.run`: one row (``shape [1, ...]``) through
the model's batcher, more rows directly in chunks of the model's largest batch. The
request's ``parameters.timeout`` (microseconds, as Triton) bounds the run with a cancel
scope: on expiry the request's work is cancelled -- a row still waiting in the batcher
leaves it and never runs; one already dispatched is computed with its batch and dropped --
and the answer is 504 with the protocol's error body. A client that disconnects cancels
its request the same way (:func:`cancel_on_disconnect`, which ``/infer`` uses too).

Errors follow the protocol: a JSON object ``{"error": "..."}``; 400 for a request that
can't be used (what was expected, what came), 404 for an unknown model or version, 503
when admission refuses or the model is not ready, 500 for a device fault or a model's own
error.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import numpy.typing as npt
import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from hcqa.errors import InvalidCommand
from hcqa.serve.bodies import ClientGone, inflate, off_loop, read_body
from hcqa.serve.hosted import Hosted, Model, Unavailable, error_status
from hcqa.serve.http import DISCONNECT
from hcqa.serve.inputs import InputError
from hcqa.serve.metrics import State
from hcqa.serve.tensors import (
    HEADER_LENGTH,
    TensorSpec,
    encode_response,
    parse_request,
)
from hcqa.trace import serving

__all__ = ["NAME_PATTERN", "V2", "Model", "cancel_on_disconnect"]

T = TypeVar("T")

JSON_TYPE = "application/json"
RAW_TYPE = "application/octet-stream"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_OFFLOAD_BYTES = 1 << 16  # parse / encode bodies larger than this in a worker thread


def _json(status: int, doc: Any) -> Response:
    return Response(json.dumps(doc).encode(), status, media_type=JSON_TYPE)


def _error(status: int, message: str) -> Response:
    return _json(status, {"error": " ".join(message.split())})


class _NotFound(Exception):
    pass


class V2:
    """The protocol's routes over the app's models (the first answers ``/infer`` too)."""

    def __init__(self, state: State, server_version: str) -> None:
        for m in state.models:
            for what, value in (("name", m.name), ("version", m.version)):
                if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
                    raise InvalidCommand(
                        f"a model's {what} must be 1-64 letters, digits, '_', '.' or '-' "
                        f"(got {value!r})"
                    )
        if len(state.by_name) != len(state.models):
            names = [m.name for m in state.models]
            twice = sorted({n for n in names if names.count(n) > 1})
            raise InvalidCommand(f"model names must differ (got {', '.join(twice)} twice)")
        self.state = state
        self.models = state.by_name
        self.server_version = server_version

    def routes(self) -> list[Route]:
        routes = [
            Route("/v2", self.server_metadata, methods=["GET"]),
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2/repository/index", self.index, methods=["POST"]),
            Route("/v2/models/stats", self.all_stats, methods=["GET"]),
        ]
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            routes += [
                Route(base, self.model_metadata, methods=["GET"]),
                Route(f"{base}/ready", self.model_ready, methods=["GET"]),
                Route(f"{base}/config", self.model_config, methods=["GET"]),
                Route(f"{base}/stats", self.model_stats, methods=["GET"]),
                Route(f"{base}/infer", self.infer, methods=["POST"]),
            ]
        return routes

    def _model(self, request: Request) -> Hosted:
        name = request.path_params["model"]
        m = self.models.get(name)
        if m is None:
            served = ", ".join(self.models)
            raise _NotFound(f"unknown model '{name[:64]}' (this server has: {served})")
        version = request.path_params.get("version")
        if version is not None and version != m.version:
            raise _NotFound(f"model '{name}' has no version '{version[:64]}' (it has: {m.version})")
        return m

    def _lookup(self, request: Request, *, ready: bool = False) -> Hosted | Response:
        """The model the path names; else the answer: 404 for an unknown model or version,
        503 (with ``ready``) for a model that is not ready."""
        try:
            m = self._model(request)
            if ready:
                m.ready_target()
        except _NotFound as exc:
            return _error(404, str(exc))
        except Unavailable as exc:
            return _error(503, str(exc))
        return m

    async def server_metadata(self, request: Request) -> Response:
        doc = {
            "name": "hcqa",
            "version": self.server_version,
            "extensions": ["binary_tensor_data", "statistics", "model_configuration"],
        }
        return _json(200, doc)

    async def live(self, request: Request) -> Response:
        return Response(b"", 200)

    async def ready(self, request: Request) -> Response:
        bad = {m.name: u for m in self.models.values() if (u := m.unavailable())}
        if not bad:
            return Response(b"", 200)
        why = "; ".join(f"model '{k}': {v}" for k, v in bad.items())
        return _error(400, f"not ready: {why}")

    async def index(self, request: Request) -> Response:
        rows = []
        for m in self.models.values():
            why = m.unavailable()
            rows.append(
                {
                    "name": m.name,
                    "version": m.version,
                    "state": "UNAVAILABLE" if why else "READY",
                    "reason": why,
                }
            )
        return _json(200, rows)

    async def model_metadata(self, request: Request) -> Response:
        m = self._lookup(request, ready=True)
        if isinstance(m, Response):
            return m
        t = m.ready_target()
        doc = {
            "name": m.name,
            "versions": [m.version],
            "platform": t.platform,
            "inputs": [s.metadata() for s in t.inputs],
            "outputs": [s.metadata() for s in t.outputs],
        }
        return _json(200, doc)

    async def model_config(self, request: Request) -> Response:
        """Triton's model configuration: what tritonclient's ``get_model_config`` reads."""
        m = self._lookup(request, ready=True)
        if isinstance(m, Response):
            return m
        t = m.ready_target()

        def tensors(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
            return [
                {"name": s.name, "data_type": f"TYPE_{s.datatype}", "dims": list(s.sample_shape)}
                for s in specs
            ]

        kinds = {d.kind for d in t.devices}
        group = {
            "name": m.name,
            "kind": "KIND_GPU" if kinds - {"cpu"} else "KIND_CPU",
            "count": 1,
            "devices": [d.name for d in t.devices],
        }
        doc: dict[str, Any] = {
            "name": m.name,
            "platform": t.platform,
            "backend": t.backend,
            "version_policy": {"specific": {"versions": [m.version]}},
            "max_batch_size": t.rows,
            "input": tensors(t.inputs),
            "output": tensors(t.outputs),
            "instance_group": [group],
        }
        batcher = m.batcher
        if batcher is not None:
            doc["dynamic_batching"] = {
                "preferred_batch_size": [b for b in t.buckets if b <= batcher.max_batch],
                "max_queue_delay_microseconds": int(batcher.max_wait * 1e6),
            }
        return _json(200, doc)

    async def model_stats(self, request: Request) -> Response:
        m = self._lookup(request)
        if isinstance(m, Response):
            return m
        return _json(200, {"model_stats": [triton_stats(m)]})

    async def all_stats(self, request: Request) -> Response:
        return _json(200, {"model_stats": [triton_stats(m) for m in self.models.values()]})

    async def model_ready(self, request: Request) -> Response:
        m = self._lookup(request)
        if isinstance(m, Response):
            return m
        why = m.unavailable()
        if why:
            return _error(400, f"model '{m.name}' not ready: {why}")
        return Response(b"", 200)

    async def infer(self, request: Request) -> Response:
        m = self._lookup(request)
        if isinstance(m, Response):
            return m
        tracer = serving.active()
        if tracer is None:
            return await self._infer(request, m)
        with serving.request(tracer, f"POST /v2/models/{m.name}/infer", m.name) as args:
            response = await self._infer(request, m)
            args["status"] = response.status_code
            return response

    async def _infer(self, request: Request, m: Hosted) -> Response:
        st = self.state
        try:
            body = await read_body(request, st)  # 413, 408; ClientGone
            with st.admit(m):  # 503: admitted once the body has arrived
                return await self._admitted(request, m, body)
        except InputError as exc:
            return _error(exc.status, str(exc))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it

    async def _admitted(self, request: Request, m: Hosted, body: bytes) -> Response:
        st = self.state
        try:
            t = m.ready_target()
        except Unavailable as exc:
            return _error(503, str(exc))
        encoding = request.headers.get("content-encoding")
        if encoding is not None:  # tritonclient's request_compression_algorithm
            body = await off_loop(st.limiter, inflate, body, encoding, st.max_body)
        header = request.headers.get(HEADER_LENGTH)
        names = [s.name for s in t.outputs]
        args = (body, header, t.inputs, names)
        if len(body) > _OFFLOAD_BYTES:
            req = await off_loop(st.limiter, parse_request, *args)
        else:
            req = parse_request(*args)
        del body, args
        t0 = time.perf_counter()
        try:
            ys = await self._run(request, m, req.xs, req.timeout_us)
        except _Answer as answer:
            return answer.response
        st.record(m, time.perf_counter() - t0)
        by_name = dict(zip(names, ys, strict=True))
        asked = req.outputs
        if asked is None:
            asked = tuple((name, req.binary_output) for name in names)
        outputs = [(name, by_name[name], binary) for name, binary in asked]
        size = sum(y.nbytes for _, y, b in outputs if not b)
        if size > _OFFLOAD_BYTES:
            data, headers = await off_loop(
                st.limiter, encode_response, m.name, m.version, req.id, outputs
            )
        else:
            data, headers = encode_response(m.name, m.version, req.id, outputs)
        media = RAW_TYPE if headers else JSON_TYPE
        return Response(data, 200, headers, media_type=media)

    async def _run(
        self, request: Request, m: Hosted, xs: tuple[npt.NDArray[Any], ...], timeout_us: int
    ) -> tuple[npt.NDArray[Any], ...]:
        """The model's outputs for ``xs``, within the request's timeout."""
        limit = timeout_us / 1e6 if timeout_us else math.inf
        try:
            with anyio.move_on_after(limit) as scope:
                ys = await cancel_on_disconnect(request, m.run, xs)
        except Exception as exc:
            status, message = error_status(exc)
            raise _Answer(_error(status, message)) from None
        if scope.cancelled_caught:
            raise _Answer(
                _error(
                    504,
                    f"request timed out: parameters.timeout is {timeout_us} us; its work "
                    "was cancelled",
                )
            )
        return ys


async def cancel_on_disconnect(request: Request, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await fn(*args)``, cancelled if the client disconnects meanwhile (ClientGone)."""
    notify = request.scope.get("extensions", {}).get(DISCONNECT)
    if notify is not None:  # hcqa's HTTP server (trio's) cancels us itself: no watcher task
        with trio.CancelScope() as scope:
            forget = notify(scope.cancel)
            try:
                return await fn(*args)
            finally:
                forget()
        raise ClientGone
    result: list[T] = []
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


class _Answer(Exception):
    """A response that ends the request early."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def triton_stats(h: Hosted) -> dict[str, Any]:
    """A served model's entry of Triton's statistics extension (``model_stats``)."""
    stats = None if h.batcher is None else h.batcher.statistics()
    queue = {"count": 0, "ns": 0}  # the batcher's: a direct run does not queue
    if stats is not None:
        queue = {"count": stats.samples, "ns": int(stats.queue_wait_total * 1e9)}
    return {
        "name": h.name,
        "version": h.version,
        "last_inference": h.last_inference_ms,
        "inference_count": h.inferences,
        "execution_count": h.executions,
        "inference_stats": {
            "success": h.success.doc(),
            "fail": h.fail.doc(),
            "queue": queue,
            "compute_input": h.compute_input.doc(),
            "compute_infer": h.compute_infer.doc(),
            "compute_output": h.compute_output.doc(),
            "cache_hit": {"count": 0, "ns": 0},
            "cache_miss": {"count": 0, "ns": 0},
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": t[0].doc(),
                "compute_infer": t[1].doc(),
                "compute_output": t[2].doc(),
            }
            for size, t in sorted(h.by_size.items())
        ],
        "memory_usage": [],
    }
