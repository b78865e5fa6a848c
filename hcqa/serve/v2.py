"""The Open Inference Protocol (KServe v2 REST) beside ``/infer``: standard clients work.

Theory of operation
-------------------
A served app holds one or more :class:`Served` models, each a pipeline (its largest batch
size), its own batcher and its own :class:`~hcqa.serve.metrics.State` (admission counter,
body limit, devices). :class:`V2` adds the protocol's routes to the app:

- ``GET /v2/health/live`` (200 while the server runs) and ``/v2/health/ready`` (200 when
  every model is ready, else 400 with the reason);
- ``GET /v2`` (server metadata: name, version, extensions);
- ``GET /v2/models/{m}`` (model metadata: versions, platform, the input and output
  tensors with ``-1`` for the batch dimension) and ``/v2/models/{m}/ready``;
- ``POST /v2/models/{m}/infer`` (JSON tensors, or binary tensor data after the JSON:
  :mod:`hcqa.serve.tensors`);
- ``POST /v2/repository/index`` (every model with its state).

Each also answers under ``/v2/models/{m}/versions/{v}/...``. An infer request reads its
body (bounded), parses and checks it (off the loop when large), is admitted (503 past
``max_pending``), and runs as ``/infer`` runs: one row (``shape [1, ...]``) through the
model's batcher, more rows directly in chunks of the pipeline's batch. The request's
``parameters.timeout`` (microseconds, as Triton) bounds the run with a cancel scope: on
expiry the request's work is cancelled -- a row still waiting in the batcher leaves it
and never runs; one already dispatched is computed with its batch and dropped -- and the
answer is 504 with the protocol's error body. A client that disconnects cancels its
request the same way.

Errors follow the protocol: a JSON object ``{"error": "..."}``; 400 for a request that
can't be used (what was expected, what came), 404 for an unknown model or version, 503
when admission or the devices refuse, 500 for a device fault.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
import attrs
import numpy as np
import numpy.typing as npt
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from hcqa.batcher import Batcher
from hcqa.errors import DeviceClosed, DeviceFault, HcqaError, InvalidCommand
from hcqa.serve.bodies import ClientGone, inflate, off_loop, read_body
from hcqa.serve.inputs import InputError
from hcqa.serve.metrics import State
from hcqa.serve.tensors import (
    HEADER_LENGTH,
    TensorSpec,
    encode_response,
    parse_request,
)

__all__ = ["NAME_PATTERN", "V2", "Model", "Served"]

JSON_TYPE = "application/json"
RAW_TYPE = "application/octet-stream"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_OFFLOAD_BYTES = 1 << 16  # parse / encode bodies larger than this in a worker thread


def _json(status: int, doc: Any) -> Response:
    return Response(json.dumps(doc).encode(), status, media_type=JSON_TYPE)


def _error(status: int, message: str) -> Response:
    return _json(status, {"error": " ".join(message.split())})


def _output_of(pipeline: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """The shape (batch dim first) and dtype of what ``pipeline`` returns."""
    if hasattr(pipeline, "out_shape"):
        return tuple(pipeline.out_shape), np.dtype(pipeline.out_dtype)
    shape, dtype = pipeline.shapes[-1]  # a ProcessPipeline
    return tuple(shape), np.dtype(dtype)


@attrs.frozen(kw_only=True)
class Model:
    """A model for :func:`hcqa.serve.serve`: its ``name`` in the protocol's URLs, its
    ``pipeline`` (a ``Pipeline``, a ``ProcessPipeline``, or a list of pipelines over the same
    rows in batches of different sizes, see :func:`hcqa.open_batcher`), its ``version``, and
    how its single samples are batched (``max_batch``: default the largest batch; 1: off)."""

    name: str
    pipeline: Any
    version: str = "1"
    max_batch: int | None = None
    max_wait: float = 0.002


class Rows(Protocol):
    """What a served model runs its rows through: the ``/infer`` machinery of ``app.py``
    (its batcher or its chunks), handed over by the app (this module sits below it)."""

    async def _cancel_on_disconnect(
        self, request: Request, fn: Callable[..., Awaitable[npt.NDArray[Any]]], *args: Any
    ) -> npt.NDArray[Any]: ...

    async def _run(self, x: npt.NDArray[Any], single: bool) -> npt.NDArray[Any]: ...


class Served:
    """One model of a served app: its name and version, state, tensors, and the ``/infer``
    machinery its rows go through (``endpoints``: made by the app from ``state``)."""

    def __init__(
        self, name: str, version: str, state: State, endpoints: Callable[[State], Rows]
    ) -> None:
        for what, value in (("name", name), ("version", version)):
            if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
                raise InvalidCommand(
                    f"a model's {what} must be 1-64 letters, digits, '_', '.' or '-' "
                    f"(got {value!r})"
                )
        self.name = name
        self.version = version
        self.state = state
        self.endpoints = endpoints(state)
        self.input = TensorSpec("input", state.shape.dtype, state.shape.sample_shape)
        out_shape, out_dtype = _output_of(state.pipeline)
        self.output = TensorSpec("output", out_dtype, out_shape[1:])

    @classmethod
    def make(
        cls,
        name: str,
        version: str,
        pipeline: Any,
        batcher: Batcher | None,
        *,
        max_pending: int | None,
        max_body: int | None,
        body_timeout: float = 30.0,
        endpoints: Callable[[State], Rows],
    ) -> Served:
        state = State(
            pipeline,
            batcher,
            max_pending=max_pending,
            max_body=max_body,
            body_timeout=body_timeout,
        )
        return cls(name, version, state, endpoints)

    def unavailable(self) -> list[str]:
        """The model's devices that faulted, hung or closed (empty: ready)."""
        rows = self.state.device_rows()
        return [d["name"] for d in rows if d["faulted"] or d["hung"] or d["closed"]]

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": "hcqa",
            "inputs": [self.input.metadata()],
            "outputs": [self.output.metadata()],
        }


