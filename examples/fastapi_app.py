"""FastAPI on uvicorn (asyncio) awaiting an hcqa pipeline: the same calls as under trio.

The app opens ``cpu:0`` and ``cpu:1`` in its lifespan, builds the demo two-layer MLP that
``hcqa serve`` runs (``hcqa.serve.mlp_pipeline``) and opens a batcher over it
(``hcqa.open_batcher``). ``POST /infer`` takes one sample or a batch of any size: whole
batches of the pipeline's ``batch`` rows go straight to the pipeline, and the rest (a lone
sample, a short batch, the tail of a long one) through the batcher, which gathers them with
other requests' rows into full batches (``infer_rows``). hcqa hosts its queue actors in a
trio guest run on uvicorn's own loop (see docs/asyncio.md), so the kernels run in the
devices' engine threads while the loop keeps serving.

    pip install -e '.[asyncio]'
    python examples/fastapi_app.py --port 8000      # or: uvicorn fastapi_app:app
    curl -s localhost:8000/health
    python -c 'import numpy as np, sys; sys.stdout.buffer.write(
        np.ones((5, 256), "<f4").tobytes())' > x.bin
    curl -s -H 'Content-Type: application/octet-stream' --data-binary @x.bin \\
        localhost:8000/infer | wc -c                # 5 * 256 float32 back

Endpoints (as ``hcqa serve``'s): ``POST /infer`` takes one sample ``float32[width]`` or a
batch ``float32[n, width]`` (any ``n >= 1``), as raw little-endian bytes (exactly one row's
bytes is one sample; answered in kind, with ``x-hcqa-shape`` / ``x-hcqa-dtype`` headers) or
as JSON ``{"inputs": [...]}`` / ``{"inputs": [[...], ...]}``; ``400`` for a bad body,
``500`` for a ``DeviceFault``, ``503`` once the devices are closed. ``GET /health``,
``GET /stats``.

A client that disconnects cancels its request, as in ``hcqa serve``: uvicorn (like most ASGI
servers) goes on running a handler whose client has gone, so ``cancel_on_disconnect`` awaits
the pipeline beside a watcher of the request's ``http.disconnect`` message, and cancels the
pipeline call when it comes. A call waiting for a pipeline slot then never runs, and one
already running stops waiting: nothing is computed for a client that is no longer there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import numpy as np
from fastapi import FastAPI, Request, Response

import hcqa
from hcqa.serve import mlp_pipeline

RAW_TYPE = "application/octet-stream"
MAX_ROWS = 4096  # rows in one request (each is a batcher call)
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``await work``; if the client disconnects first, cancel it and raise ``ClientGone``.

    Call it once the body is read: from then on the request's ``receive()`` waits until the
    client disconnects (``{"type": "http.disconnect"}``)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled itself: neither task outlives it
        watcher.cancel()
        task.cancel()  # a no-op once the work is done
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def infer_rows(pipe: hcqa.Pipeline, batch: hcqa.Batcher, rows: np.ndarray) -> np.ndarray:
    """``rows`` (``[n, width]``, any ``n >= 1``) through the model, in order: each whole
    batch of ``pipe``'s rows straight to ``pipe``, each row left over through the batcher
    (which pads nothing it can fill with other requests' rows)."""
    n = pipe.in_shape[0]
    whole = len(rows) - len(rows) % n
    calls = [pipe(rows[i : i + n]) for i in range(0, whole, n)]
    calls += [batch(row) for row in rows[whole:]]
    outs = await asyncio.gather(*calls)
    return np.concatenate([o if o.ndim == rows.ndim else o[None] for o in outs])


def create_app(*, batch: int = 32, width: int = 256, depth: int = 2) -> FastAPI:
    """The app; the devices live as long as its lifespan (uvicorn's startup to shutdown)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with hcqa.open_devices("cpu:0", "cpu:1") as devices:
            app.state.devices = devices
            app.state.pipe = await mlp_pipeline(*devices, batch=batch, width=width, depth=depth)
            async with hcqa.open_batcher(app.state.pipe, max_wait=0.002) as batcher:
                app.state.batch = batcher
                yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health(request: Request) -> Response:
        devices = request.app.state.devices
        ok = all(not (d.closed or d.statistics().faulted) for d in devices)
        doc = {"status": "ok" if ok else "unavailable", "devices": [d.name for d in devices]}
        return Response(json.dumps(doc), status_code=200 if ok else 503)

    @app.post("/infer")
    async def infer(request: Request) -> Response:
        pipe: hcqa.Pipeline = request.app.state.pipe
        body = await request.body()
        raw = request.headers.get("content-type", "").startswith(RAW_TYPE)
        try:
            x = _decode(body, raw, pipe)
            rows = x[None] if x.ndim == 1 else x  # one sample is a batch of one row
            work = infer_rows(pipe, request.app.state.batch, rows)  # asyncio awaiting hcqa
            y = await cancel_on_disconnect(request, work)
            y = y[0] if x.ndim == 1 else y
        except ClientGone:
            return Response(status_code=499)  # nobody is left to read it
        except (ValueError, hcqa.InvalidCommand) as exc:
            return _error(400, exc)
        except hcqa.DeviceFault as exc:
            return _error(500, exc)
        except hcqa.DeviceClosed as exc:
            return _error(503, exc)
        if raw:
            headers = {"x-hcqa-shape": ",".join(map(str, y.shape)), "x-hcqa-dtype": str(y.dtype)}
            return Response(y.astype("<f4").tobytes(), media_type=RAW_TYPE, headers=headers)
        doc = {"outputs": y.tolist(), "shape": list(y.shape), "dtype": str(y.dtype)}
        return Response(json.dumps(doc), media_type="application/json")

    @app.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        pipe: hcqa.Pipeline = request.app.state.pipe
        batcher: hcqa.Batcher = request.app.state.batch
        return {
            "pipeline": attrs.asdict(pipe.statistics()),
            "batcher": attrs.asdict(batcher.statistics()),
        }

    return app


def _decode(body: bytes, raw: bool, pipe: hcqa.Pipeline) -> np.ndarray:
    """One sample (``[width]``) or a batch (``[n, width]``), checked; the batcher checks
    each row's shape and dtype again."""
    width = pipe.in_shape[1]
    if raw:
        row = width * pipe.dtype.itemsize
        if not body or len(body) % row:
            raise ValueError(f"a raw body must be a multiple of {row} bytes (got {len(body)})")
        x = np.frombuffer(body, dtype="<f4").reshape(-1, width)
        x = x[0] if len(body) == row else x
    else:
        try:
            x = np.asarray(json.loads(body)["inputs"], dtype=pipe.dtype)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f'the body must be JSON {{"inputs": [...]}} or {{"inputs": [[...], ...]}} '
                f"(got {exc})"
            ) from exc
    if x.ndim not in (1, 2) or x.shape[-1] != width or not 1 <= len(x) <= MAX_ROWS:
        raise hcqa.InvalidCommand(
            f"inputs must be float32[{width}] or float32[n, {width}] with 1 <= n <= {MAX_ROWS} "
            f"(got shape {list(x.shape)})"
        )
    return x


def _error(status: int, exc: Exception) -> Response:
    doc = {"error": type(exc).__name__, "detail": str(exc)}
    return Response(json.dumps(doc), status_code=status, media_type="application/json")


app = create_app()


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    args = parser.parse_args()
    application = create_app(batch=args.batch, width=args.width, depth=args.depth)
    uvicorn.run(application, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