class _NotFound(Exception):
    pass


class V2:
    """The protocol's routes over ``models`` (the first answers ``/infer`` too)."""

    def __init__(self, models: Sequence[Served], server_version: str) -> None:
        self.models: dict[str, Served] = {}
        for m in models:
            if m.name in self.models:
                raise InvalidCommand(f"two models are named {m.name!r}: names must differ")
            self.models[m.name] = m
        self.server_version = server_version

    def routes(self) -> list[Route]:
        routes = [
            Route("/v2", self.server_metadata, methods=["GET"]),
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2/repository/index", self.index, methods=["POST"]),
        ]
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            routes += [
                Route(base, self.model_metadata, methods=["GET"]),
                Route(f"{base}/ready", self.model_ready, methods=["GET"]),
                Route(f"{base}/infer", self.infer, methods=["POST"]),
            ]
        return routes

    def _model(self, request: Request) -> Served:
        name = request.path_params["model"]
        m = self.models.get(name)
        if m is None:
            served = ", ".join(self.models)
            raise _NotFound(f"unknown model '{name[:64]}' (this server has: {served})")
        version = request.path_params.get("version")
        if version is not None and version != m.version:
            raise _NotFound(f"model '{name}' has no version '{version[:64]}' (it has: {m.version})")
        return m

    async def server_metadata(self, request: Request) -> Response:
        doc = {
            "name": "hcqa",
            "version": self.server_version,
            "extensions": ["binary_tensor_data"],
        }
        return _json(200, doc)

    async def live(self, request: Request) -> Response:
        return Response(b"", 200)

    async def ready(self, request: Request) -> Response:
        bad = {m.name: u for m in self.models.values() if (u := m.unavailable())}
        if not bad:
            return Response(b"", 200)
        why = "; ".join(f"model '{k}': devices {', '.join(v)} unusable" for k, v in bad.items())
        return _error(400, f"not ready: {why}")

    async def index(self, request: Request) -> Response:
        rows = []
        for m in self.models.values():
            bad = m.unavailable()
            rows.append(
                {
                    "name": m.name,
                    "version": m.version,
                    "state": "UNAVAILABLE" if bad else "READY",
                    "reason": f"devices {', '.join(bad)} unusable" if bad else "",
                }
            )
        return _json(200, rows)

    async def model_metadata(self, request: Request) -> Response:
        try:
            return _json(200, self._model(request).metadata())
        except _NotFound as exc:
            return _error(404, str(exc))

    async def model_ready(self, request: Request) -> Response:
        try:
            m = self._model(request)
        except _NotFound as exc:
            return _error(404, str(exc))
        bad = m.unavailable()
        if bad:
            return _error(400, f"model '{m.name}' not ready: devices {', '.join(bad)} unusable")
        return Response(b"", 200)

    async def infer(self, request: Request) -> Response:
        try:
            m = self._model(request)
        except _NotFound as exc:
            return _error(404, str(exc))
        st = m.state
        try:
            body = await read_body(request, st)  # 413, 408; ClientGone
            with st.admit():  # 503: admitted once the body has arrived
                return await self._admitted(request, m, body)
        except InputError as exc:
            return _error(exc.status, str(exc))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it

    async def _admitted(self, request: Request, m: Served, body: bytes) -> Response:
        st = m.state
        encoding = request.headers.get("content-encoding")
        if encoding is not None:  # tritonclient's request_compression_algorithm
            body = await off_loop(st.limiter, inflate, body, encoding, st.max_body)
        header = request.headers.get(HEADER_LENGTH)
        args = (body, header, m.input, (m.output.name,))
        if len(body) > _OFFLOAD_BYTES:
            req = await off_loop(st.limiter, parse_request, *args)
        else:
            req = parse_request(*args)
        del body, args
        t0 = time.perf_counter()
        try:
            y = await self._run(request, m, req.x, req.timeout_us)
        except _Answer as answer:
            return answer.response
        st.latencies.append(time.perf_counter() - t0)
        if len(st.latencies) > 8192:
            del st.latencies[:4096]
        asked = req.outputs if req.outputs is not None else ((m.output.name, req.binary_output),)
        outputs = [(name, y, binary) for name, binary in asked]
        if y.nbytes > _OFFLOAD_BYTES and not all(b for _, _, b in outputs):
            data, headers = await off_loop(
                st.limiter, encode_response, m.name, m.version, req.id, outputs
            )
        else:
            data, headers = encode_response(m.name, m.version, req.id, outputs)
        media = RAW_TYPE if headers else JSON_TYPE
        return Response(data, 200, headers, media_type=media)

    async def _run(
        self, request: Request, m: Served, x: npt.NDArray[Any], timeout_us: int
    ) -> npt.NDArray[Any]:
        """The model's output rows for ``x``, within the request's timeout."""
        ep = m.endpoints
        single = len(x) == 1
        limit = timeout_us / 1e6 if timeout_us else math.inf
        try:
            with anyio.move_on_after(limit) as scope:
                y = await ep._cancel_on_disconnect(request, ep._run, x[0] if single else x, single)
        except (InvalidCommand, TypeError) as exc:
            raise _Answer(_error(400, str(exc))) from None
        except DeviceFault as exc:
            raise _Answer(_error(500, f"DeviceFault: {exc}")) from None
        except (DeviceClosed, HcqaError) as exc:
            raise _Answer(_error(503, f"{type(exc).__name__}: {exc}")) from None
        if scope.cancelled_caught:
            raise _Answer(
                _error(
                    504,
                    f"request timed out: parameters.timeout is {timeout_us} us; its work "
                    "was cancelled",
                )
            )
        return y[None] if single else y


class _Answer(Exception):
    """A response that ends the request early."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response
